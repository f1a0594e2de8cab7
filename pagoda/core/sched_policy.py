"""Scheduling policies: who goes first when not everyone fits.

- ``fcfs``: arrival order. A request's ``priority`` must be 0.
- ``priority``: the waiting queue is ordered by (priority, arrival); lower values run
  first. A waiting request may preempt running requests of strictly lower priority
  (higher value) when seats or KV blocks run out, and the victim of any preemption is
  the running request with the lowest priority (latest arrival among equals).
- ``fair``: requests carry a tenant. Each step's token budget is shared across the
  tenants that have work in proportion to their weights, and tenants take turns
  being admitted by their virtual token counters (tokens served / weight, the VTC of
  Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024), so a tenant
  flooding the server cannot starve another's time to first token. Shares are not
  hard caps: budget a tenant leaves unused goes to the others in the same step.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import ClassVar, Iterable

from pagoda.core.request import Request
from pagoda.tenants import DEFAULT_TENANT, TenantSpec

def queue_key(request: Request) -> tuple[bool, int, float]:
    """The waiting order of the priority and fair policies: background requests after all
    others, then (priority, arrival)."""
    return (request.background, request.priority, request.arrival_time)


def first_background(waiting: deque[Request]) -> int:
    """Where the background requests begin in a waiting queue (they are all at its end)."""
    i = len(waiting)
    while i > 0 and waiting[i - 1].background:
        i -= 1
    return i


class SchedulingPolicy:
    """Who goes first: the order of the waiting queue, whether a waiting request may
    preempt running ones, which running request is the victim, and whether each step's
    budget is shared out per tenant. One object per scheduler (the fair policy's keeps
    the tenants' counters)."""

    name: ClassVar[str]
    preempts_for_waiting: ClassVar[bool] = False   # a waiting request may take a running one's place
    shares_budget: ClassVar[bool] = False          # per-tenant quotas of each step's tokens

    def enqueue(self, waiting: deque[Request], request: Request, front: bool = False) -> None:
        """Put a request into the waiting queue: a new one, or a preempted one (``front``)."""
        # Equal keys keep their order: a new request goes after its equals, and a preempted
        # one goes back ahead of later arrivals of its priority.
        bisect.insort_right(waiting, request, key=queue_key)

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt: the most recently admitted background one, else
        the most recently admitted one."""
        for request in reversed(running):
            if request.background:
                return request
        return running[-1]


class Fcfs(SchedulingPolicy):
    """Arrival order; a preempted request goes back to the front."""

    name = "fcfs"

    def enqueue(self, waiting: deque[Request], request: Request, front: bool = False) -> None:
        # Background requests keep to the queue's end: a request goes to the front or the
        # back of its own class.
        if request.background:
            if front:
                waiting.insert(first_background(waiting), request)
            else:
                waiting.append(request)
        elif front:
            waiting.appendleft(request)
        elif waiting and waiting[-1].background:
            waiting.insert(first_background(waiting), request)
        else:
            waiting.append(request)


class Priority(SchedulingPolicy):
    """(priority, arrival) order, lower first; preempts strictly lower priorities; the
    victim is the lowest-priority running request (latest arrival among equals)."""

    name = "priority"
    preempts_for_waiting = True

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=queue_key)


class Fair(SchedulingPolicy):
    """Each step's budget shared across tenants by weight, admission by virtual token
    counters (``FairShare``); the queue within a tenant in (priority, arrival) order."""

    name = "fair"
    shares_budget = True


POLICIES: dict[str, type[SchedulingPolicy]] = {cls.name: cls for cls in (Fcfs, Priority, Fair)}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()


def weighted_shares(budget: int, weights: dict[str, float], demands: dict[str, int] | None = None) -> dict[str, int]:
    """Split ``budget`` tokens in proportion to ``weights``, in whole tokens that sum
    to at most ``budget``; the remainder goes by largest fraction. With ``demands``, a
    tenant never gets more than it asks for and what it leaves goes to the others in
    proportion to their weights (weighted max-min fairness, by water-filling).

    E.g. budget=10, weights {a: 1, b: 2} -> {a: 3, b: 7} (3.33 and 6.67, b's larger
    fraction gets the spare token); with demands {a: 1, b: 20} -> {a: 1, b: 9}.
    """
    shares: dict[str, int] = {}
    left = {t: w for t, w in weights.items() if w > 0}
    while left:
        total = sum(left.values())
        exact = {t: budget * w / total for t, w in left.items()}
        satisfied = [t for t in left if demands is not None and demands.get(t, 0) <= exact[t]]
        if not satisfied:
            part = {t: int(x) for t, x in exact.items()}
            spare = budget - sum(part.values())
            for t in sorted(exact, key=lambda t: part[t] - exact[t])[:spare]:
                part[t] += 1
            shares.update(part)
            break
        for t in satisfied:
            shares[t] = demands[t]  # type: ignore[index]
            budget -= demands[t]  # type: ignore[index]
            del left[t]
    return shares


class FairShare:
    """Per-tenant virtual token counters, weights and running limits.

    ``vtime[t]`` grows by tokens / weight for every token computed for tenant t. A
    tenant that becomes active (its first unfinished request arrives) is lifted to the
    smallest counter among active tenants, so idling never banks credit to burst with
    later. Tenants not in the spec table have weight 1 and no limits; their counters
    are dropped when they go idle, so arbitrary tenant names cannot grow this table.
    """

    def __init__(self, tenants: Iterable[TenantSpec] = ()) -> None:
        self.specs: dict[str, TenantSpec] = {t.name: t for t in tenants}
        self.vtime: dict[str, float] = {}
        self.num_unfinished: dict[str, int] = {}
        self.num_running: dict[str, int] = {}

    def weight(self, tenant: str) -> float:
        spec = self.specs.get(tenant)
        return spec.weight if spec is not None else 1.0

    def can_run_more(self, tenant: str) -> bool:
        spec = self.specs.get(tenant)
        limit = spec.max_running if spec is not None else None
        return limit is None or self.num_running.get(tenant, 0) < limit

    # ---- bookkeeping -------------------------------------------------------------
    def on_add(self, tenant: str) -> None:
        if self.num_unfinished.get(tenant, 0) == 0:
            active = [v for t, v in self.vtime.items() if self.num_unfinished.get(t, 0) > 0]
            floor = min(active) if active else 0.0
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), floor)
        self.num_unfinished[tenant] = self.num_unfinished.get(tenant, 0) + 1

    def on_finish(self, tenant: str) -> None:
        left = self.num_unfinished.get(tenant, 0) - 1
        if left > 0:
            self.num_unfinished[tenant] = left
            return
        self.num_unfinished.pop(tenant, None)
        if tenant not in self.specs:
            self.vtime.pop(tenant, None)

    def on_start_running(self, tenant: str) -> None:
        self.num_running[tenant] = self.num_running.get(tenant, 0) + 1

    def on_stop_running(self, tenant: str) -> None:
        left = self.num_running.get(tenant, 0) - 1
        if left > 0:
            self.num_running[tenant] = left
        else:
            self.num_running.pop(tenant, None)

    def charge(self, tenant: str, num_tokens: int) -> None:
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + num_tokens / self.weight(tenant)

    # ---- one step ----------------------------------------------------------------
    def quotas(self, budget: int, demands: dict[str, int]) -> dict[str, int]:
        """This step's token share of each tenant that has tokens to compute (``demands``:
        tenant -> tokens it could use this step)."""
        return weighted_shares(budget, {t: self.weight(t) for t in demands}, demands)

    def order(self, tenants: Iterable[str], pending: dict[str, int] | None = None) -> list[str]:
        """Tenants by virtual time, least served first (name breaks ties); ``pending``:
        tokens already given to each tenant in the step being scheduled."""
        pending = pending or {}
        return sorted(tenants, key=lambda t: (self.vtime.get(t, 0.0) + pending.get(t, 0) / self.weight(t), t))


def tenant_of(request: Request) -> str:
    return request.tenant or DEFAULT_TENANT
