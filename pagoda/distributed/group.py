"""The process groups of a tensor- and pipeline-parallel engine, over torch.distributed
(gloo on CPU, nccl on CUDA).

World: ``tp_size * pp_size`` ranks; rank r is TP rank ``r % tp_size`` of pipeline stage
``r // tp_size``. E.g. TP=2 x PP=2: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3. Rank 0 (stage 0,
TP rank 0) is the engine core. Each engine owns its groups; nothing goes through
torch.distributed's global default group, so several engines (tests, data-parallel replicas)
can live side by side. Every group of a rank shares one rendezvous store:

- ``control`` (gloo, every rank): rank 0 sends each step's inputs to the others, point to
  point, without waiting (``RankGroups.send_step``). Workers wait on it while the engine
  idles, so its timeout is long; a peer that dies closes its sockets, which ends a wait at once.
- ``TPGroup`` (one per stage, ``tp_size`` ranks): the collectives inside a forward (all-reduce
  after row-parallel layers, all-gather of logits), bounded by ``timeout`` so that a hung peer
  ends in an error, not a hang.
- ``PipeLink`` (every rank, when ``pp_size > 1``): point-to-point sends and receives between a
  stage and the next (hidden states and residual) and from the last stage to rank 0 (logits);
  when rank 0 asks, each later stage's TP rank 0 sends it the stage's expert counts (MoE).
"""

from __future__ import annotations

import datetime
import pickle
from collections import deque

import torch
import torch.distributed as dist

# A worker may wait this long for rank 0's next step (the engine can idle for days).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)
# Point-to-point tags: one FIFO channel per kind of message between two ranks.
_TAG_SIZE, _TAG_STEP, _TAG_ACTIVATIONS, _TAG_LOGITS, _TAG_EXPERT_LOAD = 1, 2, 3, 4, 5


class DistributedError(RuntimeError):
    """A peer of the parallel group is gone or did not answer in time."""


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: float) -> dist.Store:
    """The shared key-value store of the group: tcp://host:port (rank 0 hosts it) or
    env:// (MASTER_ADDR / MASTER_PORT, as torchrun sets them)."""
    store, _, _ = next(dist.rendezvous(init_method, rank=rank, world_size=world_size,
                                       timeout=datetime.timedelta(seconds=timeout)))
    return store


