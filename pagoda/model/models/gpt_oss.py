"""GPT-OSS (OpenAI's open-weight mixture of experts): windowed (128) and global layers
alternating, a learned *sink* logit per query head that joins every attention softmax,
biases on q/k/v/o, YaRN, and experts behind a biased router (top-k of the logits,
softmaxed) whose SwiGLU is clamped: (up + 1) * gate * sigmoid(1.702 gate), gate <= 7,
|up| <= 7, with biases on both projections.

Checkpoints stack a layer's experts in two tensors, ``experts.gate_up_proj``
[experts, hidden, 2 x intermediate] (gate and up columns interleaved) and
``experts.down_proj`` [experts, intermediate, hidden] (inputs first), with their biases:
the loader takes each expert's rows from them (``hf_tensors``). The MXFP4 experts of the
released HF checkpoints are refused with a clear error; llama.cpp's GGUF files (MXFP4
experts too) are served from their blocks (``MXFP4`` in pagoda/csrc/gguf_blocks.cpp).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.models.mixtral import moe_fields

_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


class GptOssForCausalLM(CausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        quant = (config.get("quantization_config") or {}).get("quant_method")
        if quant is not None:
            raise UnsupportedModelError(f"GPT-OSS checkpoints quantized with {quant!r} are not supported (no MXFP4 "
                                        "kernel yet); use a bfloat16 checkpoint")
        fields = ModelArchConfig.hf_fields(config, architecture)
        if fields["layer_types"] is None and fields["sliding_window"]:
            # transformers' default: even layers windowed, odd ones global.
            fields["layer_types"] = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(fields["num_hidden_layers"]))
        fields["hidden_act"] = "swiglu_oai"
        bias = fields["attention_bias"]
        return ModelArchConfig(
            **fields, swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), attention_sinks=True, o_proj_bias=bias,
            router_bias=True, mlp_bias=True,
            **moe_fields(config["num_local_experts"], config["num_experts_per_tok"], fields["intermediate_size"],
                         True))  # fmt: skip

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``gpt-oss`` files: even layers windowed (its pattern of 2), the clamp
        and slope its kernels hard-code, gate and up as separate stacked tensors (its
        converter splits the interleaved ones), experts usually MXFP4. Its YaRN truncates
        the ramp's ends (transformers' GPT-OSS does not): pagoda follows the file's engine."""
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        layers = fields["num_hidden_layers"]
        if fields["sliding_window"]:
            fields["layer_types"] = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers))
        fields["hidden_act"] = "swiglu_oai"
        return ModelArchConfig(
            **fields, attention_sinks=True, o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            router_bias=True, mlp_bias=True,
            **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"], md[p + "expert_feed_forward_length"],
                         True))  # fmt: skip

    @classmethod
    def hf_name(cls, name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        m = _EXPERTS.match(name)
        if m is None:
            yield from super().hf_tensors(name, tensor)
            return
        prefix, proj, bias = m.groups()
        leaf = "bias" if bias else "weight"
        for e in range(tensor.shape[0]):
            t = tensor[e]
            if proj == "down_proj":
                yield f"{prefix}.{e}.down_proj.{leaf}", (t if bias else t.T).contiguous()
                continue
            # gate and up interleaved along the last axis: gate at even, up at odd indices.
            gate, up = t[..., 0::2], t[..., 1::2]
            yield f"{prefix}.{e}.gate_proj.{leaf}", (gate if bias else gate.T).contiguous()
            yield f"{prefix}.{e}.up_proj.{leaf}", (up if bias else up.T).contiguous()
