"""Gemma 4 with its vision tower (``Gemma4ForConditionalGeneration`` as published: E2B, E4B,
26B-A4B, 31B): a ViT of variable resolution, an embedder, and Gemma 4's language model.

The processor (``pagoda/multimodal/processors.py``) resizes an image, keeping its aspect ratio,
to the most 16-pixel patches ``max_soft_tokens`` x ``pooling_kernel_size``^2 allows with both
sides whole pooling cells; here it is cut into patches (row by row, each patch's pixels row by
row, channels last) and read by the tower: a linear patch embedding of 2 (pixel - 0.5), a
learned position per column and per row, encoder layers with Gemma's sandwich norms, RMS-normed
queries, keys and values (values without a weight), 2-D RoPE (the first half of each head
turning with the column, the second with the row) and attention unscaled, then each
``pooling_kernel_size`` x ``pooling_kernel_size`` cell averaged into one soft token, scaled by
sqrt(width) (and standardised where the config says), RMS-normed and projected to the language
model's width: one ``<|image|>`` token per cell, between ``<|image>`` and ``<image|>``.

Linear layers may clamp their inputs and outputs (``use_clipped_linears``: the bounds are
checkpoint tensors). Where the language model says ``use_bidirectional_attention: vision``
(26B, 31B) an image's tokens attend to each other in both directions (as Gemma 3's:
``vision["bidirectional"]``). Per-layer inputs (E2B, E4B): an image token's own part is the
pad token's, the projected part comes from its image embedding, as transformers computes them. The tower stays in float in every mode but int8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, renamed, text_config
from pagoda.model.layers.rotary import apply_rope
from pagoda.model.layers.vision import VisionLanguage, activation
from pagoda.model.models.gemma4 import Gemma4ForCausalLM

_HF_PREFIXES = (("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                ("model.embed_vision.", "embed_vision."))
# transformers' Gemma4VisionConfig defaults (a config.json may leave any of them out).
_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                        num_key_value_heads=12, head_dim=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                        pooling_kernel_size=3, patch_size=16, position_embedding_size=10 * 1024,
                        use_clipped_linears=False, standardize=False)


class RMSNorm(nn.Module):
    """Gemma 4's: float32 statistics, times the weight (not 1 + w); ``scale`` False: none."""

    def __init__(self, width: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (out if self.weight is None else out * self.weight.float()).type_as(x)


class ClippableLinear(nn.Module):
    """A product without bias whose input and output may be clamped to the checkpoint's bounds."""

    def __init__(self, v: dict[str, Any], fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.clipped = v["use_clipped_linears"]
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.tensor(math.inf if name.endswith("max") else -math.inf)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min.to(x.dtype), self.input_max.to(x.dtype))
        y = self.linear(x)
        return torch.clamp(y, self.output_min.to(y.dtype), self.output_max.to(y.dtype))


class VisionAttention(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d, hd = v["hidden_size"], v["head_dim"]
        self.heads, self.kv_heads, self.head_dim = v["num_attention_heads"], v["num_key_value_heads"], hd
        self.q_proj = ClippableLinear(v, d, self.heads * hd)
        self.k_proj = ClippableLinear(v, d, self.kv_heads * hd)
        self.v_proj = ClippableLinear(v, d, self.kv_heads * hd)
        self.o_proj = ClippableLinear(v, self.heads * hd, d)
        self.q_norm = RMSNorm(hd, v["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, v["rms_norm_eps"])
        self.v_norm = RMSNorm(hd, v["rms_norm_eps"], scale=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        n = x.shape[0]
        q = _rope_2d(self.q_norm(self.q_proj(x).view(n, self.heads, -1)), *rope)
        k = _rope_2d(self.k_norm(self.k_proj(x).view(n, self.kv_heads, -1)), *rope)
        v = self.v_norm(self.v_proj(x).view(n, self.kv_heads, -1))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             scale=1.0, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


def _rope_2d(x: torch.Tensor, cos_x: torch.Tensor, sin_x: torch.Tensor, cos_y: torch.Tensor,
             sin_y: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Rotate-half RoPE on each half of the head: the first by the column, the second by the row."""
    half = x.shape[-1] // 2
    return torch.cat((apply_rope(x[..., :half], cos_x, sin_x), apply_rope(x[..., half:], cos_y, sin_y)), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d, i = v["hidden_size"], v["intermediate_size"]
        self.gate_proj, self.up_proj, self.down_proj = ClippableLinear(v, d, i), ClippableLinear(v, d, i), \
            ClippableLinear(v, i, d)
        self.act = activation(v["hidden_activation"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d, eps = v["hidden_size"], v["rms_norm_eps"]
        self.self_attn = VisionAttention(v)
        self.mlp = VisionMLP(v)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * v["patch_size"] ** 2, v["hidden_size"], bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, v["position_embedding_size"], v["hidden_size"]))

    def forward(self, patches: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        table = self.position_embedding_table   # (float in every mode: the products may be int8)
        x = self.input_proj((2 * (patches - 0.5)).to(table.dtype))
        return x + (table[0][cols] + table[1][rows]).to(x.dtype)


class Encoder(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(v["num_hidden_layers"]))


class VisionTower(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.v = v
        self.patch_embedder = PatchEmbedder(v)
        self.encoder = Encoder(v)
        if v["standardize"]:
            self.std_bias = nn.Parameter(torch.zeros(v["hidden_size"]))
            self.std_scale = nn.Parameter(torch.ones(v["hidden_size"]))
        half = v["head_dim"] // 2
        self.inv_freq = 1.0 / (v["rope_theta"] ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, H, W] float in [0, 1] -> [(H / p / k) x (W / p / k), width] soft tokens, row by row."""
        p, k = self.v["patch_size"], self.v["pooling_kernel_size"]
        c, h, w = pixels.shape[1:]
        ph, pw = h // p, w // p
        patches = pixels[0].reshape(c, ph, p, pw, p).permute(1, 3, 2, 4, 0).reshape(ph * pw, p * p * c)
        rows = torch.arange(ph, device=pixels.device).repeat_interleave(pw)
        cols = torch.arange(pw, device=pixels.device).repeat(ph)
        x = self.patch_embedder(patches, cols, rows)
        inv = self.inv_freq.to(pixels.device)
        fx, fy = cols[:, None].float() * inv, rows[:, None].float() * inv
        ex, ey = torch.cat((fx, fx), -1)[:, None, :], torch.cat((fy, fy), -1)[:, None, :]
        rope = tuple(t.to(x.dtype) for t in (ex.cos(), ex.sin(), ey.cos(), ey.sin()))
        for layer in self.encoder.layers:
            x = layer(x, rope)
        # Each k x k cell of patches averaged (in float32), times sqrt(width).
        d = x.shape[-1]
        pooled = x.float().view(ph // k, k, pw // k, k, d).mean(dim=(1, 3)).reshape(-1, d) * d ** 0.5
        if self.v["standardize"]:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)


class Embedder(nn.Module):
    def __init__(self, v: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(v["hidden_size"], v["rms_norm_eps"], scale=False)
        self.embedding_projection = nn.Linear(v["hidden_size"], text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4ForConditionalGeneration(VisionLanguage, Gemma4ForCausalLM):
    tower_prefixes = ("vision_tower.", "embed_vision.")

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.vision_tower = VisionTower(config.vision)
        self.embed_vision = Embedder(config.vision, config.hidden_size)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        text = text_config(config)
        arch = super().arch_from_hf(text, architecture)
        vc = {**_VISION_DEFAULTS, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
        if not config.get("vision_config"):
            raise UnsupportedModelError("a Gemma 4 checkpoint without a vision_config")
        v = {key: vc[key] for key in _VISION_DEFAULTS}
        activation(v["hidden_activation"])
        v.update(rope_theta=float((vc.get("rope_parameters") or {}).get("rope_theta", 100.0)),
                 image_token_id=int(config.get("image_token_id", 258_880)),
                 pad_token_id=int(text.get("pad_token_id") or 0), num_channels=3,
                 # The side of the one image int8 mode calibrates the tower on (8 x 8 soft tokens).
                 image_size=v["patch_size"] * v["pooling_kernel_size"] * 8,
                 bidirectional=text.get("use_bidirectional_attention") == "vision")
        return dataclasses.replace(arch, vision=v)

    @classmethod
    def with_projector(cls, arch: ModelArchConfig, md: dict[str, Any]) -> ModelArchConfig:
        """From llama.cpp's pair: the pad token of the language model's file, and image tokens
        attending both ways on the models without per-layer inputs (26B, 31B), as llama.cpp
        decides it (its files do not say)."""
        vision = {**arch.vision, "pad_token_id": int(md.get("tokenizer.ggml.padding_token_id") or 0),
                  "bidirectional": not arch.per_layer_input_size}
        return dataclasses.replace(arch, vision=vision)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        ours = renamed(name, _HF_PREFIXES)
        if ours.startswith(("vision_tower.", "embed_vision.")):
            return ours
        if ours.startswith(("model.audio_tower.", "model.embed_audio.", "audio_tower.", "embed_audio.")):
            return None   # the audio tower: not served
        return super().hf_name(ours)

    @classmethod
    def num_image_embeds(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> int:
        step = vision["patch_size"] * vision["pooling_kernel_size"]
        if len(shape) != 4 or shape[0] != 1 or shape[1] != 3:
            raise ValueError(f"image pixels of shape {tuple(shape)}; expected (1, 3, H, W)")
        if shape[2] < step or shape[3] < step or shape[2] % step or shape[3] % step:
            raise ValueError(f"an image of {shape[2]}x{shape[3]} pixels; expected multiples of {step}")
        if (shape[2] // vision["patch_size"]) > vision["position_embedding_size"] or \
                (shape[3] // vision["patch_size"]) > vision["position_embedding_size"]:
            raise ValueError(f"an image of {shape[2]}x{shape[3]} pixels is past the tower's learned positions")
        return (shape[2] // step) * (shape[3] // step)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, an image token's as the pad token's (transformers' too: the
        image's rows are replaced, and its per-layer inputs are the pad token's)."""
        v = self.config.vision
        return super().embed(torch.where(input_ids == v["image_token_id"], v["pad_token_id"], input_ids))

    def forward(self, input_ids, positions, kv_caches, meta, num_layers=None, inputs_embeds=None):
        if inputs_embeds is not None and self.config.per_layer_input_size:
            # Per-layer inputs (E2B, E4B): the projection part from the step's embeddings with
            # the images' spliced in, the token part from the pad token at image positions.
            v = self.config.vision
            self.per_layer_inputs(torch.where(input_ids == v["image_token_id"], v["pad_token_id"], input_ids),
                                  inputs_embeds)
        return super().forward(input_ids, positions, kv_caches, meta, num_layers, inputs_embeds)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, H, W] float -> [soft tokens, hidden]."""
        dtype = self.vision_tower.patch_embedder.position_embedding_table.dtype   # (float in every mode)
        return self.embed_vision(self.vision_tower(pixels.to(dtype)))
