"""The vision towers' shared layers: ViT encoder layers (pre-norm LayerNorms, bidirectional
attention with biases, a two-layer MLP), as SigLIP and CLIP build them, named as their
checkpoints name them (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``, ``mlp.fc1``...).

Each family's tower (its embeddings: positions, a class token) and connector live in its own
file; ``vision_config(...)`` reads the geometry from an HF ``vision_config``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def vision_config(vc: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The tower's geometry from an HF vision_config (``defaults``: the family's config class's)."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
            "image_size", "patch_size", "layer_norm_eps", "hidden_act")
    out = {k: vc.get(k, defaults.get(k)) for k in keys}
    activation(out["hidden_act"])   # an unknown activation is refused at load
    return out


class VisionAttention(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d = v["hidden_size"]
        self.num_heads = v["num_attention_heads"]
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class VisionMLP(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])
        self.act = activation(v["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.self_attn = VisionAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """``layers`` encoder layers (a family may read an earlier layer's output: build only
    the layers it reads)."""

    def __init__(self, v: dict[str, Any], layers: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(v["num_hidden_layers"] if layers is None else layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
