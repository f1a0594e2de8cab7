"""LoRA layers, chosen by the loader: the model code knows nothing of them.

Each wrapped projection keeps its base layer (exact or quantized) and, per
resident adapter slot, stacked A and B weights:

    lora_a [max_loras, num_slices * max_rank, in]
    lora_b [max_loras, out, num_slices * max_rank]   (block diagonal per slice)

A stacked projection (qkv_proj, gate_up_proj) has one slice per checkpoint
projection: slice s of lora_a holds that projection's A, and lora_b maps it
only onto the slice's own output rows. E.g. qkv_proj with max_rank 8 and
only k_proj adapted: lora_a[slot, 8:16] = A_k, lora_b[slot, q:q+kv, 8:16] = B_k,
everything else zero. Ranks below max_rank are zero-padded.

The forward groups the batch's tokens by slot (``LoRABatch``, set by the model
runner once per step) and adds ``(x[idx] @ A^T) @ B^T`` per group: one GEMM
pair per adapter present in the step, whatever the number of requests.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.lora.adapter import TARGET_MODULES, LoRAAdapter


class LoRABatch:
    """Which tokens of the current step use which slot.

    ``groups``: (slot, token indices) per slot present; the indices are None
    when every token of the step uses that slot. Tokens on the base model
    are in no group.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set_token_slots(self, token_slots: list[int]) -> None:
        """One slot per token, -1 = base model.
        E.g. [-1, 0, 0, 2, -1] -> [(0, tensor([1, 2])), (2, tensor([3]))]."""
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(i)
        n = len(token_slots)
        self.groups = [
            (slot, None if len(idx) == n else torch.tensor(idx, dtype=torch.long, device=self.device))
            for slot, idx in sorted(by_slot.items())
        ]

    def clear(self) -> None:
        self.groups = []


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slice_sizes: list[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        if sum(slice_sizes) != self.out_features:
            raise ValueError(f"slices {slice_sizes} do not add up to {self.out_features} outputs")
        self.slice_sizes = slice_sizes
        self.max_rank = max_rank
        self.batch = batch
        width = len(slice_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, width, dtype=dtype, device=device))

    def set_slot(self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A, scaled B) per slice (None = slice not adapted) into ``slot``."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        row = 0
        for s, (size, pair) in enumerate(zip(self.slice_sizes, slices)):
            if pair is not None:
                wa, wb = pair
                r = wa.shape[0]
                col = s * self.max_rank
                a[col:col + r].copy_(wa)
                b[row:row + size, col:col + r].copy_(wb)
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, idx in self.batch.groups:
            if idx is None:
                y = y + (x @ self.lora_a[slot].t()) @ self.lora_b[slot].t()
            else:
                delta = (x.index_select(0, idx) @ self.lora_a[slot].t()) @ self.lora_b[slot].t()
                y = y.index_add(0, idx, delta)
        return y

    def extra_repr(self) -> str:
        return f"slices={self.slice_sizes}, max_rank={self.max_rank}, max_loras={self.lora_a.shape[0]}"


# pagoda module -> the checkpoint projections stacked in it, in row order.
_SLICES: dict[str, list[str]] = {}
for _proj, (_module, _index) in TARGET_MODULES.items():
    _SLICES.setdefault(_module, []).insert(_index, _proj)


def apply_lora(model: nn.Module, max_loras: int, max_rank: int, batch: LoRABatch) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every layer's qkv/o/gate_up/down projection in a LoRALinear, in place.
    Returns (layer index, pagoda module name) -> the wrapper."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    param = next(model.parameters())
    for i, layer in enumerate(model.model.layers):
        for module_name, projections in _SLICES.items():
            parent = layer.self_attn if module_name in ("qkv_proj", "o_proj") else layer.mlp
            if not hasattr(parent, module_name):
                continue   # a MoE layer's MLP: adapters there are refused when loaded
            base = getattr(parent, module_name)
            if module_name == "qkv_proj":
                sizes = [parent.q_rows, parent.kv_size, parent.kv_size]
            elif module_name == "gate_up_proj":
                sizes = [parent.intermediate_size] * 2
            else:
                sizes = [base.out_features]
            wrapper = LoRALinear(base, sizes, max_loras, max_rank, batch, param.dtype, param.device)
            setattr(parent, module_name, wrapper)
            wrapped[(i, module_name)] = wrapper
    return wrapped


def write_adapter(wrapped: dict[tuple[int, str], LoRALinear], slot: int, adapter: LoRAAdapter) -> None:
    """Load ``adapter`` into ``slot`` of every wrapped projection (zeros where it has no weights)."""
    for (layer, module_name), wrapper in wrapped.items():
        slices = []
        for proj in _SLICES[module_name]:
            w = adapter.modules.get((layer, proj))
            slices.append(None if w is None else (w.a, w.b))
        wrapper.set_slot(slot, slices)
