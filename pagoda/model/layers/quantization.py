"""Quantized linear layers, chosen by the loader (the model code knows nothing of them).

``int8``: weights quantized once, symmetric per output channel; each step's
activations quantized on the fly, symmetric per token (per row); the GEMM runs
on int8 with int32 accumulation (``torch._int_mm``) and is rescaled by
(token scale x channel scale).

Per-token scales matter for a serving engine: with one scale per batch (what
FBGEMM's dynamic linear does) a request's numbers would depend on which other
requests share its step. Per token, a request gets the same tokens whatever
the batch, as in the exact mode.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_MODES = ("none", "int8")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # [in, out], the layout _int_mm multiplies by.
        self.register_buffer("qweight_t", qweight.t().contiguous())
        self.register_buffer("weight_scale", scale)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        x_scale = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        xq = torch.round(x2 / x_scale).to(torch.int8)
        y = torch._int_mm(xq, self.qweight_t).float() * (x_scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-token"


def quantize_model(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """Replace the model's projections and LM head with quantized layers, in place.

    The embedding stays in full precision (it is a lookup, not a GEMM); a tied
    LM head gets its own quantized copy of the embedding matrix.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")
    if mode == "none":
        return model
    if device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on the CPU only; use --quantization none on {device}")
    targets = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear(module))
    return model
