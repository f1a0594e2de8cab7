"""Qwen3.5 with its vision tower (``Qwen3_5ForConditionalGeneration``, dense and MoE, as
published): Qwen3-VL's tower without its deepstack mergers, and Qwen3.5's hybrid language
model with interleaved M-RoPE.

The tower differs from Qwen2.5-VL's (``pagoda/model/models/qwen2_vl.py``, which holds what the
Qwen VL families share: the processor's cells, the patches, the 2-D RoPE, M-RoPE positions)
in LayerNorms, a plain GELU MLP (``linear_fc1`` / ``linear_fc2``), a patch embedding with a
bias, learned positions on a square grid resampled bilinearly (corners aligned) to each
image's grid of patches, and attention over the whole image in every layer. The language
model's full-attention layers turn their rotary frequencies with the temporal, height and
width rows interleaved (T H W T H W ...); its Gated DeltaNet layers have no positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, renamed, text_config
from pagoda.model.layers.decoder import split_stacked_experts
from pagoda.model.layers.vision import activation
from pagoda.model.models.qwen2_vl import (QwenVision, VisionAttention, _by_cell, _patches, axial_inv_freq, axial_rope,
                                         qwen_vision_config)
from pagoda.model.models.qwen3 import Qwen3ForCausalLM
from pagoda.model.models.qwen3_5 import Qwen3_5ForCausalLM
from pagoda.model.models.qwen3_moe import Qwen3MoeForCausalLM

_HF_PREFIXES = (("model.visual.", "visual."),)


class VisionMLP(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.linear_fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])
        self.act = activation(v["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(v["hidden_size"], eps=1e-6)
        self.norm2 = nn.LayerNorm(v["hidden_size"], eps=1e-6)
        self.attn = VisionAttention(v)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, None)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """A cell's 2 x 2 patches into one embedding; ``postshuffle``: the norm over the folded
    cell (Qwen3-VL's deepstack mergers), else over each patch."""

    def __init__(self, v: dict[str, Any], postshuffle: bool = False) -> None:
        super().__init__()
        self.width = v["hidden_size"] * v["spatial_merge_size"] ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else v["hidden_size"], eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, v["out_hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (with a bias), applied as the product it is."""

    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        p, t = v["patch_size"], v["temporal_patch_size"]
        self.proj = nn.Conv3d(v["num_channels"], v["hidden_size"], (t, p, p), (t, p, p))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:   # [N, C * t * p * p] -> [N, hidden]
        w = self.proj.weight
        return torch.nn.functional.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionTransformer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v)
        self.pos_embed = nn.Embedding(v["num_position_embeddings"], v["hidden_size"])
        self.side = int(round(v["num_position_embeddings"] ** 0.5))
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v["num_hidden_layers"]))
        self.merger = PatchMerger(v)
        # Qwen3-VL: features of some layers' outputs, merged by mergers of their own, that the
        # language model adds to the image tokens' hidden states after its first layers.
        self.deepstack = tuple(v.get("deepstack_visual_indexes") or ())
        if self.deepstack:
            self.deepstack_merger_list = nn.ModuleList(PatchMerger(v, postshuffle=True) for _ in self.deepstack)
        self.inv_freq = axial_inv_freq(v)

    @property
    def float_dtype(self) -> torch.dtype:
        return self.merger.norm.weight.dtype   # (a norm: float in every mode)

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The learned positions resampled to a rows x cols grid of patches (bilinear, corners
        aligned: the grid's corners are the table's), cell by cell: [rows x cols, hidden]."""
        m, side = self.v["spatial_merge_size"], self.side
        taps, weights = [], []
        for n in (rows, cols):
            src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
            floor = torch.floor(src)
            offsets = torch.arange(2)
            taps.append((floor.long()[:, None] + offsets).clamp(0, side - 1))
            weights.append((1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
        r, c = _by_cell(torch.arange(rows)[:, None].expand(rows, cols), m), _by_cell(
            torch.arange(cols)[None, :].expand(rows, cols), m)
        index = (taps[0][r][:, :, None] * side + taps[1][c][:, None, :]).reshape(-1, 4)
        weight = (weights[0][r][:, :, None] * weights[1][c][:, None, :]).reshape(-1, 4)
        table = self.pos_embed.weight
        return (table[index.to(table.device)] * weight.to(table.device)[:, :, None]).sum(1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] float -> [(H / p / m) x (W / p / m), out hidden x (1 + deepstack
        layers)], cells row by row: the embeddings, then each deepstack feature."""
        v = self.v
        p, m = v["patch_size"], v["spatial_merge_size"]
        rows, cols = pixels.shape[2] // p, pixels.shape[3] // p
        x = self.patch_embed(_patches(pixels[0], p, m, v["temporal_patch_size"]))
        x = x + self.positions(rows, cols).to(x.dtype)
        cos, sin = axial_rope(rows, cols, m, self.inv_freq, pixels.device)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in self.deepstack:
                features.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *features], dim=-1) if features else self.merger(x)


