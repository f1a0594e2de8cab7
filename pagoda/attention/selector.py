"""Which attention backend a model runner uses: ``--attention-backend`` (vLLM's flag), or
for ``auto`` the best one the device and cache type allow. The reason is part of the
answer, for the start-up log."""

from __future__ import annotations

import os

import torch

from pagoda.attention.backend import AttentionBackend

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


class AttentionBackendError(ValueError):
    """A backend asked for by name that cannot run here (said why)."""


def _cpu_unusable(device: torch.device, kv_storage: torch.dtype, model_dtype: torch.dtype) -> str | None:
    from pagoda.ops import cpu_kernels

    if device.type != "cpu":
        return f"the cpu backend runs on the CPU, not on {device.type}"
    if cpu_kernels.kernels() is None:
        return f"pagoda's CPU kernels are not built ({cpu_kernels.error()})"
    if model_dtype != torch.float32:
        return f"the CPU kernels take float32 queries, not {model_dtype}"
    if kv_storage not in (torch.float32, torch.float16, torch.int8):
        return f"the CPU kernels read float32, float16 or int8 caches, not {kv_storage}"
    return None


def _triton_unusable(device: torch.device, kv_storage: torch.dtype) -> str | None:
    from pagoda.ops import triton_attention

    if not triton_attention.available():
        return "triton is not installed"
    from pagoda.attention.triton import CACHE_DTYPES
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on the CPU only in its interpreter (TRITON_INTERPRET=1, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"the triton backend runs on CUDA devices, not on {device.type}"
    if kv_storage not in CACHE_DTYPES:
        return f"the Triton kernels do not read {kv_storage} caches"
    return None


def select_backend(name: str, device: torch.device | str, kv_storage: torch.dtype,
                   model_dtype: torch.dtype) -> tuple[AttentionBackend, str]:  # fmt: skip
    """(the backend, why it was chosen). ``kv_storage``: the cache's element type (int8 or
    float8_e4m3fn for an 8-bit cache). A backend named outright that cannot run here is an
    ``AttentionBackendError``; ``auto`` falls back to the torch reference and says why."""
    from pagoda.attention.cpu import CpuBackend
    from pagoda.attention.torch_ref import TorchBackend

    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch":
        return TorchBackend(), "asked for"
    if name == "cpu":
        why = _cpu_unusable(device, kv_storage, model_dtype)
        if why is not None:
            raise AttentionBackendError(f"--attention-backend cpu: {why}")
        return CpuBackend(), "asked for"
    if name == "triton":
        why = _triton_unusable(device, kv_storage)
        if why is not None:
            raise AttentionBackendError(f"--attention-backend triton: {why}")
        from pagoda.attention.triton import TritonBackend

        return TritonBackend(device), "asked for"
    if device.type == "cpu":
        why = _cpu_unusable(device, kv_storage, model_dtype)
        return (CpuBackend(), "auto on the CPU") if why is None else (TorchBackend(), f"auto: {why}")
    why = _triton_unusable(device, kv_storage)
    if why is None:
        from pagoda.attention.triton import TritonBackend

        return TritonBackend(device), f"auto on {device.type}"
    return TorchBackend(), f"auto: {why}"
