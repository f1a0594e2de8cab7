"""ERNIE 4.5 MoE (Baidu, ``Ernie4_5_MoeForCausalLM``: ERNIE-4.5-21B-A3B, 300B-A47B). What it
adds to the shared decoder:

- RoPE on interleaved pairs (x0, x1), (x2, x3), ...: the Q/K rows of each head put in
  rotate-half order at load, from HF (``hf_qk_permuted``) and from llama.cpp's
  ``ernie4_5-moe`` files, which hold HF's rows (``gguf_qk_permuted``);
- experts on the layers ``moe_layer_start_index`` <= i <= ``moe_layer_end_index`` with
  (i + 1) % ``moe_layer_interval`` == 0 (the others dense MLPs): a softmax router whose
  per-expert bias (``moe_statics.e_score_correction_bias``) chooses the top ``moe_k`` experts
  but does not weigh them, their probabilities renormalised (divided by max(sum,
  ``moe_norm_min``)), plus ``moe_num_shared_experts`` shared experts every token takes;
- its multi-token-prediction tensors (``mtp_*``) not read.

llama.cpp's files: the experts' layers as their tensors say (``ffn_gate_inp``), the shared
experts' width ``expert_shared_feed_forward_length``, the bias ``exp_probs_b`` (shaped [1,
experts] as the checkpoint holds it). Refused: ``use_bias`` (biases on every projection and
on the LM head), the Paddle layout's stacked ``qkv_proj`` / ``up_gate_proj``, per-modality
expert lists (ERNIE 4.5 VL)."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_moe_layers, moe_fields
from pagoda.model.layers.decoder import CausalLM

_MTP = ("model.mtp_block.", "model.mtp_emb_norm.", "model.mtp_hidden_norm.", "model.mtp_linear_proj.")
_BIAS = ".mlp.moe_statics.e_score_correction_bias"


class Ernie4_5_MoeForCausalLM(CausalLM):  # noqa: N801 (transformers' name)
    unquantized_modules = (".mlp.gate",)
    hf_qk_permuted = True
    gguf_qk_permuted = True

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        if name.startswith("ernie."):
            name = "model." + name[len("ernie."):]
        if name.startswith(_MTP):
            return None   # the multi-token-prediction block
        if ".self_attn.qkv_proj." in name or ".up_gate_proj." in name:
            raise UnsupportedModelError(f"ERNIE 4.5 checkpoint with stacked projections ({name}: the Paddle "
                                        "layout) is not supported; its transformers layout (-PT) is")
        return name.replace(_BIAS, ".mlp.score_bias")

    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1) if name.endswith(_BIAS) else tensor   # [1, experts] -> [experts]

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        # (llama.cpp's converter: "e_score_correction.bias", its exp_probs_b.bias)
        return name.replace(".mlp.score_bias", ".mlp.moe_statics.e_score_correction.bias")

    @classmethod
    def gguf_tensor(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1) if hf_name.endswith(".mlp.score_bias") else tensor

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        if config.get("use_bias"):
            raise UnsupportedModelError("ERNIE 4.5 with use_bias (biases on every projection and the LM head) "
                                        "is not supported")
        fields = ModelArchConfig.hf_fields(config, architecture)
        n = fields["num_hidden_layers"]
        experts, k = config.get("moe_num_experts"), config.get("moe_k")
        start, end = config.get("moe_layer_start_index", 1), config.get("moe_layer_end_index", -1)
        interval = config.get("moe_layer_interval", 1)
        if not all(isinstance(v, int) for v in (experts, k, start, end, interval)) or interval < 1:
            raise UnsupportedModelError(f"ERNIE 4.5 experts {experts!r} / moe_k {k!r} / layers {start!r}-{end!r} "
                                        f"every {interval!r} (per-modality lists: ERNIE 4.5 VL) are not supported")
        end = n - 1 if end == -1 else end
        shared = config.get("moe_num_shared_experts") or 0
        return ModelArchConfig(
            **fields,
            moe_layers=tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n)),
            num_shared_experts=shared, expert_score_bias=True,
            norm_topk_min=float(config.get("moe_norm_min") or 0.0),
            **moe_fields(experts, k, config["moe_intermediate_size"], True))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        if int(md.get(p + "expert_gating_func", 1)) != 1:
            raise UnsupportedModelError("ERNIE 4.5 GGUF: only softmax expert gating (expert_gating_func 1) "
                                        "is supported")
        if md.get(p + "rope.dimension_sections"):
            raise UnsupportedModelError("ERNIE 4.5 GGUF with rope.dimension_sections (M-RoPE) is not supported")
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        n = fields["num_hidden_layers"]
        moe = gguf_moe_layers(tensor_names, n)
        first = next((i for i in range(n) if moe is None or moe[i]), 0)
        width = int(md[p + "expert_feed_forward_length"])
        shared = int(md.get(p + "expert_shared_count") or 0) if f"blk.{first}.ffn_gate_shexp.weight" in tensor_names \
            else 0
        return ModelArchConfig(
            **fields, moe_layers=moe, num_shared_experts=shared,
            shared_expert_intermediate_size=int(md.get(p + "expert_shared_feed_forward_length") or shared * width),
            expert_score_bias=f"blk.{first}.exp_probs_b.bias" in tensor_names,
            **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"], width, True))
