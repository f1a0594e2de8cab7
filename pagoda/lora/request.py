"""LoRARequest: which adapter a request runs with (vLLM's signature)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_int_id`` (>= 1) identifies the adapter's weights inside the engine:
    its KV prefix-cache keys and its resident slot. The same id must always
    name the same adapter.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
