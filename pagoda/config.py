"""Engine configuration: one frozen, validated object built from user options."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None              # HF folder or .gguf file; None = bundled default
    served_model_name: str | None = None
    dtype: str = "auto"                   # auto = float32 on CPU
    quantization: str = "none"            # none (exact) | int8 (dynamic int8 GEMMs) | q4 (4-bit groups); CPU
    device: str = "cpu"
    max_model_len: int | None = None      # None = the model's own context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None    # bytes for the KV pool; None = a share of free memory
    num_kv_blocks: int | None = None      # explicit pool size, overrides kv_cache_memory
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    chat_template: str | None = None      # a template string or a path to one
    show_progress: bool = True
    num_threads: int | None = None        # torch threads of the engine; None = cpu_threads_policy()

    def __post_init__(self) -> None:
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive("num_threads", self.num_threads, allow_none=True)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.quantization not in ("none", "int8", "q4"):
            raise ValueError(f"quantization must be none, int8 or q4, got {self.quantization!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def cpu_threads_policy(requested: int | None) -> int | None:
    """Torch threads for the engine process: ``requested`` if given; else
    None (leave torch alone) when OMP_NUM_THREADS is set; else one thread per
    usable core, less one for the API process (HTTP, detokenization) and
    clients, and exactly one on machines with 2 cores or fewer.

    Why not all cores: torch's threads meet at a barrier after every op, so
    when another process takes one of the cores, every op waits a whole
    scheduler slice for the descheduled thread. Measured on this project's
    2-core machines under load: a batch-1 decode step took 724 ms with 2
    threads against 53 ms with 1 (docs/benchmarks.md)."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return 1 if cores <= 2 else cores - 1


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
