"""A minimal HF -> GGUF converter for tests: a tiny checkpoint's tensors written with the
``gguf`` library under llama.cpp's names and metadata keys, as llama.cpp's converter writes
them (float32 tensors; Q/K rows permuted for the families its Llama converter handles), so
that pagoda's GGUF path can be compared with transformers on the very same weights."""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType, quants
from gguf.constants import MODEL_ARCH_NAMES
from gguf.tensor_mapping import get_tensor_name_map

# GGUF architectures whose Q/K rows llama.cpp's converter permutes (its LlamaModel).
PERMUTED = {"llama", "mistral", "granite", "smollm3"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's [first half | second half] rows interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str, gguf_arch: str, hf_dir: str, expert_type=None, extra=None) -> str:
    """``model``: a transformers causal LM (float32), saved in ``hf_dir`` (whose tensors,
    in the checkpoint's own names, are the ones written). ``expert_type``: a ggml type the
    experts' weights are quantized to (the gguf library's quantizer; e.g. MXFP4, as
    llama.cpp's GPT-OSS files hold them). ``extra``: called with the writer to add keys
    (a tokenizer). Returns ``path``."""
    from safetensors.torch import load_file
    c = model.config
    if hasattr(c, "allow_global_per_layer_attribute_access"):   # Gemma 4: the windowed layers' values
        c.allow_global_per_layer_attribute_access = True
    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == gguf_arch)
    table = get_tensor_name_map(arch, c.num_hidden_layers)
    w = GGUFWriter(path, gguf_arch)
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if gguf_arch == "gemma4" and c.use_double_wide_mlp and c.num_kv_shared_layers:   # per layer, as llama.cpp's
        first = c.num_hidden_layers - c.num_kv_shared_layers
        w.add_feed_forward_length([c.intermediate_size * (1 if i < first else 2) for i in range(c.num_hidden_layers)])
    else:   # (Llama 4: the dense layers' width; its intermediate_size is the experts')
        w.add_feed_forward_length(getattr(c, "intermediate_size_mlp", None) or c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(heads)
    if gguf_arch == "lfm2":   # llama.cpp's LFM2 converter: KV heads per layer, 0 for the convolutions
        w.add_head_count_kv([0 if t == "conv" else kv for t in c.layer_types])
        w.add_shortconv_l_cache(c.conv_L_cache)
    elif gguf_arch == "gemma4":   # llama.cpp's Gemma 4 converter: per-layer KV heads, the global layers' width
        geometry = [c.per_layer_config[i] for i in range(c.num_hidden_layers)]
        w.add_head_count_kv([g.num_key_value_heads for g in geometry])
        head_dim = max(g.head_dim for g in geometry)
        w.add_key_length_swa(c.head_dim)
        w.add_value_length_swa(c.head_dim)
        w.add_rope_dimension_count_swa(c.head_dim)
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        w.add_shared_kv_layers(c.num_kv_shared_layers)
        w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
        full = c.rope_parameters["full_attention"]
        turning = int(head_dim * full["partial_rotary_factor"] / 2)   # the rest: frequency 1/1e30
        w.add_tensor("rope_freqs.weight", np.asarray([1.0] * turning + [1e30] * (head_dim // 2 - turning),
                                                     dtype=np.float32))
    else:
        w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if gguf_arch == "cohere2":   # llama.cpp's Cohere2 converter: LayerNorm, the logits' scale
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_logit_scale(c.logit_scale)
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_layer_norm_rms_eps(getattr(c, "rms_norm_eps", None) or c.norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)   # per layer type (Gemma 3): the global layers'
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if gguf_arch == "hunyuan-dense" and rope.get("rope_type") == "dynamic":
        # llama.cpp's HunYuan converter: NTK-alpha's stretched base, no scaling type.
        theta *= rope["alpha"] ** (head_dim / (head_dim - 2))
        w.add_rope_scaling_type(RopeScalingType.NONE)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(c.vocab_size)
    if "sliding_attention" in (getattr(c, "layer_types", None) or ()):
        w.add_sliding_window(c.sliding_window)
        if gguf_arch in ("olmo2", "exaone4"):   # llama.cpp's OLMo (OLMo 3), EXAONE 4 converters: a flag per layer
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(getattr(c, "num_experts_per_tok", None) or c.top_k_experts)
        if getattr(c, "moe_intermediate_size", None) and gguf_arch != "llama":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if gguf_arch in ("gpt-oss", "llama4"):
            w.add_expert_feed_forward_length(c.intermediate_size)
        if gguf_arch == "llama4":
            w.add_interleave_moe_layer_step(c.interleave_moe_layer_step)
        if gguf_arch == "minimax-m2":   # llama.cpp's MiniMax-M2 converter (its config's scoring_func: sigmoid)
            w.add_expert_feed_forward_length(c.intermediate_size)
            w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
            w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if gguf_arch == "ernie4_5-moe":   # llama.cpp's ERNIE 4.5 converter
            w.add_interleave_moe_layer_step(c.moe_layer_interval)
            w.add_leading_dense_block_count(c.moe_layer_start_index)
            w.add_expert_shared_count(c.moe_num_shared_experts)
            # (it writes intermediate_size // num_key_value_heads: the real models' shared width)
            w.add_expert_shared_feed_forward_length(c.moe_intermediate_size * c.moe_num_shared_experts)
        if gguf_arch == "glm4moe":   # llama.cpp's GLM-4.5 converter
            w.add_expert_shared_count(c.n_shared_experts)
            w.add_leading_dense_block_count(c.first_k_dense_replace)
            w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
            w.add_expert_weights_scale(c.routed_scaling_factor)
            w.add_expert_weights_norm(c.norm_topk_prob)
            w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    if getattr(c, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    rope_type = rope.get("rope_type", rope.get("type"))
    if gguf_arch == "phi3":
        rotary = int(head_dim * rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0) or 1.0))
        w.add_rope_dimension_count(rotary)
    if rope_type == "llama3":   # llama.cpp's Llama converter: the scaling as per-frequency divisors
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    if rope_type == "longrope":   # llama.cpp's Phi-3 converter: factors as tensors, the rest as keys
        original = rope.get("original_max_position_embeddings") or c.original_max_position_embeddings
        factor = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if rope_type == "yarn":   # llama.cpp's converters: the factor and the original context as keys
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if gguf_arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if extra is not None:
        extra(w)
    state = {}
    for f in sorted(__import__("pathlib").Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    state = (_split_gpt_oss(state) if gguf_arch == "gpt-oss" else _split_llama4(state) if gguf_arch == "llama4"
             else _stack_experts(state))
    tied = bool(getattr(c, "tie_word_embeddings", False))
    for name, t in state.items():
        if name == "lm_head.weight" and tied:
            continue
        # llama.cpp's converter names a router's choice bias "e_score_correction.bias" (exp_probs_b).
        module, _, leaf = (name[: -len("_bias")] + ".bias" if name.endswith("e_score_correction_bias")
                           else name).rpartition(".")
        t = t.detach().float()
        if gguf_arch == "lfm2" and name.endswith("conv.conv.weight"):
            t = t.squeeze(1)   # [hidden, 1, L] -> [hidden, L], as llama.cpp's converter writes it
        m = re.match(r"model\.layers\.(\d+)\.router\.(scale|per_expert_scale)$", name)
        if gguf_arch == "gemma4" and m:   # llama.cpp's Gemma 4 converter: beside the router and the down experts
            kind = "ffn_gate_inp" if m[2] == "scale" else "ffn_down_exps"
            w.add_tensor(f"blk.{m[1]}.{kind}.scale", np.ascontiguousarray(t.numpy()))
            continue
        if gguf_arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1.0   # llama.cpp's Gemma converters store Gemma's 1 + w
        if gguf_arch in PERMUTED and module.endswith("q_proj"):
            t = _permute(t, heads)
        elif gguf_arch in PERMUTED and module.endswith("k_proj"):
            t = _permute(t, kv)
        gguf_name = table.get_name(module)
        if gguf_name is None and table.get_name(name) is not None:   # a bare parameter (sinks)
            gguf_name, leaf = table.get_name(name), "weight"
        assert gguf_name is not None, f"no GGUF name for {module}"
        arr = np.ascontiguousarray(t.numpy())
        if expert_type is not None and ".experts." in name and leaf == "weight":
            w.add_tensor(f"{gguf_name}.{leaf}", quants.quantize(arr, expert_type), raw_dtype=expert_type)
        else:
            w.add_tensor(f"{gguf_name}.{leaf}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def _split_gpt_oss(state: dict) -> dict:
    """GPT-OSS's stacked experts as llama.cpp's converter writes them: gate and up
    de-interleaved into their own [experts, rows, columns] tensors (rows = outputs), down
    transposed likewise, biases [experts, rows]; the router under its own name."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):        # [E, in, 2 x out], interleaved
            base = name[: -len("gate_up_proj")]
            out[base + "gate_proj.weight"] = t[..., 0::2].transpose(1, 2).contiguous()
            out[base + "up_proj.weight"] = t[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            base = name[: -len("gate_up_proj_bias")]
            out[base + "gate_proj.bias"], out[base + "up_proj.bias"] = t[..., 0::2], t[..., 1::2]
        elif name.endswith("mlp.experts.down_proj"):         # [E, in, out]
            out[name + ".weight"] = t.transpose(1, 2).contiguous()
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[name[: -len("_bias")] + ".bias"] = t
        else:
            out[name] = t
    return out


def _split_llama4(state: dict) -> dict:
    """Llama 4's stacked experts as llama.cpp's converter writes them: gate and up split
    out of [experts, in, 2 x out] into [experts, out, in] tensors, down transposed."""
    out = {}
    for name, t in state.items():
        if name.endswith("feed_forward.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=-1)
            out[base + "gate_proj.weight"] = gate.transpose(1, 2).contiguous()
            out[base + "up_proj.weight"] = up.transpose(1, 2).contiguous()
        elif name.endswith("feed_forward.experts.down_proj"):
            out[name + ".weight"] = t.transpose(1, 2).contiguous()
        else:
            out[name] = t
    return out


def _stack_experts(state: dict) -> dict:
    """Each layer's experts stacked into one [experts, rows, columns] tensor per
    projection, named without the expert index, as llama.cpp's converter merges them."""
    out, stacks = {}, {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _llama3_factors(rope: dict, dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1's scaling."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)
