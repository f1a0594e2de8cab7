"""Engine configuration: one frozen, validated object built from user options."""

from __future__ import annotations

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
    quantization: str = "none"            # none (exact) | int8 (dynamic int8 GEMMs, CPU)
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
    # Scheduling (docs/scheduling.md).
    scheduling_policy: str = "fcfs"       # fcfs | priority | fair
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    shared_prefix_file: str | None = None  # texts whose prefix blocks stay shared across cache salts
    api_keys_file: str | None = None       # API key -> tenant, weight, limits (JSON or TOML)
    kv_cache_dtype: str = "auto"           # auto (= dtype) | int8 | fp8: 8-bit KV with per-token scales
    preemption_mode: str = "recompute"     # recompute | swap | auto
    swap_space: int = 0                    # bytes of host memory for swapped-out KV blocks

    def __post_init__(self) -> None:
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be none or int8, got {self.quantization!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or fair, got {self.scheduling_policy!r}")
        _positive("max_long_partial_prefills", self.max_long_partial_prefills, allow_none=True)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto, int8 or fp8, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of bytes >= 0, got {self.swap_space!r}")
        if self.preemption_mode != "recompute" and self.swap_space == 0:
            raise ValueError(f"preemption_mode={self.preemption_mode} needs --swap-space (host memory for KV)")
        if self.api_keys_file is not None:
            from pagoda.tenants import load_api_keys_file

            load_api_keys_file(self.api_keys_file)  # raises on a malformed file
        if self.shared_prefix_file is not None:
            from pagoda.shared_prefix import read_shared_prefix_file

            read_shared_prefix_file(self.shared_prefix_file)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def check_priority(config: EngineConfig, priority: object) -> None:
    """A request's priority: an integer, and non-zero only under a policy that uses it."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and config.scheduling_policy == "fcfs":
        raise ValueError(
            f"priority={priority} is not allowed with the fcfs scheduling policy; "
            "start the engine with --scheduling-policy priority (or fair)"
        )


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
