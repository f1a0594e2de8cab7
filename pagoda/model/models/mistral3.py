"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2, Ministral 3,
Devstral with vision): the Pixtral tower, a patch merger, and a Mistral language model.

The processor (``pagoda/multimodal/processors.py``) shrinks an image whose longer side passes
``longest_edge`` and rounds both sides up to whole cells of ``patch_size x
spatial_merge_size`` pixels; its placeholder is a row of ``[IMG]`` tokens per row of cells,
each row ended by ``[IMG_BREAK]``, the last by ``[IMG_END]``. Here the tower reads the image
at any size: a patch convolution, an RMSNorm, pre-norm layers (RMSNorms, a gated MLP) with 2-D
RoPE (half of each head's frequencies turning with the patch's row, the other half, interleaved
with them, with its column); the output of ``vision_feature_layer`` is RMS-normed, each
``spatial_merge_size`` x ``spatial_merge_size`` block of patches folded into one vector
(``merging_layer``) and projected by a two-layer MLP. The tower stays in float in every mode
but int8.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, renamed, text_config
from pagoda.model.layers.rotary import apply_rope
from pagoda.model.layers.vision import VisionLanguage, activation
from pagoda.model.models.llama import LlamaForCausalLM
from pagoda.model.models.qwen2_vl import RMSNorm

_HF_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                ("model.multi_modal_projector.", "multi_modal_projector."))
# transformers' PixtralVisionConfig defaults (a config.json may leave any of them out).
_PIXTRAL_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         num_channels=3, image_size=1024, patch_size=16, hidden_act="gelu")


class Attention(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d = v["hidden_size"]
        self.heads = v["num_attention_heads"]
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (apply_rope(t, cos, sin) for t in (q, k))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


class FeedForward(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d, i = v["hidden_size"], v["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self.act = activation(v["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(v["hidden_size"], 1e-5), RMSNorm(v["hidden_size"], 1e-5)
        self.attention = Attention(v)
        self.feed_forward = FeedForward(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, v: dict[str, Any], layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(v) for _ in range(layers))


class PixtralVisionModel(nn.Module):
    """Pixtral's tower (every layer built, as the checkpoint holds them; those past the one the
    family reads are not run)."""

    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.v = v
        self.patch_conv = nn.Conv2d(v["num_channels"], v["hidden_size"], v["patch_size"], v["patch_size"], bias=False)
        self.ln_pre = RMSNorm(v["hidden_size"], 1e-5)
        self.transformer = Transformer(v, v["num_hidden_layers"])
        head = v["hidden_size"] // v["num_attention_heads"]
        inv = 1.0 / (v["rope_theta"] ** (torch.arange(0, head, 2, dtype=torch.float, device="cpu") / head))
        self.inv_rows, self.inv_cols = inv[0::2], inv[1::2]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] -> [(H / p) x (W / p), hidden], patches row by row."""
        x = self.patch_conv(pixels.to(self.patch_conv.weight.dtype))[0]
        rows, cols = x.shape[1:]
        x = self.ln_pre(x.flatten(1).T)
        r = torch.arange(rows).repeat_interleave(cols)[:, None].float() * self.inv_rows
        c = torch.arange(cols).repeat(rows)[:, None].float() * self.inv_cols
        freqs = torch.cat((r, c), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :].to(x.device)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.transformer.layers[:self.v["feature_layers"]]:
            x = layer(x, cos, sin)
        return x


class PatchMerger(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.merge = v["spatial_merge_size"]
        self.merging_layer = nn.Linear(v["hidden_size"] * self.merge ** 2, v["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        grid = x.view(rows, cols, -1).permute(2, 0, 1)[None]   # [1, d, rows, cols]
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)   # [1, d x m x m, blocks]
        return self.merging_layer(blocks[0].T)


class MultiModalProjector(nn.Module):
    def __init__(self, v: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(v["hidden_size"], v["norm_eps"])
        self.patch_merger = PatchMerger(v)
        bias = v["projector_bias"]
        self.linear_1 = nn.Linear(v["hidden_size"], text_hidden, bias=bias)
        self.act = activation(v["projector_act"])
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), rows, cols))))


class Mistral3ForConditionalGeneration(VisionLanguage, LlamaForCausalLM):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.vision_tower = PixtralVisionModel(config.vision)
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        text = text_config(config)
        if text.get("model_type", "mistral") not in ("mistral", "llama", "ministral", "ministral3"):
            raise UnsupportedModelError(f"Mistral 3 with a {text.get('model_type')!r} language model is not supported")
        vc = {**_PIXTRAL_DEFAULTS, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
        v = {key: vc[key] for key in _PIXTRAL_DEFAULTS}
        activation(v["hidden_act"])
        layer = config.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise UnsupportedModelError("Mistral 3 with several vision_feature_layer values is not supported")
        total = v["num_hidden_layers"]
        layers = total + 1 + layer if layer < 0 else layer
        if not 1 <= layers <= total:
            raise UnsupportedModelError(f"vision_feature_layer {layer} is outside the tower's {total} layers")
        v.update(feature_layers=layers, rope_theta=float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                 spatial_merge_size=int(config.get("spatial_merge_size", 2)),
                 image_token_id=int(config.get("image_token_id", config.get("image_token_index", 10))),
                 projector_act=config.get("projector_hidden_act", "gelu"),
                 projector_bias=bool(config.get("multimodal_projector_bias", False)),
                 norm_eps=float(text.get("rms_norm_eps", 1e-5)))
        activation(v["projector_act"])
        return dataclasses.replace(super().arch_from_hf(text, architecture), vision=v)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _HF_PREFIXES)

    @classmethod
    def num_image_embeds(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> int:
        step = vision["patch_size"] * vision["spatial_merge_size"]
        if len(shape) != 4 or shape[0] != 1 or shape[1] != vision["num_channels"]:
            raise ValueError(f"image pixels of shape {tuple(shape)}; expected (1, {vision['num_channels']}, H, W)")
        if shape[2] < step or shape[3] < step or shape[2] % step or shape[3] % step:
            raise ValueError(f"an image of {shape[2]}x{shape[3]} pixels; expected multiples of {step}")
        return (shape[2] // step) * (shape[3] // step)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] float -> [cells, hidden], row by row."""
        p = self.config.vision["patch_size"]
        x = self.vision_tower(pixels.to(self.vision_tower.ln_pre.weight.dtype))
        return self.multi_modal_projector(x, pixels.shape[2] // p, pixels.shape[3] // p)
