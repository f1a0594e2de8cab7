"""The Ray backends (``pip install pagoda[ray]``): processes started as Ray actors.

- ``--distributed-executor-backend ray``: the tensor-parallel workers (ranks 1..N-1) are
  actors, one per bundle of a placement group; rank 0 stays the engine core. Each actor
  runs the worker loop of ``pagoda.executor.worker.run_worker``, and the group is the same
  torch.distributed (gloo) group as under the mp launch, with rank 0's rendezvous store at
  its node's address as Ray knows it.
- ``--data-parallel-backend ray``: the data-parallel engine cores are actors placed on
  the API server's node, each running the engine-core process's main with the same ZMQ
  (ipc) addresses a spawned process gets.

Ray places and supervises; it carries no tensors and no requests. A dead actor is seen
as a dead process is: ``RayWorker`` has ``subprocess.Popen``'s poll / kill / wait, so
TensorParallelDriver treats it as one of its workers, and ``RayCoreProcess`` has the
``multiprocessing.Process`` methods AsyncLLM watches.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import uuid
from types import ModuleType
from typing import Any

from pagoda.config import EngineConfig
from pagoda.host import RAY_MISSING

logger = logging.getLogger(__name__)

NAMESPACE = "pagoda"  # the actors' names live here: pagoda-tp-<tag>-rank-<r>, pagoda-dp-<tag>-replica-<i>
# Ray's own custom resource "node:<ip>"; a tiny share of it pins a bundle to that node.
PIN = 0.001


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


# ---- this process's Ray connection ---------------------------------------------------------


class _Connection:
    """ray.init() on first use, unless this process is connected already (your own
    ray.init(), or a Ray actor: a data-parallel replica); ray.shutdown() after the last
    placement is released, if pagoda connected."""

    lock = threading.Lock()
    users = 0
    owned = False


def connect(config: EngineConfig) -> ModuleType:
    ray = import_ray()
    with _Connection.lock:
        if not ray.is_initialized():
            # None: RAY_ADDRESS, else a cluster started on this machine (`ray start --head`),
            # else a new local one (Ray's own rules).
            _init_keeping_sigterm(ray, config.ray_address)
            _Connection.owned = True
            logger.info("Ray: connected to %s", ray.get_runtime_context().gcs_address)
        elif config.ray_address is not None:
            _check_same_cluster(config.ray_address, ray.get_runtime_context().gcs_address)
        _Connection.users += 1
    return ray


def _init_keeping_sigterm(ray: ModuleType, address: str | None) -> None:
    """ray.init() sets a SIGTERM handler that exits; an engine-core process ignores SIGTERM
    (the API server stops it by message, after draining): keep it ignored."""
    import signal

    main = threading.current_thread() is threading.main_thread()
    ignored = main and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    ray.init(address=address)
    if ignored:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _check_same_cluster(wanted: str, connected: str) -> None:
    """This process is connected already; a concrete --ray-address must name that cluster."""
    if wanted == "auto" or "://" in wanted or ":" not in wanted:
        return
    host, port = wanted.rsplit(":", 1)
    c_host, c_port = connected.rsplit(":", 1)
    try:
        ip = socket.gethostbyname(host)
        # localhost: Ray names a cluster on this machine by the node's address.
        same = port == c_port and (ip.startswith("127.") or ip == socket.gethostbyname(c_host))
    except OSError:
        same = False
    if not same:
        raise ValueError(f"--ray-address {wanted}: this process is connected to the Ray cluster at {connected} "
                         "already")


def _disconnect(ray: ModuleType) -> None:
    with _Connection.lock:
        _Connection.users -= 1
        if _Connection.users == 0 and _Connection.owned:
            _Connection.owned = False
            ray.shutdown()


class _Placement:
    """A placement group and the actors in its bundles; removed (and the connection
    released) when the last actor is done."""

    def __init__(self, ray: ModuleType, pg: Any, actors: int) -> None:
        self.ray, self.pg, self.left = ray, pg, actors
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.remove()

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        finally:
            _disconnect(self.ray)


def place(ray: ModuleType, bundles: list[dict[str, float]], strategy: str, actors: int, what: str,
           timeout: float) -> _Placement:
    """Reserve the bundles (all or nothing); a cluster that cannot hold them in time is an error."""
    from ray.util.placement_group import placement_group

    placement = _Placement(ray, placement_group(bundles, strategy=strategy), actors)
    ready, _ = ray.wait([placement.pg.ready()], timeout=timeout)
    if not ready:
        placement.remove()
        raise RuntimeError(f"Ray could not place {what} in {timeout:.0f} s: bundles {bundles} ({strategy}); "
                           f"free in the cluster: {ray.available_resources()}")
    return placement


def this_node(ray: ModuleType) -> tuple[str, float]:
    """This node's address as Ray knows it (where rank 0 and the API server are), and its CPUs."""
    node_id = ray.get_runtime_context().get_node_id()
    cpus = next((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["NodeID"] == node_id), 0.0)
    return ray.util.get_node_ip_address(), cpus


