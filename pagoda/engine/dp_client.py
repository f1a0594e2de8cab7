"""Data parallelism: N engine-core replicas behind one API server.

Each replica is a full AsyncLLM (its own engine-core process, scheduler and KV
cache; with --tensor-parallel-size, its own tensor-parallel group). A
PrefixRouter picks the replica for each request: the one holding the longest
cached prefix, else the least loaded. It is an EngineClient like AsyncLLM
(pagoda/engine/client.py), so the HTTP server serves it unchanged; a request is
validated once, here, and handed to the replica's stream (``_generate``).

A replica whose engine dies is taken out of routing: its in-flight requests
end with an error, new requests go to the others, and /health reports the
server degraded but serving. Only when every replica is dead is it unhealthy.

With --enable-expert-parallel the replicas form one expert-parallel group
(docs/parallel.md): each holds a share of every MoE layer's experts and their
engine cores exchange tokens in every MoE layer, stepping in lockstep. Every
request sent to one replica is numbered and announced to the others
(``_ExpertParallelLink``); the group runs only whole, so one replica's death
ends every replica's requests and the server is unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from pagoda.config import EngineConfig
from pagoda.core.outputs import SchedulerStats
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.client import EngineClientBase, GenerateCall, EngineDeadError, LoRANotFoundError
from pagoda.engine.messages import EngineCoreRequest, WakeUp, encode
from pagoda.engine.router import PrefixRouter
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput

logger = logging.getLogger(__name__)


class DataParallelLLM(EngineClientBase):
    def __init__(self, config: EngineConfig, multiprocess: bool = True, **kwargs: Any) -> None:
        n = config.data_parallel_size
        # Different seeds, so that unseeded random sampling differs between replicas.
        configs = [dataclasses.replace(config, seed=config.seed + i, data_parallel_rank=i) for i in range(n)]
        if config.dp_expert_parallel:
            init = f"tcp://127.0.0.1:{_free_port()}"
            configs = [dataclasses.replace(c, expert_parallel_init_method=init) for c in configs]
        cores: list[dict[str, Any]] = [{} for _ in configs]
        if config.data_parallel_backend == "ray":
            if not multiprocess:
                raise ValueError("--data-parallel-backend ray runs the replicas' engine cores as Ray actors; "
                                 "multiprocess=False runs them in threads")
            from pagoda.engine.ray_dp import start_core_actors

            cores = [{"core": c} for c in start_core_actors(configs)]
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(AsyncLLM, c, multiprocess, **kwargs, **core) for c, core in zip(configs, cores)]
            replicas, errors = [], []
            for f in futures:
                try:
                    replicas.append(f.result())
                except Exception as e:  # noqa: BLE001 - reported below, the others stopped
                    errors.append(e)
        if errors:
            for r in replicas:
                r._cleanup()
            for core in cores:  # Ray actors: give their bundles back (spawned processes are daemons)
                if core:
                    core["core"].proc.kill()
            raise errors[0]
        self.replicas: list[AsyncLLM] = replicas
        first = replicas[0]
        self.config = config
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.max_model_len = min(r.max_model_len for r in replicas)
        self.vocab_size = first.vocab_size
        self.pooler_config = first.pooler_config   # every replica runs the same task
        self.info = first.info
        # The dashboard shows replica 0; /metrics has every replica (label engine="i").
        self.metrics = first.metrics
        # LoRA runs without data parallelism (EngineConfig refuses enable_lora with it).
        self.lora_requests: dict[str, LoRARequest] = {}
        self.lora_token_counts: dict[str, list[int]] = {}
        self.router = PrefixRouter(n, config.block_size)
        self._owner: dict[str, int] = {}
        self._dead_seen: set[int] = set()
        self.expert_parallel = config.dp_expert_parallel
        if self.expert_parallel:
            link = _ExpertParallelLink(replicas)
            for r in replicas:
                r.ep_link = link

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True, **kwargs: Any) -> DataParallelLLM:
        return cls(config, multiprocess, **kwargs)

    # ---- replicas' state -------------------------------------------------------------

    def _alive(self) -> list[bool]:
        alive = []
        for i, r in enumerate(self.replicas):
            r._check_alive()
            ok = r.dead_reason is None
            if not ok and i not in self._dead_seen:
                self._dead_seen.add(i)
                self.router.forget_replica(i)
                logger.error("data-parallel replica %d is dead (%s); routing around it", i, r.dead_reason)
            alive.append(ok)
        return alive

    @property
    def is_healthy(self) -> bool:
        if self.expert_parallel:   # one expert-parallel group: it runs whole or not at all
            return all(r.is_healthy for r in self.replicas)
        return any(r.is_healthy for r in self.replicas)

    @property
    def degraded_reason(self) -> str | None:
        """Set while some (not all) replicas are down (never with expert parallelism: then the
        whole group is down)."""
        down = [f"replica {i}: {r.dead_reason or 'unhealthy'}" for i, r in enumerate(self.replicas)
                if not r.is_healthy]
        if not down or len(down) == len(self.replicas) or self.expert_parallel:
            return None
        return "; ".join(down)

    @property
    def dead_reason(self) -> str | None:
        reasons = [r.dead_reason for r in self.replicas]
        if self.expert_parallel and any(reasons):
            return "; ".join(f"replica {i}: {x}" for i, x in enumerate(reasons) if x)
        if all(reasons):
            return "; ".join(f"replica {i}: {x}" for i, x in enumerate(reasons))
        return None

    @property
    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests for r in self.replicas)

    def replica_stats(self) -> list[SchedulerStats]:
        return [r.latest_stats() for r in self.replicas]

    def latest_stats(self) -> SchedulerStats:
        """The replicas' stats summed (KV usage: over all their blocks)."""
        parts = self.replica_stats()
        total = SchedulerStats()
        for field in msgspec_fields(SchedulerStats):
            if field != "kv_cache_usage":
                setattr(total, field, sum(getattr(p, field) for p in parts))
        blocks = sum(p.num_blocks for p in parts)
        total.kv_cache_usage = sum(p.kv_cache_usage * p.num_blocks for p in parts) / blocks if blocks else 0.0
        return total

    def ensure_background_tasks(self) -> None:
        for r in self.replicas:
            r.ensure_background_tasks()

    # ---- requests ----------------------------------------------------------------------

    async def _generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        tried: set[int] = set()
        while True:
            alive = self._alive()
            alive = [a and i not in tried for i, a in enumerate(alive)]
            if not any(alive):
                raise EngineDeadError(self.dead_reason or "no live data-parallel replica")
            loads = [r.num_unfinished_requests for r in self.replicas]
            route = self.router.choose(call.prompt_token_ids, loads, alive, call.cache_salt)
            replica = self.replicas[route.replica]
            self._owner[call.request_id] = route.replica
            produced = False
            try:
                # Validated by generate() already: the replica's stream, not its generate().
                stream = replica._generate(call)
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        produced = True
                        yield out
                return
            except EngineDeadError:
                if produced:
                    raise
                # Died before this request got anywhere: fail over to another replica.
                tried.add(route.replica)
            finally:
                self._owner.pop(call.request_id, None)

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        raise ValueError("LoRA is not enabled; it does not run with --data-parallel-size > 1")

    async def remove_lora(self, lora_name: str) -> None:
        raise LoRANotFoundError(f"The LoRA adapter {lora_name!r} is not loaded.")

    async def check_integrity(self, timeout: float = 10.0) -> dict[str, Any]:
        results = await asyncio.gather(*(r.check_integrity(timeout) for r in self.replicas if r.dead_reason is None))
        errors = [f"replica {i}: {x['error']}" for i, x in enumerate(results) if not x["ok"]]
        return {"ok": not errors, "error": "; ".join(errors) or None,
                "engine_pid": [x["engine_pid"] for x in results]}

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))


