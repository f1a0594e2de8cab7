"""Falcon-H1 (TII, ``FalconH1ForCausalLM``): every layer runs GQA attention and a Mamba-2
mixer side by side on the same normed input and adds their outputs, then a gated MLP,
pre-norm. So every layer keeps both a KV cache (attention) and a fixed-size state per
request (the mixer's: pagoda/model/layers/mamba2.py); the runner gives such a layer a
``StateCache`` whose ``kv`` is its KV cache.

Falcon-H1's multipliers (muP), where transformers applies them:

    x = embed(ids) * embedding_multiplier
    h = input_layernorm(x)
    x = x + ssm_out * mamba(h * ssm_in)  +  attention_out * attention(h * attention_in)
    x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x)) * lm_head_multiplier

in the mixer, in_proj's output times ``ssm_multipliers`` per part (z, x, B, C, dt); in
attention, the keys times ``key_multiplier`` (here: the attention scale, the same scores); in
the MLP, ``down(up * silu(gate * m0)) * m1`` (``mlp_multipliers``). The mixer's gate is
``y * silu(z)``, or with ``mamba_rms_norm`` a group RMSNorm before (``mamba_norm_before_gate``)
or after it. llama.cpp's ``falcon-h1`` files hold the multipliers folded into the weights
(``arch_from_gguf``); a tied embedding's file then scales the logits by the embedding's
multiplier, not the LM head's, as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.attention.state import StateCache
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.decoder import Attention, CausalLM, GatedMLP, KVSpec
from pagoda.model.layers.hybrid import renamed
from pagoda.model.layers.mamba2 import Mamba2Mixer, gguf_mixer_lookup_name, gguf_mixer_tensor, hf_mixer_tensor
from pagoda.model.layers.norm import RMSNorm
from pagoda.model.layers.pipeline import MissingLayer
from pagoda.model.models import UnsupportedModelError

_RENAMES = (
    (".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
    (".mamba.conv1d.weight", ".mamba.conv_weight"), (".mamba.conv1d.bias", ".mamba.conv_bias"),
    (".mamba.norm.weight", ".mamba.norm_weight"), (".mamba.A_log", ".mamba.A"),
)  # fmt: skip


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2Mixer's state and scan; Falcon-H1's input and output multipliers, in_proj's
    per-part multipliers, out_proj's own bias flag (``projectors_bias``), and its gate: a
    plain ``y * silu(z)`` unless ``rms_norm``."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        m = config.mamba
        self.out_proj = nn.Linear(self.inner, config.hidden_size, bias=m["out_proj_bias"])
        self.rms_norm, self.norm_before_gate = m["rms_norm"], m["norm_before_gate"]
        if not self.rms_norm:
            self.norm_weight = None   # no such tensor in the checkpoint
        self.in_multiplier, self.out_multiplier = m["ssm_in"], m["ssm_out"]
        gs = self.groups * self.d_state
        # in_proj's parts z, x, B, C, dt and their multipliers.
        self.parts = [(self.inner, m["ssm_parts"][0]), (self.inner, m["ssm_parts"][1]), (gs, m["ssm_parts"][2]),
                      (gs, m["ssm_parts"][3]), (self.heads, m["ssm_parts"][4])]
        self._part_scale: torch.Tensor | None = None   # the per-column multipliers, built on first use

    def _scale(self, proj: torch.Tensor) -> torch.Tensor:
        if all(v == 1.0 for _, v in self.parts):
            return proj
        if self._part_scale is None or self._part_scale.device != proj.device or self._part_scale.dtype != proj.dtype:
            self._part_scale = torch.cat([torch.full((n,), v, dtype=proj.dtype, device=proj.device)
                                          for n, v in self.parts])
        return proj * self._part_scale

    def forward(self, x: torch.Tensor, cache: StateCache, meta: AttentionMetadata) -> torch.Tensor:
        proj = self._scale(self.in_proj(x * self.in_multiplier if self.in_multiplier != 1.0 else x))
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = self.scan(xbc, dt, cache, meta)
        g = F.silu(gate.float())
        if not self.rms_norm:
            z = y * g
        elif self.norm_before_gate:
            z = self._group_norm(y) * g
        else:
            z = self._group_norm(y * g)
        out = self.out_proj(z.to(x.dtype))
        return out * self.out_multiplier if self.out_multiplier != 1.0 else out

    def _group_norm(self, y: torch.Tensor) -> torch.Tensor:
        z = y.view(-1, self.groups, self.inner // self.groups)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight.float() * z.view(-1, self.inner)


class FalconH1MLP(GatedMLP):
    """``down(up * silu(gate * m0)) * m1``."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.gate_multiplier, self.down_multiplier = config.mamba["mlp"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_multiplier == 1.0 and self.down_multiplier == 1.0:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate * self.gate_multiplier) * up) * self.down_multiplier