class _ActorProcess:
    """An actor running one long call (its process's main): ``ref`` becomes ready when
    that call returns or the actor dies."""

    def __init__(self, ray: ModuleType, actor: Any, ref: Any, pid: int, name: str, placement: _Placement) -> None:
        self._ray, self._actor, self._ref, self._placement = ray, actor, ref, placement
        self.pid, self.name = pid, name
        self.returncode: int | None = None
        self._released = False
        self._lock = threading.Lock()

    def _poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self._ray.wait([self._ref], timeout=0)
            if ready:
                self.returncode = self._exit_code()
        return self.returncode

    def _exit_code(self) -> int:
        """What the main returned; -1 when the actor died without returning."""
        try:
            return int(self._ray.get(self._ref))
        except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError: the actor is gone
            lines = str(e).strip().splitlines()
            logger.error("Ray actor %s (pid %d) died: %s", self.name, self.pid, lines[0] if lines else type(e).__name__)
            return -1

    def _release(self) -> None:
        """End the actor's process (also after its main returned: it would idle on) and
        give its bundle back."""
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self._placement.done()

    def _kill(self) -> None:
        self._release()
        self._ray.wait([self._ref], timeout=10)
        self._poll()

    def _join(self, timeout: float | None) -> bool:
        ready, _ = self._ray.wait([self._ref], timeout=timeout)
        if ready:
            self._poll()
            self._release()
        return bool(ready)


class RayWorker(_ActorProcess):
    """A tensor-parallel rank in a Ray actor, as TensorParallelDriver sees a worker:
    subprocess.Popen's poll, kill and wait."""

    def poll(self) -> int | None:
        return self._poll()

    def kill(self) -> None:
        self._kill()

    def wait(self, timeout: float | None = None) -> int:
        if not self._join(timeout):
            raise subprocess.TimeoutExpired(self.name, timeout)
        assert self.returncode is not None
        return self.returncode


class RayCoreProcess(_ActorProcess):
    """An engine core in a Ray actor, as AsyncLLM sees its process: multiprocessing.Process's
    is_alive, exitcode, kill, terminate and join."""

    def is_alive(self) -> bool:
        return self._poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._poll()

    def kill(self) -> None:
        self._kill()

    terminate = kill

    def join(self, timeout: float | None = None) -> None:
        self._join(timeout)


class PagodaProcess:
    """The actors' class (ray.remote is applied when Ray is imported): a process that runs
    one tensor-parallel rank. (The data-parallel engine cores' actor class, which runs the
    engine core, lives with the engine: pagoda/engine/ray_dp.py.)"""

    def pid(self) -> int:
        return os.getpid()

    def run_worker(self, config: EngineConfig, rank: int, init_method: str) -> int:
        from pagoda.executor.worker import run_worker

        logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "INFO"),
                            format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
        return run_worker(config, rank, rank, init_method)


def start_actors(ray: ModuleType, placement: _Placement, kind: type[_ActorProcess], cpus: float,
                 specs: list[tuple[str, int, str, tuple]], timeout: float, actor_cls: type = PagodaProcess) -> list[Any]:
    """One actor per (name, bundle, method, args), calling ``method(*args)``; returns once
    each has said its pid, so that an actor that cannot start fails here."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(actor_cls)
    actors, pid_refs, refs = [], [], []
    try:
        for name, bundle, method, args in specs:
            actor = remote.options(
                name=name, namespace=NAMESPACE, num_cpus=cpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement.pg, placement_group_bundle_index=bundle),
            ).remote()
            actors.append(actor)
            pid_refs.append(actor.pid.remote())   # before the long call: an actor runs its calls in order
            refs.append(getattr(actor, method).remote(*args))
        try:
            pids = ray.get(pid_refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray did not start the actors {[s[0] for s in specs]} in {timeout:.0f} s") from None
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        placement.remove()
        raise
    return [kind(ray, a, ref, pid, spec[0], placement) for a, ref, pid, spec in zip(actors, refs, pids, specs)]


# ---- the two backends ----------------------------------------------------------------------


def start_ray_workers(config: EngineConfig, store_port: int) -> list[RayWorker]:
    """Rank 0 (this process) hosts the rendezvous store on ``store_port``: start ranks
    1..N-1 as actors, one per bundle. Bundle 0 stands for rank 0 and is pinned to this
    node (its CPUs are counted, unless this process is an actor already: a data-parallel
    replica, counted by its own bundle). STRICT_PACK when this node has the CPUs for
    every rank, else PACK across nodes."""
    ray = connect(config)
    world = config.tensor_parallel_size
    cpus = float(config.threads_per_rank or 1)
    ip, node_cpus = this_node(ray)
    pin = {f"node:{ip}": PIN}
    in_actor = ray.get_runtime_context().get_actor_id() is not None
    bundles = [pin if in_actor else {"CPU": cpus, **pin}] + [{"CPU": cpus} for _ in range(1, world)]
    strategy = "STRICT_PACK" if node_cpus >= sum(b.get("CPU", 0.0) for b in bundles) else "PACK"
    placement = place(ray, bundles, strategy, world - 1, f"{world} tensor-parallel ranks",
                       config.distributed_timeout)
    tag = uuid.uuid4().hex[:8]
    init = f"tcp://{ip}:{store_port}"
    specs = [(f"pagoda-tp-{tag}-rank-{r}", r, "run_worker", (config, r, init)) for r in range(1, world)]
    workers = start_actors(ray, placement, RayWorker, cpus, specs, config.distributed_timeout)
    logger.info("Ray: tensor-parallel ranks 1..%d in actors %s (%s, rendezvous %s)", world - 1,
                [w.name for w in workers], strategy, init)
    return workers
