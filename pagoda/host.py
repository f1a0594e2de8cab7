"""Facts and policies of the host the engine runs on: torch threads, malloc's handling of
freed memory, free memory, torchrun's environment, whether Ray is installed. Standard
library only, below everything that runs the model."""

from __future__ import annotations

import os

# Models whose weights a step reads take long enough per op that two threads pay off
# on a 2-core machine (see cpu_threads_policy).
BIG_MODEL_BYTES = 256 << 20


def cpu_threads_policy(requested: int | None, weight_bytes: int | None = None) -> int | None:
    """A fixed thread count: while the engine loads, where ``governed_threads`` gives no
    range (off Linux), and for the roofline bench. ``requested`` if given; else
    ``OMP_NUM_THREADS`` if set (None: leave torch's choice); else one per core less
    one for the API process and its clients, and on machines with 2 cores or fewer
    exactly one, unless the model's weights (``weight_bytes``) are at least
    BIG_MODEL_BYTES: then both cores.

    Why not all cores for small models: torch's threads meet at a barrier after every
    op, so when another process takes one of the cores, every op waits a whole
    scheduler slice for the descheduled thread. Measured on this project's 2-core
    machines under load: a batch-1 decode step of the 135M model took 724 ms with 2
    threads against 53 ms with 1 (docs/benchmarks.md). A real-size model's ops each
    take milliseconds (a 1B decode step reads ~700 MB), so a slice lost now and then
    costs little against using the second core for every op (docs/benchmarks.md,
    real-size models)."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores <= 2:
        return cores if weight_bytes is not None and weight_bytes >= BIG_MODEL_BYTES else 1
    return cores - 1


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for the next step instead of handing it
    back to the kernel: a step's large activations (a batch's logits, int8 products,
    prompt chunks) are then reused pages, not fresh mmaps that fault in page by page
    on every step. Allocations up to 32 MiB (glibc's limit) come from the heap, and
    up to 256 MiB of free heap is kept (1 GiB was no faster). Measured here (one
    thread): an int8 decode step of 64 sequences 126-145 -> 121-131 ms (its time
    without varies with the page faults), prompts and steps of 16 unchanged; the
    price is a higher RSS. Returns whether it applied (glibc only; elsewhere a no-op)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20), (_M_TOP_PAD, 64 << 20)))


def release_freed_memory() -> bool:
    """Hand malloc's free heap back to the kernel (glibc's malloc_trim), after a one-off
    burst of allocations such as converting a model's weights at load. Returns whether
    it ran (glibc only)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); a conservative 2 GiB elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 30


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (or alike), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


RAY_MISSING = ("the Ray backends (--distributed-executor-backend ray, --data-parallel-backend ray) need Ray, "
               "an optional extra: pip install 'pagoda[ray]'")


def require_ray() -> None:
    """Raise ImportError naming the extra when Ray is not installed (without importing it)."""
    import importlib.util
    import sys

    if "ray" in sys.modules:
        missing = sys.modules["ray"] is None
    else:
        missing = importlib.util.find_spec("ray") is None
    if missing:
        raise ImportError(RAY_MISSING)
