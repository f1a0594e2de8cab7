"""``quant_method: "fp8"`` checkpoints (DeepSeek-V3 / Qwen3-FP8 128 x 128 blocks, per
tensor, per channel): kept in pagoda's FP8 blocks, dequantized to transformers' own
dequantization bit for bit, computing the float32 model of the dequantized weights."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.model.hf_quant import QuantConfigError
from pagoda.model.layers.blocks import BlocksLinear
from pagoda.model.loader import load_model
from pagoda.ops import cpu_kernels
from tests.model.hf_quant.float_checkpoints import (
    assert_same_model,
    e8m0_fp8_quantizer,
    fp8_quantizer,
    tiny_dir,
    write_quantized,
)

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="FP8 blocks need pagoda's CPU kernels")

BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head"]}


@pytest.fixture(scope="module")
def llama128(tmp_path_factory):
    return tiny_dir(tmp_path_factory, "llama128", "LlamaConfig", tie_word_embeddings=False,
                    architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def qwen3_128(tmp_path_factory):
    return tiny_dir(tmp_path_factory, "qwen3-128", "Qwen3Config", tie_word_embeddings=True, rope_theta=1e6,
                    architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """DeepSeek-V3's layout (latent attention, routed + shared experts, a float router),
    as its FP8 release quantizes it: every projection in 128 x 128 blocks."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, initializer_range=0.3, num_hidden_layers=2, kv_lora_rank=32, q_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, architectures=["DeepseekV3ForCausalLM"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("deepseek-v3")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


VARIANTS = {
    "deepseek-v3-block128": ("deepseek_v3", fp8_quantizer(128, 128), BLOCK),
    # DeepSeek-V3 / Qwen3-FP8: float32 scale_inv per 128 x 128 block (k/v: 64 rows, one partial block).
    "llama-block128": ("llama128", fp8_quantizer(128, 128), BLOCK),
    "qwen3-block128": ("qwen3_128", fp8_quantizer(128, 128), BLOCK),
    # DeepSeek-V3.1-style E8M0 block scales (transformers' scale_fmt ue8m0).
    "llama-block128-e8m0": ("llama128", e8m0_fp8_quantizer(128, 128), dict(BLOCK, scale_fmt="ue8m0")),
    # AutoFP8 / vLLM: one weight_scale per tensor, static activations (input_scale read, unused).
    "llama-tensor-static": ("tiny_llama_dir", fp8_quantizer(None, None, "weight_scale",
                                                           extra={"input_scale": torch.tensor(0.02)}),
                            {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}),
    # bfloat16 scales per output channel, 64 inputs per row (blocks of 32).
    "qwen3-channel-bf16": ("tiny_qwen3_dir", fp8_quantizer(1, None, "weight_scale", torch.bfloat16),
                           {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def fp8_checkpoint(request, tmp_path_factory):
    src, quantizer, qconfig = VARIANTS[request.param]
    dst = str(tmp_path_factory.mktemp("fp8") / request.param)
    reference = write_quantized(request.getfixturevalue(src), dst, quantizer, qconfig)
    return dst, reference


def test_fp8_checkpoint_computes_its_dequantized_model(fp8_checkpoint):
    path, reference = fp8_checkpoint
    model = load_model(path, show_progress=False).model
    expected = load_model(reference, show_progress=False).model
    layers = [m for n, m in model.named_modules()
              if isinstance(m, BlocksLinear) and n != "lm_head" and not n.endswith("mlp.gate")]
    assert len(layers) >= 4 * model.config.num_hidden_layers   # qkv, o, gate_up, down (or MLA's and experts')
    assert all(p.ggml_type.name.startswith("FP8_") for m in layers for p in m.parts)
    # Memory: about the checkpoint's FP8 bytes (4 bytes of scale per block of 32 or 128).
    for m in layers:
        assert m.weight_bytes <= m.in_features * m.out_features * 36 // 32
    assert_same_model(model, expected)


def test_fp8_weights_are_transformers_dequantization_bit_for_bit(llama128, tmp_path):
    """transformers' own FP8 dequantization (FineGrainedFP8's, float32 out) of the
    checkpoint's tensors equals the weights pagoda keeps, for blocks and per tensor."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    for block, quantizer in (([128, 128], fp8_quantizer(128, 128)), (None, fp8_quantizer(None, None))):
        dst = str(tmp_path / f"q{block}")
        write_quantized(llama128, dst, quantizer, dict(BLOCK, weight_block_size=block))
        model = load_model(dst, show_progress=False).model
        tensors = {}
        for f in os.listdir(dst):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(dst, f)))
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            prefix = f"model.layers.1.self_attn.{name}"
            theirs = finegrained._dequantize_fp8_weight(tensors[prefix + ".weight"], tensors[prefix + ".weight_scale_inv"],
                                                        block, torch.float32)
            ours = model.model.layers[1].self_attn.qkv_proj.parts[i].dequantize()
            assert torch.equal(ours, theirs), name


def test_other_dtypes_dequantize_the_fp8_weights(fp8_checkpoint):
    path, reference = fp8_checkpoint
    model = load_model(path, dtype=torch.bfloat16, show_progress=False).model
    expected = load_model(reference, show_progress=False).model
    w = model.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, expected.model.layers[0].mlp.down_proj.weight.bfloat16())


def _tamper(path: str, edit) -> None:
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, f))
            edit(tensors)
            save_file(tensors, os.path.join(path, f), metadata={"format": "pt"})


def test_fp8_errors_name_the_tensor(llama128, tmp_path):
    def checkpoint(tag, qconfig=BLOCK, quantizer=None):
        dst = str(tmp_path / tag)
        write_quantized(llama128, dst, quantizer or fp8_quantizer(128, 128), qconfig)
        return dst

    missing = checkpoint("missing")
    _tamper(missing, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv", None))
    with pytest.raises(QuantConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is FP8 but the checkpoint "
                                               r"has no model\.layers\.1\.mlp\.up_proj\.weight_scale_inv"):
        load_model(missing, show_progress=False)

    wrong = checkpoint("wrong")
    _tamper(wrong, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(3, 1)}
                                      if "model.layers.0.self_attn.o_proj.weight_scale_inv" in t else {}))
    with pytest.raises(QuantConfigError, match=r"o_proj\.weight_scale_inv: shape \(3, 1\) does not fit"):
        load_model(wrong, show_progress=False)

    narrow = checkpoint("narrow", dict(BLOCK, weight_block_size=[128, 16]), fp8_quantizer(128, 16))
    with pytest.raises(QuantConfigError, match=r"_proj\.weight: pagoda reads FP8 weights in blocks of 32 or 128"):
        load_model(narrow, show_progress=False)

    with pytest.raises(QuantConfigError, match="weight_block_size"):
        load_model(checkpoint("bad-config", dict(BLOCK, weight_block_size=[128])), show_progress=False)


def test_fp8_refuses_other_quantization_modes(llama128, tmp_path):
    dst = str(tmp_path / "q")
    write_quantized(llama128, dst, fp8_quantizer(128, 128), BLOCK)
    for mode in ("gguf", "int8"):
        with pytest.raises(QuantConfigError, match=f"'fp8'; --quantization {mode} does not apply"):
            load_model(dst, quantization=mode, show_progress=False)
