"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): a hybrid of Mamba-2 layers
(pagoda/model/layers/mamba2.py) and GQA attention, Granite's multipliers, a gated MLP after
each, or (``num_local_experts`` > 0) experts chosen by a softmax router beside that MLP as a
shared expert (Granite 4.0-H Tiny / Small).
GGUF files under llama.cpp's ``granitehybrid``, with or without experts (Mamba tensors as its
converter stores them: ``pagoda.model.layers.mamba2.gguf_mixer_tensor``; Q/K rows permuted,
put back at load; the experts stacked, ``ffn_{gate,up,down}_exps``, the shared MLP as
``ffn_{gate,up,down}_shexp``).
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.hub.paths import ModelLoadError
from pagoda.model.arch import ModelArchConfig, gguf_moe_layers, moe_fields
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.layers.hybrid import HybridDecoderLayer, renamed
from pagoda.model.layers.mamba2 import Mamba2Mixer, gguf_mixer_lookup_name, gguf_mixer_tensor, hf_mixer_tensor
from pagoda.model.models import UnsupportedModelError

_RENAMES = (
    (".block_sparse_moe.router.layer.weight", ".mlp.gate.weight"),
    (".mamba.conv1d.weight", ".mamba.conv_weight"), (".mamba.conv1d.bias", ".mamba.conv_bias"),
    (".mamba.norm.weight", ".mamba.norm_weight"), (".mamba.A_log", ".mamba.A"),
)  # fmt: skip


class GraniteHybridLayer(HybridDecoderLayer):
    mixer_name = "mamba"

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, Mamba2Mixer(config) if config.is_mamba_layer(layer_idx) else None)


def _has_experts(checkpoint, layer: str) -> bool:
    """Whether the checkpoint's layer ``layer`` (its name prefix) has a router."""
    if checkpoint is None:
        return False
    try:
        checkpoint(layer + ".block_sparse_moe.router.layer.weight")
    except ModelLoadError:
        return False
    return True


