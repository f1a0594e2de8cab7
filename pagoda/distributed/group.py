"""A tensor-parallel process group over torch.distributed (gloo on CPU, nccl on CUDA).

Each engine owns its group object; nothing goes through torch.distributed's
global default group, so several groups (tests, data-parallel replicas) can
live side by side. Two process groups share one rendezvous store:

- ``compute``: the collectives inside a forward (all-reduce after row-parallel
  layers, all-gather of logits), bounded by ``timeout`` so that a hung peer
  ends in an error, not a hang;
- ``control``: gloo, rank 0 broadcasting each step's inputs to the workers.
  Workers wait on it while the engine idles, so its timeout is long; a peer
  that dies closes its sockets, which ends the wait at once.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

# A worker may wait this long for rank 0's next step (the engine can idle for days).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


class DistributedError(RuntimeError):
    """A peer of the tensor-parallel group is gone or did not answer in time."""


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: float) -> dist.Store:
    """The shared key-value store of the group: tcp://host:port (rank 0 hosts it) or
    env:// (MASTER_ADDR / MASTER_PORT, as torchrun sets them)."""
    store, _, _ = next(dist.rendezvous(init_method, rank=rank, world_size=world_size,
                                       timeout=datetime.timedelta(seconds=timeout)))
    return store


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        td = datetime.timedelta(seconds=timeout)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("pagoda/control", store), rank, world_size,
                                             _CONTROL_TIMEOUT)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("pagoda/compute", store), rank, world_size, opts)
        else:
            self.compute = dist.ProcessGroupGloo(dist.PrefixStore("pagoda/compute", store), rank, world_size, td)
        self._store = store  # kept alive: rank 0's TCP store serves the others

    # ---- collectives used by the parallel layers -----------------------------------

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

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        _wait(self.compute.allreduce([t], opts))
        return int(t.item())

    # ---- rank 0 -> workers -----------------------------------------------------------

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends ``obj`` (pickled); the other ranks receive and return it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
            _wait(self.control.broadcast([size], opts))
            _wait(self.control.broadcast([data], opts))
            return obj
        size = torch.empty(1, dtype=torch.long)
        _wait(self.control.broadcast([size], opts))
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        _wait(self.control.broadcast([data], opts))
        return pickle.loads(data.numpy().tobytes())


def _wait(work) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise DistributedError(f"tensor-parallel peer failed: {e}") from e
