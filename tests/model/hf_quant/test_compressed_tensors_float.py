"""compressed-tensors' float formats (``quant_method: "compressed-tensors"``): NVFP4
(``nvfp4-pack-quantized``), MXFP4 (``mxfp4-pack-quantized``) and FP8 (``float-quantized``: per channel, per tensor with
static activations, 128 x 128 blocks). The library's own decompressors unpack the test
checkpoints; pagoda's weights equal theirs bit for bit and compute the float32 model of
the dequantized weights."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.model.hf_quant import QuantConfigError
from pagoda.model.layers.blocks import BlocksLinear
from pagoda.model.loader import load_model
from pagoda.ops import cpu_kernels
from tests.model.hf_quant.float_checkpoints import (
    PROMPT,
    assert_same_model,
    fp8_quantizer,
    mxfp4_quantizer,
    nvfp4_quantizer,
    tiny_dir,
    write_quantized,
)
from tests.model.test_reference import pagoda_prompt_logits

ct = pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="float blocks need pagoda's CPU kernels")


def _args(num_bits: int, strategy: str, **fields) -> dict:
    return {"num_bits": num_bits, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
            "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}, **fields}


def _config(fmt: str, weights: dict, inputs: dict | None, ignore=("lm_head",)) -> dict:
    """A quantization_config as llm-compressor writes it."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": fmt}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None, "version": "0.12.2"}


NVFP4 = _config("nvfp4-pack-quantized", _args(4, "tensor_group", group_size=16),
                _args(4, "tensor_group", group_size=16, dynamic="local"))
NVFP4A16 = _config("nvfp4-pack-quantized", _args(4, "tensor_group", group_size=16), None)
MXFP4A16 = _config("mxfp4-pack-quantized", _args(4, "group", group_size=32), None)
FP8_DYNAMIC = _config("float-quantized", _args(8, "channel"), _args(8, "token", dynamic=True))
FP8_STATIC = _config("float-quantized", _args(8, "tensor"), _args(8, "tensor"))
FP8_BLOCK = _config("float-quantized", _args(8, "block", block_structure=[128, 128]),
                    _args(8, "group", group_size=128, dynamic=True))


@pytest.fixture(scope="module")
def qwen3_128(tmp_path_factory):
    return tiny_dir(tmp_path_factory, "ct-qwen3-128", "Qwen3Config", tie_word_embeddings=True, rope_theta=1e6,
                    architectures=["Qwen3ForCausalLM"])


