"""GPT-OSS (OpenAI's open-weight mixture of experts): windowed (128) and global layers
alternating, a learned *sink* logit per query head that joins every attention softmax,
biases on q/k/v/o, YaRN, and experts behind a biased router (top-k of the logits,
softmaxed) whose SwiGLU is clamped: (up + 1) * gate * sigmoid(1.702 gate), gate <= 7,
|up| <= 7, with biases on both projections.

Checkpoints stack a layer's experts in two tensors, ``experts.gate_up_proj``
[experts, hidden, 2 x intermediate] (gate and up columns interleaved) and
``experts.down_proj`` [experts, intermediate, hidden] (inputs first), with their biases:
the loader takes each expert's rows from them (``hf_tensors``). The published checkpoints
hold the experts in MXFP4 (``*_blocks`` and ``*_scales``): repacked into ggml's MXFP4 blocks
at load (nibbles moved, nothing rounded), served from them by the block kernels
(pagoda/csrc/gguf_blocks.cpp), as llama.cpp's GGUF files are.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import torch
from gguf import GGMLQuantizationType

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_layer_types, moe_fields, periodic_layer_types
from pagoda.model.layers.blocks import BlockWeight
from pagoda.model.layers.decoder import CausalLM

_MXFP4 = GGMLQuantizationType.MXFP4
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An HF MXFP4 tensor (``*_blocks`` uint8 [..., groups, 16], two E2M1 codes a byte,
    element 2i low and 2i + 1 high; ``*_scales`` uint8 [..., groups], E8M0) as ggml MXFP4
    rows, uint8 [..., groups x 17]: per block the scale byte, then element j low and
    j + 16 high. The codes and the scale byte mean the same in both (ggml doubles the
    values and halves the scale), so this only moves nibbles."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)   # [..., groups, 32] in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales[..., None], packed), dim=-1).flatten(-2).contiguous()


class GptOssForCausalLM(CausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        quant = (config.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise UnsupportedModelError(f"GPT-OSS checkpoints quantized with {quant!r} are not supported "
                                        "(MXFP4 and unquantized ones are)")
        fields = ModelArchConfig.hf_fields(config, architecture)
        if fields["layer_types"] is None and fields["sliding_window"]:
            # transformers' default: even layers windowed, odd ones global.
            fields["layer_types"] = periodic_layer_types(fields["num_hidden_layers"], 2)
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
        """llama.cpp's ``gpt-oss`` files: even layers windowed (its default pattern of 2), the clamp
        and slope its kernels hard-code, gate and up as separate stacked tensors (its
        converter splits the interleaved ones), experts usually MXFP4. Its YaRN truncates
        the ramp's ends (transformers' GPT-OSS does not): pagoda follows the file's engine."""
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        layers = fields["num_hidden_layers"]
        if fields["sliding_window"]:
            fields["layer_types"] = gguf_layer_types(md, layers, 2)
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
    def hf_tensors(cls, name: str, tensor: torch.Tensor,
                   checkpoint: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, Any]]:  # fmt: skip
        m = _EXPERTS.match(name)
        if m is None:
            yield from super().hf_tensors(name, tensor, checkpoint)
            return
        prefix, proj, suffix = m.groups()
        if suffix == "_scales":
            return   # read with their blocks
        if suffix == "_blocks":   # MXFP4 (the published checkpoints): kept in ggml's blocks
            assert checkpoint is not None
            rows = mxfp4_blocks(tensor, checkpoint(f"{prefix}.{proj}_scales"))
            width = tensor.shape[-2] * 32
            for e in range(rows.shape[0]):
                if proj == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", BlockWeight(rows[e], _MXFP4, width)
                else:   # output rows interleaved: gate even, up odd
                    yield f"{prefix}.{e}.gate_proj.weight", BlockWeight(rows[e, 0::2].contiguous(), _MXFP4, width)
                    yield f"{prefix}.{e}.up_proj.weight", BlockWeight(rows[e, 1::2].contiguous(), _MXFP4, width)
            return
        bias = suffix == "_bias"
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
