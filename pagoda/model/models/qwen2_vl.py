"""Qwen2-VL and Qwen2.5-VL: a ViT of dynamic resolution, a patch merger, and Qwen2's
language model with M-RoPE.

The processor (``pagoda/multimodal/processors.py``) resizes an image to whole merge cells of
``patch_size x spatial_merge_size`` pixels within its pixel budget; here the image is cut into
patches (each seen twice, the temporal patch of a still image), ordered cell by cell as the
checkpoint's processor orders them, and read by the tower: patch embedding, 2-D rotary
positions (height and width) in every layer's attention, and, in Qwen2.5-VL, attention within
windows of ``window_size`` pixels on every layer but ``fullatt_block_indexes``. The merger folds
each 2x2 cell into one embedding for the language model: (height / 28) x (width / 28)
``<|image_pad|>`` tokens an image at the published 14-pixel patches.

The language model's M-RoPE gives an image's tokens three positions (the image's start, plus
their row and column) and the text after it positions from the image's start plus its larger
side (``mrope_positions``); the model runner feeds them as [3, T] positions to a step holding
an image's tokens and the text's one position (shifted by the request's delta) otherwise.
The tower stays in float in every mode but int8 (``quantize_tower``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, renamed, text_config
from pagoda.model.layers.rotary import apply_rope
from pagoda.model.layers.vision import VisionLanguage, activation
from pagoda.model.models.qwen2 import Qwen2ForCausalLM

_HF_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class RMSNorm(nn.Module):
    """Qwen2.5-VL's tower norm: float32 statistics, the weight applied in the input's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _norm(v: dict[str, Any], width: int) -> nn.Module:
    return RMSNorm(width) if v["rms_norm"] else nn.LayerNorm(width, eps=1e-6)


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d over (temporal, patch, patch), applied as the product it is."""

    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        p, t = v["patch_size"], v["temporal_patch_size"]
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(v["hidden_size"], v["num_channels"], t, p, p))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:   # [N, C * T * p * p] -> [N, hidden]
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d = v["hidden_size"]
        self.num_heads = v["num_attention_heads"]
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
        """``groups``: the windows, as [windows, length] row indices of one length each
        (None: the whole image attends to itself)."""
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        if groups is None:
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
        else:
            out = torch.empty_like(q)
            for rows in groups:   # [windows, L]: one batched call per window length
                qw, kw, vw = (t[rows].transpose(1, 2) for t in (q, k, v))
                out[rows] = F.scaled_dot_product_attention(qw, kw, vw).transpose(1, 2)
        return self.proj(out.reshape(n, d))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 (as the checkpoint's code), back in x's dtype."""
    return apply_rope(x.float(), cos, sin).to(x.dtype)


class VisionMLP(nn.Module):
    """Qwen2.5-VL: a gated MLP with biases; Qwen2-VL: fc1, activation, fc2."""

    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d, i = v["hidden_size"], v["intermediate_size"]
        self.gated = v["gated_mlp"]
        self.act = activation(v["hidden_act"])
        if self.gated:
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, i), nn.Linear(d, i), nn.Linear(i, d)
        else:
            self.fc1, self.fc2 = nn.Linear(d, i), nn.Linear(i, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(v, v["hidden_size"]), _norm(v, v["hidden_size"])
        self.attn = VisionAttention(v)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.width = v["hidden_size"] * v["spatial_merge_size"] ** 2
        self.ln_q = _norm(v, v["hidden_size"])
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, v["out_hidden_size"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v["num_hidden_layers"]))
        self.merger = PatchMerger(v)
        self.inv_freq = axial_inv_freq(v)

    @property
    def float_dtype(self) -> torch.dtype:
        return self.merger.ln_q.weight.dtype   # (a norm: float in every mode)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] float -> [(H / p / m) x (W / p / m), out hidden], cells row by row."""
        v = self.v
        p, m = v["patch_size"], v["spatial_merge_size"]
        rows, cols = pixels.shape[2] // p, pixels.shape[3] // p
        x = self.patch_embed(_patches(pixels[0], p, m, v["temporal_patch_size"]))
        cos, sin = axial_rope(rows, cols, m, self.inv_freq, pixels.device)
        windows = v["window_size"] and _windows(rows // m, cols // m, v["window_size"] // m // p, m * m)
        if windows:
            # Patches in window order (whole cells moved together), as the checkpoint's code.
            order, groups = windows
            index = (order[:, None] * m * m + torch.arange(m * m)).reshape(-1)
            x, cos, sin = x[index], cos[index], sin[index]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if not windows or i in v["fullatt_block_indexes"] else groups)
        out = self.merger(x)
        return out[torch.argsort(order)] if windows else out


