"""Tensor and pipeline parallelism across processes: rank 0 (the engine core) drives,
workers follow.

The scheduler runs once, in the engine core, which is rank 0 of the group.
Each step rank 0 sends every rank the SchedulerOutput (full data for new requests,
diffs for running ones) plus the tokens it sampled since its last message; every rank
updates its copy of the batch, runs its part of the forward (its shard of its stage's
layers; the collectives inside keep a stage's ranks in lock step, and the stages pass
activations on, pagoda/model/layers/pipeline.py), and rank 0 alone samples, from the
logits the last stage sends it. Under pipeline parallelism rank 0 starts a step
(``submit``) before the previous one's logits are back (``collect``), so that several
micro-batches are in flight (pagoda/engine/engine_core.py).

Ranks and nodes: ``tensor_parallel_size * pipeline_parallel_size`` ranks over ``nnodes`` nodes, the
same number on each; node n holds ranks [n * per_node, (n + 1) * per_node).
Node 0's engine core is rank 0 and starts its node's other ranks; every other
node runs `pagoda serve ... --node-rank n` (or `python -m pagoda.executor.worker`),
which starts that node's ranks and waits for them. Under torchrun (RANK and
WORLD_SIZE in the environment) every process is one rank and nothing is spawned.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.host import torchrun_rank
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.distributed.group import DistributedError, RankGroups, rendezvous_store

logger = logging.getLogger(__name__)

_WORKER_EXIT_TIMEOUT_S = 10.0


def configure_threads(config: EngineConfig) -> None:
    """One torch thread per rank (default) when ranks or replicas share a CPU; on CUDA,
    ``cuda_defaults`` (worker/cuda_setup.py) for each rank."""
    if config.device != "cpu":
        if config.device.startswith("cuda"):
            from pagoda.worker.cuda_setup import cuda_defaults

            cuda_defaults(config)
        return
    parallel = config.world_size > 1 or config.data_parallel_size > 1
    if config.threads_per_rank is not None or parallel:
        torch.set_num_threads(config.threads_per_rank or 1)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + local_rank)
    return device


def ranks_of_node(config: EngineConfig, node_rank: int) -> range:
    per_node = config.world_size // config.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


class WorkerProcess(Protocol):
    """A worker rank's process as rank 0 sees it: subprocess.Popen (the mp launch), or
    ray_executor.RayWorker (an actor; --distributed-executor-backend ray)."""

    pid: int

    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...  # raises subprocess.TimeoutExpired


@dataclass
class StepMessage:
    sched_out: SchedulerOutput | None      # None: no step, the expert-load query alone
    sampled: list[tuple[str, list[int]]]   # what rank 0 sampled since its last message
    # Pipeline parallelism, MoE: once the step has run, each later stage's TP rank 0 sends rank 0
    # its expert counts (TensorParallelDriver.expert_load).
    expert_load: bool = False


class TensorParallelDriver:
    """Rank 0's side of a tensor- and/or pipeline-parallel group: the engine core's executor.
    Same ``execute_model`` as ModelRunner, and its two halves ``submit`` / ``collect``."""

    def __init__(self, group: RankGroups, workers: list[WorkerProcess]) -> None:
        self.group = group
        self.workers = workers
        self.runner = None
        self.weight_bytes: list[int] = []
        self._sampled: list[tuple[str, list[int]]] = []
        self._closed = False
        # The expert load under pipeline parallelism (expert_load): steps with tokens sent so far;
        # the next such step is to bring the other stages' counts; the step that brings them
        # (its batch), rank 0's own counts as of it and the steps they cover; the latest load
        # gathered, with the steps it covers, and whether the engine has had it yet.
        self._steps = 0
        self._load_asked = False
        self._load_step: tuple[object, torch.Tensor, int] | None = None
        self._load: tuple[int, list[list[int]]] | None = None
        self._load_new = False

    def gather_weight_bytes(self, model: torch.nn.Module) -> list[int]:
        """Parameter bytes each rank holds (a collective: the workers call it too)."""
        self.weight_bytes = gather_weight_bytes(self.group, model)
        logger.info("parallel: TP=%d x PP=%d ranks, weights per rank %s MiB", self.group.tp_size,
                    self.group.pp_size, [round(b / 2**20, 1) for b in self.weight_bytes])
        return self.weight_bytes

    def execute_model(self, so: SchedulerOutput, grammar_masks=None) -> ModelRunnerOutput:
        return self.collect(self.submit(so, grammar_masks))

    def submit(self, so: SchedulerOutput, grammar_masks=None):
        """Send the step to every rank and start rank 0's part of it (ModelRunner.start_batch)."""
        self.check_workers()
        # Only a step with tokens brings the expert counts: it is collected in the order sent,
        # after its logits (an empty step may be sent and collected while others are in flight).
        ask = self._load_asked and not so.is_empty
        self._load_asked = self._load_asked and not ask
        self.group.send_step(StepMessage(so, self._sampled, ask))
        self._sampled = []
        batch = self.runner.start_batch(so, grammar_masks)
        if not so.is_empty:
            self._steps += 1
        if ask:
            self._load_step = (batch, self.runner.model.expert_counts(), self._steps)
        return batch

    def collect(self, batch) -> ModelRunnerOutput:
        """Finish a submitted step: its logits (from the last stage), sampling; and the other
        stages' expert counts if the step was to bring them."""
        out = self.runner.finish_batch(batch)
        self._sampled.extend((rid, t) for rid, t in zip(out.req_ids, out.sampled_token_ids) if t)
        if self._load_step is not None and batch is self._load_step[0]:
            _, own, steps = self._load_step
            self._load_step = None
            self._load = (steps, self._gather_load(own))
            self._load_new = True
        return out

    def expert_load(self, idle: bool) -> list[list[int]] | None:
        """Pipeline parallelism: the tokens routed to each expert of every MoE layer of the
        model, layers in order, as one process counts them (rank 0 holds only its stage's
        layers; each later stage's TP rank 0 sends its own: the TP ranks of a stage route
        alike). ``idle`` (no step in flight): the stages are asked now, a round trip, unless
        no step ran since the last answer, which is returned again. Otherwise the next step
        sent brings the counts (so no step waits for them, and none pays when nobody asks):
        None until a later call, after that step is collected, returns them."""
        if idle:
            self._load_asked = False
            if self._load is None or self._load[0] != self._steps:
                self.check_workers()
                self.group.send_step(StepMessage(None, [], expert_load=True))
                self._load = (self._steps, self._gather_load(self.runner.model.expert_counts()))
        elif not self._load_new:
            self._load_asked = self._load_step is None
            return None
        self._load_new = False
        return self._load[1]

    def _gather_load(self, own: torch.Tensor) -> list[list[int]]:
        """Rank 0's counts plus every later stage's (each holds zeros for the others' layers)."""
        total = own.clone()
        for stage in range(1, self.group.pp_size):
            total += self.group.pipe.recv_expert_counts(stage, own)
        return total.tolist()

    def check_workers(self) -> None:
        """Raise if a worker process of this node has exited (remote ones are caught by
        the next collective: a dead peer closes its sockets)."""
        for proc in self.workers:
            code = proc.poll()
            if code is not None:
                raise DistributedError(f"parallel worker (pid {proc.pid}) exited with code {code}")

    def kill(self) -> None:
        """Stop this node's workers at once (startup failed; they may be inside a collective)."""
        self._closed = True
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.poll() is None for p in self.workers):
                self.group.send_step(None)
                self.group.drain(_WORKER_EXIT_TIMEOUT_S)
        except DistributedError:
            pass
        for proc in self.workers:
            try:
                proc.wait(_WORKER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_driver(
    config: EngineConfig, start_ray_workers: Callable[[EngineConfig, int], list[WorkerProcess]] | None = None
) -> tuple[TensorParallelDriver, torch.device]:
    """Rank 0: start this node's workers, join the group. Returns the driver (its
    ``runner`` is set by the engine core once the KV cache is sized) and rank 0's device.
    ``start_ray_workers(config, store_port)``: the Ray backend's launcher
    (pagoda.executor.ray_executor.start_ray_workers), given by the caller where
    --distributed-executor-backend ray asks for it."""
    world = config.world_size
    launched = torchrun_rank()
    if launched is not None:
        rank, world_env, local_rank = launched
        if rank != 0 or world_env != world:
            raise ValueError(f"the engine core must be RANK 0 of WORLD_SIZE={world}; "
                             f"got RANK={rank}, WORLD_SIZE={world_env}")
        store = rendezvous_store(config.distributed_init_method or "env://", 0, world, config.distributed_timeout)
        workers: list[WorkerProcess] = []
    elif config.distributed_init_method is None:
        # One node (or Ray's nodes): rank 0 hosts the store on a port the OS picks (it listens
        # on every interface), then starts the others.
        local_rank = 0
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=_td(config.distributed_timeout))
        if config.distributed_executor_backend == "ray":
            if start_ray_workers is None:
                raise ValueError("--distributed-executor-backend ray: no Ray launcher given to start_driver")
            workers = start_ray_workers(config, store.port)
        else:
            init = f"tcp://127.0.0.1:{store.port}"
            workers = [spawn_worker(config, r, init, local_rank=r) for r in range(1, world)]
    else:
        if config.node_rank != 0:
            raise ValueError("the engine core runs on node 0; other nodes run workers only")
        local_rank = 0
        workers = [spawn_worker(config, r, config.distributed_init_method, local_rank=r)
                   for r in ranks_of_node(config, 0) if r != 0]
        store = rendezvous_store(config.distributed_init_method, 0, world, config.distributed_timeout)
    device = rank_device(config, local_rank)
    try:
        group = RankGroups(store, 0, config.tensor_parallel_size, config.pipeline_parallel_size, device,
                           config.distributed_timeout)
    except Exception:
        for proc in workers:
            proc.kill()
        raise
    return TensorParallelDriver(group, workers), device


def gather_weight_bytes(group: RankGroups, model: torch.nn.Module) -> list[int]:
    """Parameter bytes of every rank, in rank order (each calls it)."""
    from pagoda.model.loader import parameter_bytes

    return group.all_gather_int(parameter_bytes(model))


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def spawn_worker(config: EngineConfig, rank: int, init_method: str, local_rank: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagoda.executor.worker", "--rank", str(rank),
           "--local-rank", str(local_rank), "--init-method", init_method,
           "--config-json", json.dumps(asdict(config))]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def start_node_workers(config: EngineConfig) -> int:
    """A node other than 0: start its ranks, wait for them. Returns an exit code."""
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine core (pagoda serve); workers run on --node-rank >= 1")
    if config.distributed_init_method is None:
        raise ValueError("worker nodes need the rendezvous of node 0: --master-addr/--master-port "
                         "or --distributed-init-method tcp://host:port")
    procs = [spawn_worker(config, r, config.distributed_init_method, local_rank=i)
             for i, r in enumerate(ranks_of_node(config, config.node_rank))]
    codes = [p.wait() for p in procs]
    return max(codes, default=0)