class FalconH1Layer(nn.Module):
    """Attention and the Mamba-2 mixer on the same normed input, their scaled outputs added
    to the residual stream; then the MLP, pre-norm. ``cache``: the layer's ``StateCache``,
    its KV cache in ``cache.kv``."""

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        m = config.mamba
        self.self_attn = Attention(config, layer_idx)
        self.mamba = FalconH1Mixer(config)
        self.mlp = FalconH1MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_in, self.attention_out = m["attention_in"], m["attention_out"]

    @property
    def rope_table(self) -> str:
        return self.self_attn.rope_table

    def forward(self, x, residual, cos, sin, cache: StateCache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        ssm = self.mamba(h, cache, meta)
        attn = self.self_attn(h * self.attention_in if self.attention_in != 1.0 else h, cos, sin, cache.kv, meta)
        if self.attention_out != 1.0:
            attn = attn * self.attention_out
        h, residual = self.post_attention_layernorm(ssm + attn, residual)
        return self.mlp(h), residual


class FalconH1ForCausalLM(CausalLM):
    layer_cls = FalconH1Layer
    # Not yet: the Mamba heads split over ranks, adapters on the mixers' projections.
    tensor_parallel = False
    lora = False

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        if (config.get("hidden_act") or "silu") != "silu":   # the MLP's and the mixer's convolution's
            raise UnsupportedModelError(f"Falcon-H1 with hidden_act {config['hidden_act']!r} is not supported")
        n, hidden = config["num_hidden_layers"], config["hidden_size"]
        heads = config["mamba_n_heads"]
        inner = config.get("mamba_d_ssm") or config.get("mamba_expand", 2) * hidden
        head_dim = config.get("mamba_d_head", "auto")
        head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
        if heads * head_dim != inner or heads % config.get("mamba_n_groups", 1):
            raise UnsupportedModelError(f"Falcon-H1: {heads} Mamba heads of {head_dim} for an inner size {inner} "
                                        f"in {config.get('mamba_n_groups', 1)} groups")
        limit = config.get("time_step_limit") or (0.0, float("inf"))
        dt_max = limit[1]
        if isinstance(dt_max, dict):   # JSON's infinity as transformers writes it
            dt_max = float(dt_max.get("__float__", "inf"))
        fields = ModelArchConfig.hf_fields({**config, "layer_types": None, "sliding_window": None}, architecture)
        ssm_parts = tuple(float(v) for v in (config.get("ssm_multipliers") or (1.0,) * 5))
        mlp = tuple(float(v) for v in (config.get("mlp_multipliers") or (1.0, 1.0)))
        if len(ssm_parts) != 5 or len(mlp) != 2:
            raise UnsupportedModelError(f"Falcon-H1: ssm_multipliers {ssm_parts}, mlp_multipliers {mlp}")
        key = float(config.get("key_multiplier", 1.0))
        return ModelArchConfig(
            **fields,
            o_proj_bias=fields["attention_bias"], mlp_bias=bool(config.get("mlp_bias", False)),
            embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
            # The keys times key_multiplier: the scores times it, the cached keys as projected.
            attention_multiplier=key * fields["head_dim"] ** -0.5,
            mamba_layers=(True,) * n,
            mamba=dict(heads=heads, head_dim=head_dim, groups=config.get("mamba_n_groups", 1),
                       d_state=config["mamba_d_state"], d_conv=config.get("mamba_d_conv", 4), intermediate=inner,
                       conv_bias=bool(config.get("mamba_conv_bias", True)),
                       proj_bias=bool(config.get("mamba_proj_bias", False)),
                       dt_min=float(limit[0]), dt_max=float(dt_max),
                       out_proj_bias=bool(config.get("projectors_bias", False)),
                       rms_norm=bool(config.get("mamba_rms_norm", False)),
                       norm_before_gate=bool(config.get("mamba_norm_before_gate", True)),
                       ssm_in=float(config.get("ssm_in_multiplier", 1.0)),
                       ssm_out=float(config.get("ssm_out_multiplier", 1.0)), ssm_parts=ssm_parts,
                       attention_in=float(config.get("attention_in_multiplier", 1.0)),
                       attention_out=float(config.get("attention_out_multiplier", 1.0)), mlp=mlp,
                       lm_head=float(config.get("lm_head_multiplier", 1.0))))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``falcon-h1`` files: its converter folds every multiplier into the
        weights (none left here: all 1), and its mixer's group RMSNorm, where the file has
        one, comes after the gate; the time step unclamped (llama.cpp does not clamp it)."""
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        heads, inner = int(md[p + "ssm.time_step_rank"]), int(md[p + "ssm.inner_size"])
        n = fields["num_hidden_layers"]
        return ModelArchConfig(
            **fields, o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names, mamba_layers=(True,) * n,
            mamba=dict(heads=heads, head_dim=inner // heads, groups=int(md[p + "ssm.group_count"]),
                       d_state=int(md[p + "ssm.state_size"]), d_conv=int(md[p + "ssm.conv_kernel"]),
                       intermediate=inner, conv_bias="blk.0.ssm_conv1d.bias" in tensor_names,
                       proj_bias="blk.0.ssm_in.bias" in tensor_names, dt_min=0.0, dt_max=float("inf"),
                       out_proj_bias="blk.0.ssm_out.bias" in tensor_names,
                       rms_norm="blk.0.ssm_norm.weight" in tensor_names, norm_before_gate=False,
                       ssm_in=1.0, ssm_out=1.0, ssm_parts=(1.0,) * 5, attention_in=1.0, attention_out=1.0,
                       mlp=(1.0, 1.0), lm_head=1.0))

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        # llama.cpp's table knows the MLP's norm only by the checkpoint's whole name
        return gguf_mixer_lookup_name(name).replace(".post_attention_layernorm.weight", ".pre_ff_layernorm.weight")

    gguf_tensor = staticmethod(gguf_mixer_tensor)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _RENAMES)

    hf_tensor = staticmethod(hf_mixer_tensor)

    def kv_specs(self) -> list[KVSpec | None]:
        """Every layer has attention, so a KV cache (beside its state: ``state_shapes``)."""
        return [None if isinstance(layer, MissingLayer) else
                KVSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, None)
                for layer in self.model.layers]

    def state_shapes(self) -> list[tuple[int, ...] | None]:
        return [(Mamba2Mixer.state_size(self.config),)] * len(self.model.layers)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        m = self.config.mamba["lm_head"]
        return (logits * m if m != 1.0 else logits).float()
