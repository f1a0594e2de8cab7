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
    enable_lora: bool = False             # serve LoRA adapters (pagoda/lora)
    max_loras: int = 1                    # adapters resident at once (one batch mixes up to this many)
    max_lora_rank: int = 16               # largest adapter rank accepted

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
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


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
