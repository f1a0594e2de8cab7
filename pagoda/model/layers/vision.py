"""The vision towers' shared layers: ViT encoder layers (pre-norm LayerNorms, bidirectional
attention with biases, a two-layer MLP), as SigLIP and CLIP build them, named as their
checkpoints name them (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``, ``mlp.fc1``...).

SigLIP's tower (``SiglipVisionTransformer``) serves Idefics3 and Gemma 3; a family's other
tower (CLIP's, with a class token) and its connector live in its own file; ``vision_config(...)`` reads the geometry from an HF ``vision_config``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
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


def one_tile(vision: dict[str, Any], shape: tuple[int, ...]) -> int:
    """A tower that reads one square tile at its resolution: ValueError unless ``shape`` is
    (1, channels, size, size); returns the size."""
    size = vision["image_size"]
    if tuple(shape) != (1, vision["num_channels"], size, size):
        raise ValueError(f"image pixels of shape {tuple(shape)}; expected (1, {vision['num_channels']}, {size}, {size})")
    return size


class VisionLanguage:
    """What every vision-language family's class says (listed first among its bases): its
    tower is not sharded (tensor parallelism refused), no LoRA yet, and the tower and
    projector's name prefixes (``CausalLM.tower_prefixes``)."""

    tensor_parallel = False
    lora = False
    tower_prefixes: tuple[str, ...] = ("vision_tower.", "multi_modal_projector.")


class SiglipEmbeddings(nn.Module):
    """SigLIP's patch embedding and learned positions, for tiles of any size up to
    ``image_size`` (Idefics3's variable resolution: each patch's fractional place on the tile
    bucketed onto the trained grid); ``exact_grid``: the tiles are always ``image_size`` and
    the positions are 0..patches - 1 in order (SigLIP's own, as Gemma 3 reads them)."""

    def __init__(self, v: dict[str, Any], exact_grid: bool = False) -> None:
        super().__init__()
        self.exact_grid = exact_grid
        self.patch_size = v["patch_size"]
        self.patch_embedding = nn.Conv2d(v["num_channels"], v["hidden_size"], self.patch_size, self.patch_size)
        self.per_side = v["image_size"] // self.patch_size
        self.position_embedding = nn.Embedding(self.per_side ** 2, v["hidden_size"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:   # [n, C, H, W] -> [n, patches, hidden]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if self.exact_grid:
            return x + self.position_embedding.weight[None]
        rows, cols = pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size
        # Each patch's learned position: its fractional place on the tile, bucketed onto the
        # per_side x per_side grid the positions were trained on (NaViT's, as transformers).
        bounds = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=pixels.device)
        fh = torch.clamp(torch.arange(rows, device=pixels.device, dtype=torch.float32) * (1.0 / rows), max=1 - 1e-6)
        fw = torch.clamp(torch.arange(cols, device=pixels.device, dtype=torch.float32) * (1.0 / cols), max=1 - 1e-6)
        ids = (torch.bucketize(fh, bounds, right=True)[:, None] * self.per_side
               + torch.bucketize(fw, bounds, right=True)[None, :]).reshape(-1)
        return x + self.position_embedding(ids)[None]


class SiglipVisionTransformer(nn.Module):
    """SigLIP's tower without its pooling head: embeddings, encoder layers, a final LayerNorm."""

    def __init__(self, v: dict[str, Any], exact_grid: bool = False) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(v, exact_grid)
        self.encoder = VisionEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))