VARIANTS = {
    # Rows of 64 (NVFP4_32 blocks) and of 128 (down_proj: NVFP4_128); static input global scales.
    "llama-nvfp4": ("tiny_llama_dir", nvfp4_quantizer({"input_global_scale": torch.tensor([100.0])}), NVFP4),
    "qwen3-nvfp4a16": ("qwen3_128", nvfp4_quantizer(), NVFP4A16),
    # MXFP4 into ggml's MXFP4 blocks.
    "llama-mxfp4a16": ("tiny_llama_dir", mxfp4_quantizer(), MXFP4A16),
    "qwen3-fp8-dynamic": ("tiny_qwen3_dir", fp8_quantizer(1, None, "weight_scale", torch.bfloat16), FP8_DYNAMIC),
    "llama-fp8-static": ("tiny_llama_dir", fp8_quantizer(None, None, "weight_scale",
                                                        extra={"input_scale": torch.tensor([0.05])}), FP8_STATIC),
    "qwen3-fp8-block": ("qwen3_128", fp8_quantizer(128, 128, "weight_scale"), FP8_BLOCK),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ct_checkpoint(request, tmp_path_factory):
    src, quantizer, qconfig = VARIANTS[request.param]
    dst = str(tmp_path_factory.mktemp("ct") / request.param)
    reference = write_quantized(request.getfixturevalue(src), dst, quantizer, qconfig)
    return dst, reference, qconfig


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_checkpoint_computes_its_dequantized_model(ct_checkpoint):
    path, reference, qconfig = ct_checkpoint
    model = load_model(path, show_progress=False).model
    layers = [m for n, m in model.named_modules() if isinstance(m, BlocksLinear) and n != "lm_head"]
    prefix = {"nvfp4-pack-quantized": "NVFP4_", "mxfp4-pack-quantized": "MXFP4"}.get(qconfig["format"], "FP8_")
    assert len(layers) == 4 * model.config.num_hidden_layers
    assert all(p.ggml_type.name.startswith(prefix) for m in layers for p in m.parts)
    assert_same_model(model, load_model(reference, show_progress=False).model)


def test_weights_are_the_library_decompressors_bit_for_bit(ct_checkpoint):
    """compressed-tensors' decompressor of each layer's tensors: pagoda's float32 weights
    are its values before the cast to the model's dtype (float32 scales: equal; the
    library's bfloat16 output: pagoda's weights rounded to bfloat16)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    path, _, qconfig = ct_checkpoint
    scheme = QuantizationConfig.model_validate(qconfig).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qconfig["format"])
    model = load_model(path, show_progress=False).model
    tensors = _tensors(path)
    for layer, ours in (("self_attn.k_proj", model.model.layers[1].self_attn.qkv_proj.parts[1]),
                        ("mlp.down_proj", model.model.layers[0].mlp.down_proj.parts[0])):
        i = 1 if layer.startswith("self_attn") else 0
        prefix = f"model.layers.{i}.{layer}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        theirs = compressor.decompress(state, scheme)["weight"]
        got = ours.dequantize()
        assert torch.equal(got.to(theirs.dtype), theirs), layer
        if "weight_packed" in state:   # the library's arithmetic in float32: the same bits
            x_q = unpack_fp4_from_uint8(state["weight_packed"], got.shape[0], got.shape[1], dtype=torch.float32)
            mx = "weight_global_scale" not in state
            scale = decompress_mx_scale(state["weight_scale"]) if mx else state["weight_scale"]
            exact = dequantize(x_q=x_q, scale=scale.float(), args=scheme.weights,
                               global_scale=state.get("weight_global_scale"), dtype=torch.float32)
            assert torch.equal(got, exact), layer
        elif state["weight_scale"].dtype == torch.float32:
            assert theirs.dtype == torch.float32


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_gguf_mode_multiplies_int8_activations(tmp_path, tiny_llama_dir, fmt):
    dst = str(tmp_path / "q")
    quantizer, qconfig = (nvfp4_quantizer(), NVFP4A16) if fmt == "nvfp4" else (mxfp4_quantizer(), MXFP4A16)
    write_quantized(tiny_llama_dir, dst, quantizer, qconfig)
    model = load_model(dst, quantization="gguf", show_progress=False).model
    layers = [m for m in model.modules() if isinstance(m, BlocksLinear) and m.quantized_parts]
    assert layers and all(m.int8_activations for m in layers)
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        x = torch.randn(5, layer.in_features, generator=g)
        got = layer(x)
        # the exact mode's product, from the weights' float32 values (a repacked layout
        # multiplies in the gguf mode alone)
        ref = torch.nn.functional.linear(x, layer.dequantized(), layer.bias)
        assert not torch.equal(got, ref) and (got - ref).norm() < 0.02 * ref.norm()
    assert torch.isfinite(pagoda_prompt_logits(model, PROMPT, [len(PROMPT)])).all()


def test_fp8_refuses_the_gguf_mode(tmp_path, tiny_llama_dir):
    dst = str(tmp_path / "q")
    write_quantized(tiny_llama_dir, dst, fp8_quantizer(1, None, "weight_scale"), FP8_DYNAMIC)
    with pytest.raises(QuantConfigError, match="float-quantized.*--quantization gguf does not apply"):
        load_model(dst, quantization="gguf", show_progress=False)


def test_errors_name_the_tensor_or_field(tmp_path, tiny_llama_dir):
    def checkpoint(tag, qconfig=NVFP4A16, quantizer=None, edit=None):
        dst = str(tmp_path / tag)
        write_quantized(tiny_llama_dir, dst, quantizer or nvfp4_quantizer(), qconfig)
        if edit is not None:
            for f in os.listdir(dst):
                if f.endswith(".safetensors"):
                    tensors = load_file(os.path.join(dst, f))
                    edit(tensors)
                    save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
        return dst

    gate = "model.layers.1.mlp.gate_proj"
    missing = checkpoint("missing", edit=lambda t: t.pop(gate + ".weight_global_scale", None))
    with pytest.raises(QuantConfigError, match=rf"{gate}\.weight_packed is quantized but the checkpoint has no "
                                               rf"{gate}\.weight_global_scale"):
        load_model(missing, show_progress=False)

    wrong = checkpoint("wrong", edit=lambda t: t.update({gate + ".weight_scale": t[gate + ".weight_scale"][:, :2].contiguous()})
                       if gate + ".weight_scale" in t else None)
    with pytest.raises(QuantConfigError, match=rf"{gate}\.weight_scale: shape \(128, 2\) does not fit"):
        load_model(wrong, show_progress=False)

    fp8_missing = checkpoint("fp8-missing", FP8_DYNAMIC, fp8_quantizer(1, None, "weight_scale"),
                             edit=lambda t: t.pop("model.layers.0.self_attn.v_proj.weight_scale", None))
    with pytest.raises(QuantConfigError, match=r"v_proj\.weight is quantized but the checkpoint has no "
                                               r"model\.layers\.0\.self_attn\.v_proj\.weight_scale"):
        load_model(fp8_missing, show_progress=False)

    bits = copy.deepcopy(NVFP4A16)
    bits["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(QuantConfigError, match=r"config_groups\.group_0: nvfp4-pack-quantized needs 4-bit weights "
                                               r"in groups of 16"):
        load_model(checkpoint("group32", bits), show_progress=False)



def test_other_dtypes_dequantize_the_weights(ct_checkpoint):
    path, reference, _ = ct_checkpoint
    model = load_model(path, dtype=torch.bfloat16, show_progress=False).model
    expected = load_model(reference, show_progress=False).model
    w = model.model.layers[1].mlp.gate_up_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, expected.model.layers[1].mlp.gate_up_proj.weight.bfloat16())


def _int8_channel(name: str, w: torch.Tensor):
    """compressed-tensors' int-quantized W8A8 weight: int8 q = round(w / s), s = amax / 127 per row."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {name: q, name[: -len(".weight")] + ".weight_scale": scale}, q.float() * scale


def test_mixed_precision_config_reads_float_and_integer_groups(tmp_path, tiny_qwen3_dir):
    """One compressed-tensors config, two formats: FP8 attention (float-quantized) and W8A8
    MLPs (int-quantized); the one method reads both."""
    fp8 = fp8_quantizer(1, None, "weight_scale")
    qconfig = _config("mixed-precision", _args(8, "channel"), None)
    qconfig["config_groups"] = {
        "attention": {"targets": ["re:.*self_attn.*"], "weights": _args(8, "channel"), "format": "float-quantized"},
        "mlp": {"targets": ["re:.*mlp.*"], "format": "int-quantized",
                "weights": {**_args(8, "channel"), "type": "int"},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}},
    }
    dst = str(tmp_path / "mixed")
    reference = write_quantized(tiny_qwen3_dir, dst, lambda n, w: (fp8 if "self_attn" in n else _int8_channel)(n, w),
                                qconfig)
    model = load_model(dst, show_progress=False).model
    layer = model.model.layers[1]
    assert {p.ggml_type.name for p in layer.self_attn.qkv_proj.parts} == {"FP8_32"}
    assert not layer.mlp.down_proj.parts[0].ggml_type.name.startswith("FP8")
    assert_same_model(model, load_model(reference, show_progress=False).model)
    with pytest.raises(QuantConfigError, match="--quantization gguf does not apply"):
        load_model(dst, quantization="gguf", show_progress=False)