def _gloo_or_nccl(store: dist.Store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class _Sends:
    """Point-to-point sends in flight. A gloo send completes only once the peer posted its
    receive, so the sender does not wait: it keeps the tensor alive and waits for the oldest
    only when more than ``limit`` are pending (the peer consumes them in order)."""

    def __init__(self, group, limit: int) -> None:
        self.group = group
        self.limit = limit
        self._pending: deque = deque()

    def post(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((self.group.send([t], dst, tag), t))
        while len(self._pending) > self.limit:
            _wait(self._pending.popleft()[0])

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every pending send (each at most ``timeout`` seconds, if given)."""
        while self._pending:
            work = self._pending.popleft()[0]
            _wait(work, None if timeout is None else datetime.timedelta(seconds=timeout))


class TPGroup:
    """One stage's tensor-parallel ranks: ``rank`` and ``world_size`` count within the stage
    (what the parallel layers and the shard plan read)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.compute = _gloo_or_nccl(store, rank, world_size, device, datetime.timedelta(seconds=timeout))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns ``t``)."""
        _wait(self.compute.allreduce([t]))
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Largest value over ranks, element by element, in place (returns ``t``)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        _wait(self.compute.allreduce([t], opts))
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` (same shape on all ranks) along ``dim``."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        _wait(self.compute.allgather([parts], [t]))
        return torch.cat(parts, dim=dim)


class PipeLink:
    """A rank's links to the neighbouring pipeline stages: its counterpart (same TP rank) in
    the stage before and the stage after, and, from the last stage's TP rank 0, rank 0
    (which samples). Every stage runs the micro-batches in the order rank 0 sent them, so
    each link is a FIFO channel; sends do not wait (``_Sends``)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, tp_size: int, device: torch.device,
                 timeout: float) -> None:
        self.rank = rank
        self.tp_size = tp_size
        self.stage = rank // tp_size
        self.num_stages = world_size // tp_size
        self.device = device
        self.group = _gloo_or_nccl(store, rank, world_size, device, datetime.timedelta(seconds=timeout))
        # At most N micro-batches are unfinished, each with one activation message or up to two
        # logits messages (prompt logprobs, sampled rows) per link, and at most one step of them
        # also brings expert counts: a waiting send is always for a step rank 0 finishes next
        # (it takes the counts right after that step's logits), so waiting cannot deadlock.
        self._sends = _Sends(self.group, 2 * self.num_stages)

    def send_next(self, t: torch.Tensor) -> None:
        """To this TP rank of the next stage."""
        self._sends.post(t.contiguous(), self.rank + self.tp_size, _TAG_ACTIVATIONS)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """From this TP rank of the stage before (blocks until it arrives)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        _wait(self.group.recv([t], self.rank - self.tp_size, _TAG_ACTIVATIONS))
        return t

    def send_logits(self, t: torch.Tensor) -> None:
        """The last stage's logits to rank 0 (TP rank 0 sends; the others hold the same)."""
        if self.rank % self.tp_size == 0:
            self._sends.post(t.contiguous(), 0, _TAG_LOGITS)

    def send_expert_counts(self, t: torch.Tensor) -> None:
        """A later stage's TP rank 0: its MoE layers' counts to rank 0 (a stage's TP ranks
        route alike, so one of them speaks for the stage)."""
        self._sends.post(t.to(self.device).contiguous(), 0, _TAG_EXPERT_LOAD)

    def recv_expert_counts(self, stage: int, like: torch.Tensor) -> torch.Tensor:
        """Rank 0: stage ``stage``'s counts (shaped like rank 0's own; blocks until they come).
        After the step's logits, in the order the last stage sends them."""
        t = torch.empty_like(like, device=self.device)
        _wait(self.group.recv([t], stage * self.tp_size, _TAG_EXPERT_LOAD))
        return t.cpu()

    def recv_logits(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank 0: the logits of the last stage (float32). The other ranks of stage 0 do not
        sample: an empty [rows, 0] tensor."""
        if self.rank != 0:
            return torch.empty(shape[0], 0, device=self.device)
        t = torch.empty(shape, dtype=torch.float32, device=self.device)
        _wait(self.group.recv([t], (self.num_stages - 1) * self.tp_size, _TAG_LOGITS))
        return t


class RankGroups:
    """Every group one rank joins: the control channel, its stage's TP group (None when
    ``tp_size == 1``) and its pipeline link (None when ``pp_size == 1``)."""

    def __init__(self, store: dist.Store, rank: int, tp_size: int, pp_size: int, device: torch.device,
                 timeout: float) -> None:
        self.rank = rank
        self.world_size = tp_size * pp_size
        self.tp_size, self.pp_size = tp_size, pp_size
        self.stage, self.tp_rank = divmod(rank, tp_size)
        self.device = device
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("pagoda/control", store), rank, self.world_size,
                                             _CONTROL_TIMEOUT)
        self.tp = TPGroup(dist.PrefixStore(f"pagoda/compute/{self.stage}", store), self.tp_rank, tp_size, device,
                          timeout) if tp_size > 1 else None
        self.pipe = PipeLink(dist.PrefixStore("pagoda/pipe", store), rank, self.world_size, tp_size, device,
                             timeout) if pp_size > 1 else None
        # Every rank, bounded by ``timeout`` (the startup collectives): the pipeline's group, or
        # with one stage the TP group.
        self._world = self.pipe.group if self.pipe is not None else self.tp.compute
        # Rank 0's step messages on their way (two per step and worker).
        self._steps = _Sends(self.control, 4 * self.world_size * pp_size)
        self._store = store  # kept alive: rank 0's TCP store serves the others

    # ---- rank 0 -> workers -----------------------------------------------------------

    def send_step(self, obj: object) -> None:
        """Rank 0: send ``obj`` (pickled) to every other rank, without waiting for them."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        for dst in range(1, self.world_size):
            self._steps.post(size, dst, _TAG_SIZE)
            self._steps.post(data, dst, _TAG_STEP)

    def recv_step(self) -> object:
        """A worker: the next object rank 0 sent (blocks until it comes)."""
        size = torch.empty(1, dtype=torch.long)
        _wait(self.control.recv([size], 0, _TAG_SIZE))
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        _wait(self.control.recv([data], 0, _TAG_STEP))
        return pickle.loads(data.numpy().tobytes())

    def drain(self, timeout: float) -> None:
        """Wait until every step message sent has been received (at most ``timeout`` seconds each)."""
        self._steps.drain(timeout)

    # ---- collectives over every rank (startup) ------------------------------------------

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        _wait(self._world.allreduce([t], opts))
        return int(t.item())

    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order."""
        mine = torch.tensor([value], dtype=torch.long, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        _wait(self._world.allgather([parts], [mine]))
        return [int(p.item()) for p in parts]


class EPGroup:
    """Expert parallelism across data-parallel replicas: the N replicas' engine cores, rank =
    the replica's index (pagoda/model/layers/expert_parallel.py). Its own rendezvous (rank 0
    hosts the store) and one gloo group (nccl on CUDA) whose collectives are bounded by
    ``timeout``: a replica that died or hangs ends its peers' exchanges in DistributedError."""

    def __init__(self, init_method: str, rank: int, world_size: int, device: torch.device, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        # MoE exchanges so far (dispatch_combine counts them): the engine's lockstep check.
        self.rounds = 0
        self._store = rendezvous_store(init_method, rank, world_size, timeout)   # kept alive: rank 0 serves it
        self.group = _gloo_or_nccl(dist.PrefixStore("pagoda/ep", self._store), rank, world_size, device,
                                   datetime.timedelta(seconds=timeout))

    def all_to_all(self, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """``in_splits[r]`` rows of ``t`` to rank r; returns the rows every rank sent here, in
        rank order (``out_splits[r]`` from rank r). Zero rows are fine; every rank must call."""
        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        _wait(self.group.alltoall_base(out, t.contiguous(), list(out_splits), list(in_splits)))
        return out

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), in rank order."""
        mine = torch.tensor(values, dtype=torch.long, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        _wait(self.group.allgather([parts], [mine]))
        return [p.tolist() for p in parts]


def _wait(work, timeout: datetime.timedelta | None = None) -> None:
    try:
        work.wait() if timeout is None else work.wait(timeout)
    except RuntimeError as e:
        raise DistributedError(f"parallel peer failed: {e}") from e
