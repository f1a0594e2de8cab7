"""RMSNorm, with the residual add fused in (one C++ op on the CPU in float32)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.ops import cpu_kernels


def fused_ops(x: torch.Tensor):
    """The fused layer ops for this tensor (``rms_norm``, ``rope_qkv``, ``silu_mul``): pagoda's
    C++ ops for float32 on the CPU, its Triton kernels on CUDA; None elsewhere (or where
    they are not built / installed)."""
    if x.device.type == "cuda":
        from pagoda.ops import triton_elementwise

        return triton_elementwise.layer_ops(x)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return cpu_kernels.kernels()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual), the sum
        written into ``residual`` in place (one fused op on CPU)."""
        ops = fused_ops(x)
        if ops is not None and x.dim() == 2:
            if residual is None:
                return ops.rms_norm(x.contiguous(), self.weight, self.eps, None)
            return ops.rms_norm(x.contiguous(), self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """norm over the last dimension of x of any shape (q/k norms per head)."""
        shape = x.shape
        return self(x.reshape(-1, shape[-1])).view(shape)


class UnitRMSNorm(RMSNorm):
    """An RMSNorm without a learned weight (Llama 4's q/k "L2" norm): x / rms(x). Its unit
    weight is no parameter (checkpoints hold none); made once per device."""

    def __init__(self, dim: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.dim, self.eps = dim, eps
        self._units: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self._unit(torch.device("cpu"), torch.float32)

    def _unit(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if (device, dtype) not in self._units:
            self._units[device, dtype] = torch.ones(self.dim, device=device, dtype=dtype)
        return self._units[device, dtype]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            raise ValueError("a unit RMSNorm takes no residual")
        ops = fused_ops(x)
        if ops is not None and x.dim() == 2:
            return ops.rms_norm(x.contiguous(), self._unit(x.device, x.dtype), self.eps, None)
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
