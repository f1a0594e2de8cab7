"""Multi-LoRA serving: PEFT adapters applied per token inside one batched forward."""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
