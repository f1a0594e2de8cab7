"""GPTQ checkpoints: tiny Llama / Qwen3 models quantized and packed by GPTQ's layout
(qweight / qzeros packed into int32, float16 scales, g_idx; v1's zero - 1 and v2's
zeros), the packing checked with compressed-tensors' own unpacker; pagoda serves the
float32 model of the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.model.hf_quant import QuantConfigError, method_for
from pagoda.model.loader import load_model
from pagoda.ops import cpu_kernels
from tests.model.hf_quant.int_checkpoints import (
    act_order_g_idx,
    assert_serves_its_dequantized_model,
    dequantize,
    groups_of,
    pack_words,
    quantize,
    reference_copy,
    write_quantized,
)

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="needs pagoda's CPU kernels")


def gptq_tensors(prefix: str, w: torch.Tensor, bits: int, group_size: int, sym: bool, v2: bool,
                 desc_act: bool, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    in_features = w.shape[1]
    g_idx = act_order_g_idx(in_features, group_size, seed) if desc_act else groups_of(in_features, group_size)
    q, zeros, scales = quantize(w, bits, g_idx, sym)
    maxq = 2 ** bits - 1
    stored_zeros = zeros if v2 else (zeros - 1) & maxq   # v1: zero - 1, in `bits` bits (0 wraps to maxq)
    meant_zeros = stored_zeros if v2 else stored_zeros + 1
    qweight = pack_words(q.t().contiguous().numpy().T, bits).T    # along the inputs: [in / pack, out]
    qzeros = pack_words(stored_zeros.t().contiguous().numpy(), bits)   # along the outputs: [groups, out / pack]
    tensors = {f"{prefix}.qweight": torch.from_numpy(qweight.copy()), f"{prefix}.qzeros": torch.from_numpy(qzeros),
               f"{prefix}.scales": scales.t().contiguous(), f"{prefix}.g_idx": g_idx.to(torch.int32)}
    _check_packing(tensors, prefix, bits, q, stored_zeros)
    return tensors, dequantize(q, meant_zeros, scales, g_idx)


def _check_packing(tensors, prefix, bits, q, stored_zeros) -> None:
    """compressed-tensors' unpacker (its pack order for 4 and 8 bits is GPTQ's, with signed
    values) reads back the values the packer was given."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    offset = 2 ** (bits - 1)
    qweight, qzeros = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"]
    got_q = unpack_from_int32(qweight.t().contiguous(), bits, q.shape).long() + offset
    got_z = unpack_from_int32(qzeros, bits, (qzeros.shape[0], q.shape[0])).long() + offset
    assert torch.equal(got_q, q) and torch.equal(got_z, stored_zeros.t())


def _gptq_dir(src, tmp_path, bits=4, group_size=32, sym=False, v2=False, desc_act=False):
    entry = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act}
    if v2:
        entry["checkpoint_format"] = "gptq_v2"
    seeds = iter(range(1000))
    meant = write_quantized(src, str(tmp_path / "q"), entry,
                            lambda p, w: gptq_tensors(p, w, bits, group_size, sym, v2, desc_act, next(seeds)))
    return str(tmp_path / "q"), reference_copy(src, str(tmp_path / "ref"), meant)


