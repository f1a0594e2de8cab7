"""Small PEFT adapters made on the fly, and the transformers + peft reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    hf_model,
    path: str,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = ALL_TARGETS,
    use_rslora: bool = False,
    b_std: float = 0.05,
    rank_pattern: dict | None = None,
) -> str:
    """Save a LoRA adapter with peft's own save_pretrained (PEFT format, safetensors).

    A and B are random with a fixed seed; B is non-zero (peft's default init
    zeros it), so the adapter changes the outputs. ``hf_model`` is left as it
    was (the injected layers are removed again)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
        use_rslora=use_rslora, rank_pattern=rank_pattern or {},
    )
    peft_model = get_peft_model(hf_model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std)
    peft_model.save_pretrained(path)
    peft_model.unload()
    return path


@contextlib.contextmanager
def with_adapter(hf_model, path: str) -> Iterator[torch.nn.Module]:
    """transformers + peft with the adapter at ``path`` (removed again on exit)."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf_model, path)
    peft_model.eval()
    try:
        yield peft_model
    finally:
        peft_model.unload()