class _ExpertParallelLink:
    """The replicas of an expert-parallel group, as their AsyncLLMs see each other: numbers
    every request sent to one of them (1, 2, ... over the group, ``ep_seq``) and sends the
    others a WakeUp with the number, so that their engine cores join the lockstep steps
    (pagoda/engine/core_proc.py); and when one replica dies, ends the others too (the group
    cannot exchange tokens without it; its peers' collectives fail or time out)."""

    def __init__(self, replicas: list[AsyncLLM]) -> None:
        self.replicas = replicas
        self._last_seq = 0

    async def send_request(self, replica: AsyncLLM, msg: EngineCoreRequest) -> None:
        self._last_seq += 1
        seq = msg.ep_seq = self._last_seq
        await replica._input.send(encode(msg))
        wake = encode(WakeUp(seq))
        for other in self.replicas:
            if other is not replica and other.dead_reason is None:
                await other._input.send(wake)

    def member_died(self, replica: AsyncLLM, reason: str) -> None:
        i = self.replicas.index(replica)
        for j, other in enumerate(self.replicas):
            if other is not replica:
                other._die(f"replica {i} of the expert-parallel group died, so replica {j} cannot run "
                           f"(every MoE layer exchanges tokens with it): {reason}")


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the expert-parallel group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msgspec_fields(cls) -> tuple[str, ...]:
    return cls.__struct_fields__