@pytest.mark.parametrize(("bits", "group_size", "sym", "v2", "desc_act", "kept"), [
    (4, 32, False, False, True, "PAGODA_Q4Z"),     # act order, v1 zeros (some wrap to 16)
    (8, -1, True, True, False, "PAGODA_Q8Z"),       # one group per row, v2
    (4, 64, True, True, False, "PAGODA_Q4Z"),
], ids=["4bit-g32-actorder-v1", "8bit-rows-sym-v2", "4bit-g64-sym-v2"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pagoda_serves_the_dequantized_gptq_model(family, bits, group_size, sym, v2, desc_act, kept, tmp_path,
                                                  tiny_llama_dir, tiny_qwen3_dir):
    src = tiny_llama_dir if family == "llama" else tiny_qwen3_dir
    qdir, ref = _gptq_dir(src, tmp_path, bits, group_size, sym, v2, desc_act)
    assert_serves_its_dequantized_model(qdir, ref, {kept})


def test_act_order_layers_permute_their_inputs_and_dequantize_in_input_order(tiny_llama_dir, tmp_path):
    qdir, ref = _gptq_dir(tiny_llama_dir, tmp_path, desc_act=True)
    model = load_model(qdir, show_progress=False).model
    reference = load_model(ref, show_progress=False).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.permutes_inputs and all(p.input_order is not None for p in qkv.parts)
    want = reference.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv.dequantized(), want)
    # The bfloat16 load dequantizes the same weights (columns in input order).
    bf16 = load_model(qdir, dtype=torch.bfloat16, show_progress=False).model
    assert torch.equal(bf16.model.layers[0].self_attn.qkv_proj.weight, want.bfloat16())


def test_v1_zero_of_zero_reads_back_as_sixteen():
    """AutoGPTQ's v1 stores zero - 1: a group whose weights are all >= 0 (zero 0) is stored
    as 15 in 4 bits and read back as 16, what v1 checkpoints mean (and their kernels compute)."""
    from pagoda.model.hf_quant.gptq import GPTQMethod

    w = torch.rand(16, 64, generator=torch.Generator().manual_seed(0))
    tensors, _ = gptq_tensors("l", w, 4, 32, sym=False, v2=False, desc_act=False)
    q, zeros, scales = quantize(w, 4, groups_of(64, 32), sym=False)
    assert (zeros == 0).all()
    assert torch.equal((tensors["l.qzeros"] >> 4) & 15, torch.full((2, 2), 15, dtype=torch.int32))
    method = GPTQMethod({"quant_method": "gptq", "bits": 4, "group_size": 32})
    [(name, weight)] = list(method.tensors("l.qweight", tensors["l.qweight"], tensors.__getitem__))
    assert name == "l.weight"
    assert torch.equal(weight.dequantize(), dequantize(q, torch.full_like(zeros, 16), scales, groups_of(64, 32)))


def test_gguf_mode_is_accepted_and_int8_is_refused(tiny_llama_dir, tmp_path):
    qdir, ref = _gptq_dir(tiny_llama_dir, tmp_path, bits=4, group_size=32)
    with pytest.raises(QuantConfigError, match="'gptq'.*--quantization int8"):
        load_model(qdir, quantization="int8", show_progress=False)
    model = load_model(qdir, quantization="gguf", show_progress=False).model
    layer = model.model.layers[1].mlp.down_proj
    assert layer.int8_activations
    x = torch.randn(3, layer.in_features)
    want = x @ load_model(ref, show_progress=False).model.model.layers[1].mlp.down_proj.weight.T
    assert (layer(x) - want).norm() < 0.02 * want.norm()


def _edit(qdir: str, fn) -> None:
    import os

    for f in sorted(os.listdir(qdir)):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(qdir, f))
            fn(t)
            save_file(t, os.path.join(qdir, f), metadata={"format": "pt"})


def test_errors_name_the_tensor_or_field(tiny_llama_dir, tmp_path):
    with pytest.raises(QuantConfigError, match="bits 3 is not supported"):
        method_for({"quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}})
    with pytest.raises(QuantConfigError, match="checkpoint_format 'marlin'"):
        method_for({"quantization_config": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}})
    qdir, _ = _gptq_dir(tiny_llama_dir, tmp_path)
    name = "model.layers.0.mlp.down_proj"

    def drop_scales(t):
        t.pop(f"{name}.scales", None)
    _edit(qdir, drop_scales)
    with pytest.raises(QuantConfigError, match=f"{name}.qweight: its companion tensor {name}.scales is missing"):
        load_model(qdir, show_progress=False)

    qdir2 = tmp_path / "two"
    qdir2.mkdir()
    qdir2, _ = _gptq_dir(tiny_llama_dir, qdir2)

    def bad_zeros(t):
        if f"{name}.qzeros" in t:
            t[f"{name}.qzeros"] = t[f"{name}.qzeros"][:, :-1].contiguous()
    _edit(qdir2, bad_zeros)
    with pytest.raises(QuantConfigError, match=f"{name}.qzeros: expected int32"):
        load_model(qdir2, show_progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("desc_act", [False, True], ids=["fused-experts", "act-order-experts"])
def test_moe_experts(desc_act, tiny_qwen3moe_dir, tmp_path):
    """Qwen3-MoE's experts as GPTQ blocks: the fused MoE kernel in input order, the
    per-expert path for act-order experts (the kernel takes the blocks as they are)."""
    qdir, ref = _gptq_dir(tiny_qwen3moe_dir, tmp_path, bits=4, group_size=32, desc_act=desc_act)
    assert_serves_its_dequantized_model(qdir, ref, {"PAGODA_Q4Z", "F32"})   # the routers stay float
    moe = load_model(qdir, show_progress=False).model.model.layers[0].mlp
    assert bool(moe._fused_args()) != desc_act


def test_interleaved_rope_family_rows_permuted_in_their_blocks(tiny_cohere2_dir, tmp_path):
    """Command R7B's Q/K rows (interleaved RoPE) are put in rotate-half order at load: a
    GPTQ checkpoint's kept blocks (act order) move row by row as its float tensors do."""
    qdir, ref = _gptq_dir(tiny_cohere2_dir, tmp_path, desc_act=True)
    assert_serves_its_dequantized_model(qdir, ref, {"PAGODA_Q4Z"})
