"""``--data-parallel-backend ray``: the data-parallel engine cores as Ray actors.

The actors are placed on the API server's node (their ZMQ sockets are ipc addresses),
each running the engine-core process's main with the addresses a spawned core process
gets; placement, start-up and supervision are the executor's Ray helpers
(pagoda/executor/ray_executor.py).
"""

from __future__ import annotations

import logging
import os
import uuid

from pagoda.config import EngineConfig
from pagoda.engine.core_proc import CoreProcess, ipc_addresses, serve_engine_core
from pagoda.executor.ray_executor import PIN, RayCoreProcess, connect, place, start_actors, this_node

logger = logging.getLogger(__name__)


class EngineCoreActor:
    """The actors' class (ray.remote is applied when Ray is imported): one engine core."""

    def pid(self) -> int:
        return os.getpid()

    def run_engine_core(self, config: EngineConfig, input_addr: str, output_addr: str) -> int:
        return serve_engine_core(config, input_addr, output_addr)


def start_core_actors(configs: list[EngineConfig]) -> list[CoreProcess]:
    """The data-parallel replicas' engine cores as actors on this node (one bundle each,
    STRICT_PACK), connecting to ipc addresses as a spawned core process does. A replica's
    bundle holds its mp tensor-parallel workers too (they are its subprocesses)."""
    config = configs[0]
    ray = connect(config)
    ip, _ = this_node(ray)
    ranks = config.tensor_parallel_size if config.distributed_executor_backend == "mp" else 1
    cpus = float((config.threads_per_rank or 1) * ranks)
    bundles = [{"CPU": cpus, f"node:{ip}": PIN} for _ in configs]
    placement = place(ray, bundles, "STRICT_PACK", len(configs), f"{len(configs)} data-parallel replicas",
                       config.distributed_timeout)
    tag = uuid.uuid4().hex[:8]
    addrs = [ipc_addresses() for _ in configs]
    specs = [(f"pagoda-dp-{tag}-replica-{i}", i, "run_engine_core", (c, a[1], a[2]))
             for i, (c, a) in enumerate(zip(configs, addrs))]
    try:
        procs = start_actors(ray, placement, RayCoreProcess, cpus, specs, config.distributed_timeout,
                             actor_cls=EngineCoreActor)
    except BaseException:
        for tmpdir, _, _ in addrs:
            os.rmdir(tmpdir)
        raise
    logger.info("Ray: data-parallel engine cores in actors %s", [p.name for p in procs])
    return [CoreProcess(p, *a) for p, a in zip(procs, addrs)]