class GraniteMoeHybridForCausalLM(CausalLM):
    layer_cls = GraniteHybridLayer
    unquantized_modules = (".mlp.gate",)
    gguf_qk_permuted = True   # llama.cpp's converter permutes the attention layers' (its LlamaModel)
    # Not yet: the Mamba heads split over ranks, adapters on the mixers' projections.
    tensor_parallel = False
    lora = False

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        n = config["num_hidden_layers"]
        experts = config.get("num_local_experts") or 0
        moe = {}
        if experts:   # the experts' width is intermediate_size, the shared MLP's shared_intermediate_size
            moe = dict(**moe_fields(experts, config["num_experts_per_tok"], config["intermediate_size"], True),
                       num_shared_experts=1, shared_expert_intermediate_size=config["shared_intermediate_size"])
        types = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * n
        mamba = tuple(t in ("mamba", "linear_attention") for t in types)
        unknown = set(types) - {"mamba", "linear_attention", "attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"Granite 4.0-H layer types {sorted(unknown)} are not supported")
        hidden, heads = config["hidden_size"], config["mamba_n_heads"]
        inner = config.get("mamba_expand", 2) * hidden
        head_dim = config.get("mamba_d_head", "auto")
        limit = config.get("time_step_limit") or (0.0, float("inf"))
        dt_max = limit[1]
        if isinstance(dt_max, dict):   # JSON's infinity as transformers writes it
            dt_max = float(dt_max.get("__float__", "inf"))
        fields = {**config, "intermediate_size": config["shared_intermediate_size"], "layer_types": None,
                  "sliding_window": None}
        nope = config.get("position_embedding_type") not in (None, "rope")
        return ModelArchConfig(
            **ModelArchConfig.hf_fields(fields, architecture),
            embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(config.get("residual_multiplier", 1.0)),
            attention_multiplier=float(config.get("attention_multiplier", 1.0)),
            logits_divisor=float(config.get("logits_scaling", 1.0)),
            rope_layers=tuple(False for _ in range(n)) if nope else None,
            mamba_layers=mamba,
            mamba=dict(heads=heads, head_dim=inner // heads if head_dim == "auto" else int(head_dim),
                       groups=config.get("mamba_n_groups", 1), d_state=config["mamba_d_state"],
                       d_conv=config.get("mamba_d_conv", 4), intermediate=inner,
                       conv_bias=bool(config.get("mamba_conv_bias", True)),
                       proj_bias=bool(config.get("mamba_proj_bias", False)),
                       dt_min=float(limit[0]), dt_max=float(dt_max)),
            **moe)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``granitehybrid`` files: ``attention.head_count_kv`` per layer, 0 for
        the Mamba layers; the MLP's width as the shared expert's; RoPE on where
        ``rope.scaling.finetuned`` (llama.cpp's switch for it) is; Granite's scales; the
        time step unclamped (llama.cpp does not clamp it). With ``expert_count`` > 0 (Tiny,
        Small): every layer's experts of ``feed_forward_length`` beside the shared expert of
        ``expert_shared_feed_forward_length`` (none where that is 0), chosen by softmax
        top-k and renormalised, unscaled, as llama.cpp runs them."""
        p = f"{md['general.architecture']}."
        n = int(md[p + "block_count"])
        experts = int(md.get(p + "expert_count") or 0)
        moe = {}
        if experts:
            shared = int(md.get(p + "expert_shared_feed_forward_length") or 0)
            moe = dict(moe_layers=gguf_moe_layers(tensor_names, n), num_shared_experts=1 if shared else 0,
                       shared_expert_intermediate_size=shared,
                       **moe_fields(experts, int(md[p + "expert_used_count"]), int(md[p + "feed_forward_length"]),
                                    True))
        kv = md[p + "attention.head_count_kv"]
        per_layer = [int(k) for k in kv] if isinstance(kv, (list, tuple)) else [int(kv)] * n
        attention = {k for k in per_layer if k}
        if len(per_layer) != n or len(attention) > 1:
            raise UnsupportedModelError(f"Granite 4.0-H GGUF: head_count_kv {per_layer} for {n} layers")
        ffn = md.get(p + "expert_shared_feed_forward_length") or md[p + "feed_forward_length"]
        fields = ModelArchConfig.gguf_fields({**md, p + "attention.head_count_kv": min(attention, default=1),
                                              p + "feed_forward_length": ffn}, tensor_names, architecture)
        heads, inner, groups = int(md[p + "ssm.time_step_rank"]), int(md[p + "ssm.inner_size"]), \
            int(md[p + "ssm.group_count"])
        first = per_layer.index(0) if 0 in per_layer else 0
        return ModelArchConfig(
            **fields,
            embedding_multiplier=float(md.get(p + "embedding_scale", 1.0)),
            residual_multiplier=float(md.get(p + "residual_scale", 1.0)),
            attention_multiplier=float(md.get(p + "attention.scale", 1.0)),
            logits_divisor=float(md.get(p + "logit_scale", 1.0)),
            rope_layers=None if md.get(p + "rope.scaling.finetuned", True) else (False,) * n,
            mamba_layers=tuple(k == 0 for k in per_layer),
            mamba=dict(heads=heads, head_dim=inner // heads, groups=groups, d_state=int(md[p + "ssm.state_size"]),
                       d_conv=int(md[p + "ssm.conv_kernel"]), intermediate=inner,
                       conv_bias=f"blk.{first}.ssm_conv1d.bias" in tensor_names,
                       proj_bias=f"blk.{first}.ssm_in.bias" in tensor_names, dt_min=0.0, dt_max=float("inf")),
            **moe)

    gguf_lookup_name = staticmethod(gguf_mixer_lookup_name)
    gguf_tensor = staticmethod(gguf_mixer_tensor)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _RENAMES)

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor, checkpoint=None):
        """The MLP's gate and up stacked in one tensor (shared_mlp.input_linear); the experts'
        stacked [experts, 2 x width, hidden] and [experts, hidden, width]; a layer with experts
        holds its shared MLP as the MoE block's shared expert."""
        base = name.rpartition(".shared_mlp.")[0] or name.rpartition(".block_sparse_moe.")[0]
        if ".shared_mlp." in name:
            mlp = base + (".mlp.shared_experts." if _has_experts(checkpoint, base) else ".mlp.")
            if name.endswith(".input_linear.weight"):   # [gate; up]
                gate, up = tensor.chunk(2, dim=0)
                yield mlp + "gate_proj.weight", gate
                yield mlp + "up_proj.weight", up
            else:
                yield mlp + "down_proj.weight", tensor
            return
        if name.endswith(".block_sparse_moe.input_linear.weight"):
            for e, part in enumerate(tensor):
                gate, up = part.chunk(2, dim=0)
                yield f"{base}.mlp.experts.{e}.gate_proj.weight", gate
                yield f"{base}.mlp.experts.{e}.up_proj.weight", up
            return
        if name.endswith(".block_sparse_moe.output_linear.weight"):
            for e, part in enumerate(tensor):
                yield f"{base}.mlp.experts.{e}.down_proj.weight", part
            return
        yield from super().hf_tensors(name, tensor, checkpoint)

    hf_tensor = staticmethod(hf_mixer_tensor)

    def state_shapes(self) -> list[tuple[int, ...] | None]:
        c = self.config
        return [(Mamba2Mixer.state_size(c),) if c.is_mamba_layer(i) else None for i in range(len(self.model.layers))]
