"""compressed-tensors checkpoints with integer weights: W4A16 / W8A16 (``pack-quantized``,
group and channel scales, symmetric or with zero-points) and W8A8 (``int-quantized``).
Tiny Llama / Qwen3 models quantized and packed by the format's definition, the packing
checked with the compressed-tensors library's own decompressors; pagoda serves the
float32 model of the dequantized weights."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.model.hf_quant import QuantConfigError, method_for
from pagoda.model.loader import load_model
from pagoda.ops import cpu_kernels
from tests.model.hf_quant.int_checkpoints import (
    assert_serves_its_dequantized_model,
    dequantize,
    groups_of,
    pack_words,
    quantize,
    reference_copy,
    write_quantized,
)

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="needs pagoda's CPU kernels")
ct = pytest.importorskip("compressed_tensors")


def config_entry(fmt: str, bits: int, strategy: str, group_size: int | None, sym: bool, activations: bool = False):
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy, "group_size": group_size}
    scheme = {"targets": ["Linear"], "weights": weights}
    if activations:   # W8A8: per-token dynamic int8 activations
        scheme["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}


def ct_tensors(prefix, w, entry, scale_dtype):
    scheme_dict = entry["config_groups"]["group_0"]
    args = scheme_dict["weights"]
    bits, sym, fmt = args["num_bits"], args["symmetric"], entry["format"]
    out_features, in_features = w.shape
    g_idx = groups_of(in_features, args["group_size"] if args["strategy"] == "group" else -1)
    q, zeros, scales = quantize(w, bits, g_idx, sym, scale_dtype)
    offset = 2 ** (bits - 1)
    t = {f"{prefix}.weight_scale": scales}
    if fmt == "pack-quantized":   # signed q + offset, packed along the inputs
        t[f"{prefix}.weight_packed"] = torch.from_numpy(pack_words(q.numpy(), bits))
        t[f"{prefix}.weight_shape"] = torch.tensor([out_features, in_features])
        if not sym:   # signed zero-points + offset, packed along the outputs
            t[f"{prefix}.weight_zero_point"] = torch.from_numpy(pack_words(zeros.t().contiguous().numpy(), bits).T.copy())
    else:
        t[f"{prefix}.weight"] = (q - offset).to(torch.int8)
        if not sym:
            t[f"{prefix}.weight_zero_point"] = (zeros - offset).to(torch.int8)
    meant = dequantize(q, zeros, scales, g_idx)
    # The library's decompressor (with the scales as float32: it computes in the scales' dtype)
    # reads the same weights.
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(scheme_dict)
    local = {n[len(prefix) + 1:]: v for n, v in t.items()}
    local["weight_scale"] = local["weight_scale"].float()
    got = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
    assert torch.equal(got, meant)
    return t, meant


CASES = {
    "w4a16-group-asym": (config_entry("pack-quantized", 4, "group", 32, sym=False), torch.bfloat16, "PAGODA_Q4Z"),
    "w4a16-group-sym-f32": (config_entry("pack-quantized", 4, "group", 64, sym=True), torch.float32, "PAGODA_Q4ZF"),
    "w8a16-channel": (config_entry("pack-quantized", 8, "channel", None, sym=True), torch.float16, "PAGODA_Q8Z"),
    "w8a8-int": (config_entry("int-quantized", 8, "channel", None, sym=True, activations=True), torch.bfloat16,
                 "PAGODA_Q8Z"),
}


def _ct_dir(src, tmp_path, case):
    entry, scale_dtype, _ = CASES[case]
    meant = write_quantized(src, str(tmp_path / "q"), entry, lambda p, w: ct_tensors(p, w, entry, scale_dtype))
    return str(tmp_path / "q"), reference_copy(src, str(tmp_path / "ref"), meant)


@pytest.mark.parametrize(("family", "case"), [("llama", c) for c in CASES] +
                         [("qwen3", "w4a16-group-asym"), ("qwen3", "w8a8-int")])
def test_pagoda_serves_the_dequantized_model(family, case, tmp_path, tiny_llama_dir, tiny_qwen3_dir):
    qdir, ref = _ct_dir(tiny_llama_dir if family == "llama" else tiny_qwen3_dir, tmp_path, case)
    assert_serves_its_dequantized_model(qdir, ref, {CASES[case][2]})


def test_float_schemes_go_to_the_float_reader_and_bad_configs_are_named():
    fp8 = config_entry("float-quantized", 8, "channel", None, sym=True)
    fp8["config_groups"]["group_0"]["weights"]["type"] = "float"
    method = method_for({"quantization_config": fp8})
    assert list(method.floats.groups) == ["group_0"] and not method.schemes   # compressed_tensors_float's
    packed_floats = config_entry("pack-quantized", 4, "group", 32, sym=True)
    packed_floats["config_groups"]["group_0"]["weights"]["type"] = "float"
    with pytest.raises(QuantConfigError, match="float weights in format pack-quantized are not supported"):
        method_for({"quantization_config": packed_floats})
    with pytest.raises(QuantConfigError, match="num_bits 3 is not supported"):
        method_for({"quantization_config": config_entry("pack-quantized", 3, "group", 32, sym=True)})
    with pytest.raises(QuantConfigError, match="not a compressed-tensors config"):
        method_for({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": 7}})


def test_a_missing_scale_or_a_wrong_shape_names_the_tensor():
    method = method_for({"quantization_config": config_entry("pack-quantized", 4, "group", 32, sym=False)})
    t, _ = ct_tensors("l", torch.randn(16, 64), config_entry("pack-quantized", 4, "group", 32, sym=False),
                      torch.float16)

    def without(name):
        def read(n):
            if n == name:
                from pagoda.hub.paths import ModelLoadError
                raise ModelLoadError(n)
            return t[n]
        return read
    with pytest.raises(QuantConfigError, match="l.weight_packed: its companion tensor l.weight_scale is missing"):
        list(method.tensors("l.weight_packed", t["l.weight_packed"], without("l.weight_scale")))
    with pytest.raises(QuantConfigError, match="l.weight_zero_point is missing"):
        list(method.tensors("l.weight_packed", t["l.weight_packed"], without("l.weight_zero_point")))
    with pytest.raises(QuantConfigError, match="l.weight_packed: shape \\(16, 7\\) does not hold"):
        list(method.tensors("l.weight_packed", t["l.weight_packed"][:, :7], t.__getitem__))
    assert list(method.tensors("l.weight_scale", t["l.weight_scale"], t.__getitem__)) == []
    assert method.tensors("model.norm.weight", torch.ones(4), t.__getitem__) is None


def test_w8a8_accepts_the_gguf_mode(tiny_llama_dir, tmp_path):
    qdir, ref = _ct_dir(tiny_llama_dir, tmp_path, "w8a8-int")
    model = load_model(qdir, quantization="gguf", show_progress=False).model
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.int8_activations
    x = torch.randn(4, layer.in_features)
    want = x @ load_model(ref, show_progress=False).model.model.layers[0].mlp.gate_up_proj.weight.T
    assert (layer(x) - want).norm() < 0.02 * want.norm()


def test_w8a8_in_the_int8_mode_runs_its_own_int8_weights(tiny_llama_dir, tmp_path):
    """--quantization int8 on a W8A8 checkpoint: each layer an Int8Linear holding the
    checkpoint's int8 weights and per-channel scales (no float channels), its activations
    quantized per token as the scheme says; a W4A16 checkpoint still refuses the mode."""
    from safetensors.torch import load_file

    from pagoda.model.layers.quantization import Int8Linear

    from tokenizers import Tokenizer, models, pre_tokenizers

    qdir, ref = _ct_dir(tiny_llama_dir, tmp_path, "w8a8-int")
    # The LM head (bf16: ignored by the scheme) is calibrated as the int8 mode does: a tokenizer.
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(qdir, "tokenizer.json"))
    stored = {}
    for f in os.listdir(qdir):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(qdir, f)))
    model = load_model(qdir, quantization="int8", show_progress=False).model
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, Int8Linear) and down.outlier_idx.numel() == 0
    assert torch.equal(down.int8_weight(), stored["model.layers.1.mlp.down_proj.weight"])
    torch.testing.assert_close(down.weight_scale, stored["model.layers.1.mlp.down_proj.weight_scale"].float().flatten(),
                               rtol=0, atol=0)
    qkv = model.model.layers[0].self_attn.qkv_proj   # stacked q/k/v: their rows in order
    want = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert isinstance(qkv, Int8Linear) and torch.equal(qkv.int8_weight(), want)
    # The product: per-token int8 x against the int8 weights, close to the dequantized model's.
    x = torch.randn(3, down.in_features)
    ref_w = load_model(ref, show_progress=False).model.model.layers[1].mlp.down_proj.weight
    assert (down(x) - x @ ref_w.T).norm() < 0.02 * (x @ ref_w.T).norm()
    qdir4, _ = _ct_dir(tiny_llama_dir, tmp_path / "w4", "w4a16-group-asym")
    with pytest.raises(QuantConfigError, match="--quantization int8"):
        load_model(qdir4, quantization="int8", show_progress=False)