def _with_tower(arch: ModelArchConfig, config: dict[str, Any], sections: tuple[int, ...],
                deepstack: tuple[int, ...] = ()) -> ModelArchConfig:  # fmt: skip
    """A Qwen3-VL-style checkpoint's language model ``arch`` with the tower's geometry and the
    interleaved M-RoPE sections (``sections``: the family's default)."""
    vc = config.get("vision_config") or {}
    fields = dict(hidden_size=vc.get("hidden_size", 1152), intermediate_size=vc.get("intermediate_size", 4304),
                  hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
                  num_position_embeddings=vc.get("num_position_embeddings", 2304))
    if deepstack:
        fields["deepstack_visual_indexes"] = deepstack
    v = qwen_vision_config({**config, "vision_config": {"patch_size": 16, **vc}}, arch.hidden_size, fields)
    if len(deepstack) > arch.num_hidden_layers:
        raise UnsupportedModelError(f"{len(deepstack)} deepstack features for {arch.num_hidden_layers} layers")
    text = text_config(config)
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return dataclasses.replace(arch, vision=v, mrope_section=tuple(params.get("mrope_section") or sections),
                               mrope_interleaved=bool(params.get("mrope_interleaved", True)))


class _Qwen3Tower(QwenVision):
    """The tower above at ``visual``, M-RoPE interleaved: what Qwen3.5 and Qwen3-VL share."""

    mrope_interleaved = True

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.visual = VisionTransformer(config.vision)


class Qwen3_5ForConditionalGeneration(_Qwen3Tower, Qwen3_5ForCausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return _with_tower(super().arch_from_hf(text_config(config), architecture), config, (11, 11, 10))

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        if name.startswith(("model.visual.", "visual.")):
            return renamed(name, _HF_PREFIXES)
        return super().hf_name(name)

    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # The tower's LayerNorms are plain (the language model's RMSNorms are zero-centred).
        return tensor if name.startswith(("visual.", "model.visual.")) else super().hf_tensor(name, tensor)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    pass


class _Qwen3VL(_Qwen3Tower):
    """Qwen3-VL (dense and MoE): the tower above with its deepstack mergers, Qwen3's language
    model with interleaved M-RoPE. The image's deepstack features ride in the step's input
    embeddings beside the embeddings (zero on text rows) and are added to the hidden states
    after the first layers, one feature a layer (``forward``)."""

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        deepstack = tuple((config.get("vision_config") or {}).get("deepstack_visual_indexes", (8, 16, 24)))
        return _with_tower(super().arch_from_hf(text_config(config), architecture), config, (24, 20, 20), deepstack)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        ours = renamed(name, (("model.language_model.", "model."), ("model.visual.", "visual.")))
        return ours if ours.startswith("visual.") else super().hf_name(ours)

    def forward(self, input_ids, positions, kv_caches, meta, num_layers=None, inputs_embeds=None):
        hidden = self.config.hidden_size
        if inputs_embeds is None or inputs_embeds.shape[-1] == hidden:
            return super().forward(input_ids, positions, kv_caches, meta, num_layers, inputs_embeds)
        if self.stage is not None:
            raise ValueError("image inputs are not supported with pipeline parallelism")
        x, deep = inputs_embeds[:, :hidden].contiguous(), inputs_embeds[:, hidden:]
        end = len(self.model.layers) if num_layers is None else num_layers
        residual, at = None, 0
        for i in range(min(deep.shape[-1] // hidden, end)):
            x, residual = self.run_layers(x, residual, positions, kv_caches, meta, at, i + 1)
            # The layer's output is x + residual: the feature joins it (zero on text rows).
            x = x + deep[:, i * hidden:(i + 1) * hidden].to(x.dtype)
            at = i + 1
        x, residual = self.run_layers(x, residual, positions, kv_caches, meta, at, end)
        return self.model.norm(x, residual)[0]


class Qwen3VLForConditionalGeneration(_Qwen3VL, Qwen3ForCausalLM):
    pass


class Qwen3VLMoeForConditionalGeneration(_Qwen3VL, Qwen3MoeForCausalLM):
    """Qwen3-VL's MoE: its checkpoints stack a layer's experts in one tensor each, as published
    [experts, in, out] or as transformers 5 saves them [experts, out, in] (told apart by the
    router's width; a square one is read as transformers', as transformers reads it); its router
    always renormalises the top-k weights (the config has no norm_topk_prob)."""

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        arch = super().arch_from_hf(config, architecture)
        return dataclasses.replace(arch, norm_topk_prob=True)

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor,
                   checkpoint: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, Any]]:  # fmt: skip
        ours = cls.hf_name(name)
        if ours is None or not ours.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from super().hf_tensors(name, tensor, checkpoint)
            return
        if checkpoint is None:
            raise ValueError(f"{name}: stacked experts need the router's width to be read")
        hidden = checkpoint(name.rsplit(".experts.", 1)[0] + ".gate.weight").shape[1]
        # [experts, out, in]: gate_up's input, down's output is the hidden width.
        transposed = tensor.shape[2 if ours.endswith("gate_up_proj") else 1] != hidden
        base, _, proj = ours.rpartition(".")
        yield from split_stacked_experts(base, proj, tensor, transposed=transposed)
