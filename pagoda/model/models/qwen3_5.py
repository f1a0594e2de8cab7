"""Qwen3.5 (dense and MoE) and Qwen3-Next: three Gated DeltaNet layers
(pagoda/model/layers/gated_deltanet.py) to one gated full-attention layer (``layer_types``).

Attention is Qwen3's (q/k RMSNorm per head, GQA) with RoPE on the first quarter of each
head (``partial_rotary_factor``) and a sigmoid gate on each head's output, its rows
interleaved with the query's in q_proj (``attn_output_gate``). Qwen3.5's M-RoPE gives text
the same position on its three axes, which is plain RoPE. The norms are zero-centred
(x (1 + w), held as 1 + w: added at load; llama.cpp's converter adds it too), except the
Gated DeltaNet's own gated norm. MoE variants route softmax top-k (renormalised) over
many small experts beside a shared expert scaled by sigmoid(shared_expert_gate(x)).

Checkpoints: ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (text), the
``...ForConditionalGeneration`` ones as published (the language model is served; the
vision tower and the multi-token-prediction head, ``mtp.*``, are not loaded), and
``Qwen3NextForCausalLM`` (its q, k, v, z and b, a projections stacked per key head,
unpacked after the product). GGUF files under llama.cpp's ``qwen35`` / ``qwen35moe``
(value heads tiled) and ``qwen3next`` (q, k, v and z as two tensors, b, a still stacked
per key head, value heads grouped; its first files' q, k, v, z stacked as in HF's); each
served in its own layout and order (pagoda/model/layers/gated_deltanet.py), no weight
permuted.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from pagoda.model.arch import ModelArchConfig, moe_fields
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.layers.gated_deltanet import GatedDeltaNet
from pagoda.model.layers.hybrid import HybridDecoderLayer, renamed
from pagoda.model.models import UnsupportedModelError

_RENAMES = (
    (".linear_attn.conv1d.weight", ".linear_attn.conv_weight"),
    (".linear_attn.norm.weight", ".linear_attn.norm_weight"),
    (".mlp.shared_expert.", ".mlp.shared_experts."), (".linear_attn.A_log", ".linear_attn.A"),
)  # fmt: skip
# pagoda's names -> the names llama.cpp's table knows them by
_GGUF_NAMES = (
    (".linear_attn.conv_weight", ".linear_attn.conv1d.weight"), (".linear_attn.norm_weight", ".linear_attn.norm.weight"),
    (".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"), (".linear_attn.A", ".linear_attn.A_log"),
    (".mlp.shared_experts.", ".mlp.shared_expert."),
)  # fmt: skip
_VISION = ("model.visual.", "visual.", "mtp.", "model.mtp.")


class Qwen35Layer(HybridDecoderLayer):
    mixer_name = "linear_attn"

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, GatedDeltaNet(config) if config.is_linear_attn_layer(layer_idx) else None)


class Qwen3_5ForCausalLM(CausalLM):
    layer_cls = Qwen35Layer
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        **CausalLM.packed_modules_mapping,
        "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    }
    unquantized_modules = (".mlp.gate", ".mlp.shared_expert_gate")
    # Not yet: adapters on the mixers' projections. (Under tensor parallelism a rank holds
    # whole key heads of every Gated DeltaNet layer: pagoda/model/layers/parallel.py.)
    lora = False

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        n = config["num_hidden_layers"]
        interval = config.get("full_attention_interval", 4)
        types = config.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                              for i in range(n)]
        unknown = set(types) - {"linear_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"Qwen3.5 layer types {sorted(unknown)} are not supported")
        params = config.get("rope_parameters") or {}
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        experts = config.get("num_experts") or 0
        intermediate = config.get("intermediate_size") or config.get("shared_expert_intermediate_size") or 0
        fields = {**config, "intermediate_size": intermediate, "layer_types": None, "sliding_window": None}
        moe = {}
        if experts:
            step = config.get("decoder_sparse_step", 1)
            dense = set(config.get("mlp_only_layers") or ())
            layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
            moe = dict(**moe_fields(experts, config["num_experts_per_tok"], config["moe_intermediate_size"],
                                    bool(config.get("norm_topk_prob", True))),
                       moe_layers=None if all(layers) else layers,
                       num_shared_experts=1 if config.get("shared_expert_intermediate_size") else 0,
                       shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
                       shared_expert_gate=bool(config.get("shared_expert_intermediate_size")))
        return ModelArchConfig(
            **ModelArchConfig.hf_fields(fields, architecture), qk_norm="head", attn_output_gate=True,
            rotary_dim=int(head_dim * partial),
            linear_attn_layers=tuple(t == "linear_attention" for t in types),
            linear_attn=dict(k_heads=config["linear_num_key_heads"], v_heads=config["linear_num_value_heads"],
                             k_dim=config["linear_key_head_dim"], v_dim=config["linear_value_head_dim"],
                             conv_kernel=config.get("linear_conv_kernel_dim", 4)),
            **moe)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``qwen35`` / ``qwen35moe`` files: the Gated DeltaNet's geometry as
        ``ssm.*`` keys (group_count: key heads, time_step_rank: value heads, state_size:
        the key head size), its layers as ``attention.recurrent_layers`` or every
        ``full_attention_interval``-th one attention; value heads tiled (the converter
        reorders them); a multi-token-prediction block past the last layer is not served."""
        p = f"{md['general.architecture']}."
        n = int(md[p + "block_count"]) - int(md.get(p + "nextn_predict_layers", 0) or 0)
        recurrent = md.get(p + "attention.recurrent_layers")
        if recurrent is None:
            interval = int(md.get(p + "full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(n)]
        fields = ModelArchConfig.gguf_fields({**md, p + "block_count": n, p + "feed_forward_length":
                                              md.get(p + "feed_forward_length") or 0}, tensor_names, architecture)
        k_heads, v_heads = int(md[p + "ssm.group_count"]), int(md[p + "ssm.time_step_rank"])
        moe = {}
        if md.get(p + "expert_count"):
            shared = int(md.get(p + "expert_shared_feed_forward_length") or 0)
            moe = dict(**moe_fields(md[p + "expert_count"], md[p + "expert_used_count"],
                                    md[p + "expert_feed_forward_length"], True),
                       num_shared_experts=1 if shared else 0, shared_expert_intermediate_size=shared,
                       shared_expert_gate="blk.0.ffn_gate_inp_shexp.weight" in tensor_names)
        return ModelArchConfig(
            **fields, qk_norm="head", attn_output_gate=True,
            rotary_dim=int(md.get(p + "rope.dimension_count") or fields["head_dim"] // 4),
            linear_attn_layers=tuple(bool(r) for r in recurrent[:n]),
            linear_attn=dict(k_heads=k_heads, v_heads=v_heads, k_dim=int(md[p + "ssm.state_size"]),
                             v_dim=int(md[p + "ssm.inner_size"]) // v_heads, conv_kernel=int(md[p + "ssm.conv_kernel"]),
                             v_order="tiled"),
            **moe)

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        return renamed(name, _GGUF_NAMES)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        if name.startswith(_VISION):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        return renamed(name, _RENAMES)

    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".linear_attn.conv1d.weight"):   # [conv_dim, 1, kernel] -> [conv_dim, kernel]
            return tensor.reshape(tensor.shape[0], -1)
        if name.endswith(".linear_attn.A_log"):
            return -torch.exp(tensor.float())
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return tensor.float() + 1.0   # zero-centred: x (1 + w)
        return tensor

    def shard_rows(self, module_path: str, shard: int) -> tuple[int, int]:
        parent_path, _, stacked = module_path.rpartition(".")
        if stacked != "in_proj":
            return super().shard_rows(module_path, shard)
        sizes = self.get_submodule(parent_path).row_sizes
        return sum(sizes[:shard]), sum(sizes[:shard + 1])

    def state_shapes(self) -> list[tuple[int, ...] | None]:
        return [(layer.linear_attn.state_numel(),) if getattr(layer, "linear_attn", None) is not None else None
                for layer in self.model.layers]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    pass


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers, its Gated DeltaNet's q, k, v, z and b, a
    projections stacked per key head (unpacked after the product: ``layout`` next).
    llama.cpp's ``qwen3next`` files hold q, k, v (``attn_qkv``) and z (``attn_gate``)
    unstacked and b, a as HF's (``ssm_ba``): ``layout`` split_ba, the model's in_proj
    filled from those three."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        **CausalLM.packed_modules_mapping, "in_proj": ("in_proj_qkvz", "in_proj_ba"),
    }

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        if (config.linear_attn or {}).get("layout") == "split_ba":   # the loader asks the model
            self.packed_modules_mapping = {**CausalLM.packed_modules_mapping,
                                           "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_ba")}

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        arch = super().arch_from_hf(config, architecture)
        return dataclasses.replace(arch, linear_attn={**arch.linear_attn, "layout": "next"})

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``qwen3next`` files: Qwen3.5's keys; value heads grouped (this
        converter keeps HF's order); q, k, v and z split out of HF's in_proj_qkvz (b, a
        kept stacked per key head), or, in files of its first converter, stacked as HF's
        (``ssm_in``)."""
        arch = super().arch_from_gguf(md, tensor_names, architecture)
        legacy = any(n.endswith(".ssm_in.weight") for n in tensor_names)
        return dataclasses.replace(arch, linear_attn={**arch.linear_attn, "v_order": "grouped",
                                                      "layout": "next" if legacy else "split_ba"})