def axial_inv_freq(v: dict[str, Any]) -> torch.Tensor:
    """The towers' 2-D RoPE frequencies: a quarter of the head's width, for rows and columns each."""
    half = v["hidden_size"] // v["num_attention_heads"] // 2
    return 1.0 / (v["rope_theta"] ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))


def axial_rope(rows: int, cols: int, m: int, inv_freq: torch.Tensor,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The towers' 2-D RoPE tables [patches, 1, head] for a rows x cols grid of patches,
    cell by cell as the patches are ordered: half the frequencies turn with the row, half with
    the column."""
    hpos = torch.arange(rows)[:, None].expand(rows, cols)
    wpos = torch.arange(cols)[None, :].expand(rows, cols)
    pos = torch.stack([_by_cell(hpos, m), _by_cell(wpos, m)], dim=-1)
    freqs = (pos[..., None].float() * inv_freq).flatten(1)   # [N, head / 2]: rows' then columns'
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(device), emb.sin().to(device)


def _by_cell(grid: torch.Tensor, m: int) -> torch.Tensor:
    """A [rows, cols] grid's entries ordered cell (m x m) by cell, row-major within each."""
    r, c = grid.shape
    return grid.reshape(r // m, m, c // m, m).transpose(1, 2).reshape(-1)


def _patches(image: torch.Tensor, p: int, m: int, t: int) -> torch.Tensor:
    """[C, H, W] -> [patches, C * t * p * p]: the processor's patchify (each patch repeated t
    times along time: a still image), patches ordered cell by cell."""
    c, h, w = image.shape
    x = image.reshape(c, h // (p * m), m, p, w // (p * m), m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)
    return x.reshape((h // p) * (w // p), c * t * p * p)


def _windows(rows: int, cols: int, side: int, unit: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """Qwen2.5-VL's windows over a rows x cols grid of cells: squares of ``side`` cells, row by
    row (the last row and column of windows cut short). Returns the cells in window order
    and, per window length, the [windows, length] patch rows (``unit`` patches a cell) each
    window holds in that order; None when one window holds the whole grid."""
    if side <= 0:
        raise ValueError(f"a window of {side} cells")
    if rows <= side and cols <= side:
        return None
    cells = torch.arange(rows * cols).reshape(rows, cols)
    order, spans = [], []
    start = 0
    for r in range(0, rows, side):
        for c in range(0, cols, side):
            w = cells[r:r + side, c:c + side].reshape(-1)
            order.append(w)
            spans.append((start, len(w) * unit))
            start += len(w) * unit
    by_length: dict[int, list[int]] = {}
    for first, length in spans:
        by_length.setdefault(length, []).append(first)
    groups = [torch.tensor(firsts)[:, None] + torch.arange(length) for length, firsts in by_length.items()]
    return torch.cat(order), groups


def mrope_positions(length: int, images: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    """M-RoPE's positions [3, length] of a prompt whose ``images`` are (offset of the first
    image token, rows, cols) of a rows x cols block of image tokens, in order; and the delta
    that places every later token (position = index + delta on all three rows). Text
    counts up from the last position; an image's tokens sit at (start, start + row,
    start + column) and the text after it starts at start + max(rows, cols)."""
    pos = np.empty((3, length), dtype=np.int64)
    at = cur = 0
    for offset, rows, cols in images:
        n = rows * cols
        if offset < at or offset + n > length:
            raise ValueError(f"an image's {n} tokens at {offset} do not fit a prompt of {length} tokens")
        pos[:, at:offset] = cur + np.arange(offset - at)
        cur += offset - at
        pos[0, offset:offset + n] = cur
        pos[1, offset:offset + n] = cur + np.repeat(np.arange(rows), cols)
        pos[2, offset:offset + n] = cur + np.tile(np.arange(cols), rows)
        cur += max(rows, cols)
        at = offset + n
    pos[:, at:] = cur + np.arange(length - at)
    return pos, int(pos.max()) + 1 - length if length else 0


def qwen_vision_config(config: dict[str, Any], text_hidden: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The tower's geometry from a Qwen VL checkpoint's vision_config: what the towers share,
    and ``fields`` (the family's own)."""
    vc = config.get("vision_config") or {}
    v = dict(num_hidden_layers=vc.get("depth", 32), num_attention_heads=vc.get("num_heads", 16),
             num_channels=vc.get("in_channels", 3), patch_size=vc.get("patch_size", 14),
             spatial_merge_size=vc.get("spatial_merge_size", 2), temporal_patch_size=vc.get("temporal_patch_size", 2),
             out_hidden_size=vc.get("out_hidden_size", vc.get("hidden_size", text_hidden)),
             rope_theta=float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)), **fields)
    activation(v["hidden_act"])
    if v["out_hidden_size"] != text_hidden:
        raise UnsupportedModelError(f"the vision tower's output ({v['out_hidden_size']}) is not the language "
                                    f"model's width ({text_hidden})")
    # The side of the one image int8 mode calibrates the tower on (8 x 8 cells).
    v["image_size"] = v["patch_size"] * v["spatial_merge_size"] * 8
    v["image_token_id"] = int(config.get("image_token_id", 151655))
    return v


class QwenVision(VisionLanguage):
    """What the Qwen VL families share beside their language model (listed first among a
    family's bases): a tower at ``visual`` reading one image of any size in whole cells, an
    image token per cell, and M-RoPE positions."""

    tower_prefixes = ("visual.",)
    mrope_interleaved = False   # the family's M-RoPE layout (llama.cpp's files do not say)
    visual: nn.Module
    config: ModelArchConfig

    @classmethod
    def with_projector(cls, arch: ModelArchConfig, md: dict[str, Any]) -> ModelArchConfig:
        """M-RoPE's sections from the language model's GGUF keys (``rope.dimension_sections``)."""
        sections = md.get(f"{md['general.architecture']}.rope.dimension_sections")
        if not sections:
            raise UnsupportedModelError("a Qwen VL language model file without rope.dimension_sections (M-RoPE)")
        return dataclasses.replace(arch, mrope_section=tuple(int(x) for x in sections[:3]),
                                   mrope_interleaved=cls.mrope_interleaved)

    @classmethod
    def image_grid(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
        """The rows and columns of image tokens an image of pixel ``shape`` (1, C, H, W)
        becomes; ValueError for a shape the tower cannot read."""
        step = vision["patch_size"] * vision["spatial_merge_size"]
        if len(shape) != 4 or shape[0] != 1 or shape[1] != vision["num_channels"]:
            raise ValueError(f"image pixels of shape {tuple(shape)}; expected (1, {vision['num_channels']}, H, W)")
        if shape[2] < step or shape[3] < step or shape[2] % step or shape[3] % step:
            raise ValueError(f"an image of {shape[2]}x{shape[3]} pixels; expected multiples of {step}")
        return shape[2] // step, shape[3] // step

    @classmethod
    def num_image_embeds(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> int:
        rows, cols = cls.image_grid(vision, shape)
        return rows * cols

    def mrope_positions(self, prompt_token_ids: list[int], images: list) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, P] and its later tokens' delta (``images``: its
        ``ImageInput``s, each span's image tokens one contiguous run)."""
        grids = [(image.offset, *self.image_grid(self.config.vision, tuple(image.shape))) for image in images]
        return mrope_positions(len(prompt_token_ids), grids)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] float -> [cells, hidden] (a cell: 2 x 2 patches), row by row."""
        return self.visual(pixels.to(self.visual.float_dtype))


class Qwen2VLForConditionalGeneration(QwenVision, Qwen2ForCausalLM):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.visual = VisionTransformer(config.vision)

    @classmethod
    def vision_fields(cls, vc: dict[str, Any]) -> dict[str, Any]:
        """The tower's own geometry (Qwen2-VL's names)."""
        d = vc.get("embed_dim", 1280)
        return dict(hidden_size=d, intermediate_size=int(d * vc.get("mlp_ratio", 4)),
                    hidden_act=vc.get("hidden_act", "quick_gelu"), rms_norm=False, gated_mlp=False,
                    window_size=0, fullatt_block_indexes=())

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        # Older configs (Qwen2-VL, the first Qwen2.5-VL uploads) hold the text fields at the top.
        text = dict(text_config(config) if "text_config" in config else config)
        params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        section = params.pop("mrope_section", None)
        if params.get("type") == "mrope" or params.get("rope_type") == "mrope":   # older configs' name for it
            params.pop("type", None)
            params["rope_type"] = "default"
        params.pop("mrope_interleaved", None)
        text.pop("rope_scaling", None)
        text["rope_parameters"] = params
        arch = super().arch_from_hf(text, architecture)
        v = qwen_vision_config(config, arch.hidden_size, cls.vision_fields(config.get("vision_config") or {}))
        return dataclasses.replace(arch, vision=v, mrope_section=tuple(section or (16, 24, 24)))

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _HF_PREFIXES)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    @classmethod
    def vision_fields(cls, vc: dict[str, Any]) -> dict[str, Any]:
        return dict(hidden_size=vc.get("hidden_size", 1280), intermediate_size=vc.get("intermediate_size", 3420),
                    hidden_act=vc.get("hidden_act", "silu"), rms_norm=True, gated_mlp=True,
                    window_size=vc.get("window_size", 112),
                    fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes", (7, 15, 23, 31))))
