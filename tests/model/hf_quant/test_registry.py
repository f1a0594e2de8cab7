"""The pre-quantized checkpoint registry and its loader hook (pagoda/model/hf_quant)."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.hf_quant import (
    METHODS,
    QuantConfigError,
    QuantMethod,
    method_for,
    register,
)
from pagoda.model.layers.blocks import BlocksLinear, BlockWeight
from pagoda.model.loader import load_model
from tests.model.hf_quant.int_checkpoints import write_quantized


class _RowsMethod(QuantMethod):
    """A test format: each projection stored as ``<prefix>.rows`` (float16) plus a
    ``<prefix>.rows_scale`` companion (float32 per output channel)."""

    name = "pagoda-test-rows"

    def tensors(self, name, tensor, checkpoint):
        if name.endswith(".rows_scale"):
            return iter(())
        if not name.endswith(".rows"):
            return None
        prefix = name[: -len(".rows")]
        w = tensor.float() * checkpoint(prefix + ".rows_scale")[:, None]
        return iter([(prefix + ".weight", BlockWeight.from_tensor(w.half()))])


@pytest.fixture
def rows_method():
    register(_RowsMethod)
    yield _RowsMethod
    METHODS.pop(_RowsMethod.name)


def _quantized_copy(src: str, dst: str) -> dict[str, torch.Tensor]:
    """The checkpoint at ``src`` with every projection in the test format; returns the
    weights the loaded model must hold (float16-rounded projections)."""

    def rows(prefix: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        stored = {prefix + ".rows": (t / 2.0).half(), prefix + ".rows_scale": torch.full((t.shape[0],), 2.0)}
        return stored, ((t / 2.0).half().float() * 2.0).half().float()

    return write_quantized(src, dst, {"quant_method": _RowsMethod.name}, rows)


def test_a_registered_method_builds_the_layers_from_its_tensors(tiny_llama_dir, tmp_path, rows_method):
    expected = _quantized_copy(tiny_llama_dir, str(tmp_path / "q"))
    model = load_model(str(tmp_path / "q"), show_progress=False).model
    q = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(q, BlocksLinear)
    assert q.parts[0].ggml_type.name == "F16"
    torch.testing.assert_close(q.parts[0].dequantize(), expected["model.layers.0.self_attn.q_proj.weight"],
                               rtol=0, atol=0)
    # Every projection came through the method: all kept as float16 rows, no nn.Linear left.
    kept = [m for m in model.modules() if isinstance(m, BlocksLinear) and m is not model.lm_head]
    assert len(kept) == 2 * 4 and all(p.ggml_type.name == "F16" for m in kept for p in m.parts)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_the_float_modes_dequantize_a_method_s_weights(tiny_llama_dir, tmp_path, rows_method):
    expected = _quantized_copy(tiny_llama_dir, str(tmp_path / "q"))
    model = load_model(str(tmp_path / "q"), dtype=torch.bfloat16, show_progress=False).model
    w = model.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(w.float(), expected["model.layers.1.mlp.down_proj.weight"].bfloat16().float())


def test_quantization_flags_must_agree_with_the_checkpoint(tiny_llama_dir, tmp_path, rows_method):
    _quantized_copy(tiny_llama_dir, str(tmp_path / "q"))
    with pytest.raises(QuantConfigError, match="pagoda-test-rows.*--quantization int8"):
        load_model(str(tmp_path / "q"), quantization="int8", show_progress=False)


def test_an_unknown_quant_method_is_a_clear_error():
    with pytest.raises(QuantConfigError, match="quant_method 'bitsandbytes' is not supported"):
        method_for({"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(QuantConfigError, match="no quant_method"):
        method_for({"quantization_config": {"bits": 4}})
    assert method_for({}) is None
    assert method_for({"quantization_config": {"quant_method": "mxfp4"}}) is None   # GPT-OSS reads it itself


def test_own_block_types_are_registered_once_and_checked():
    from pagoda.model.layers.blocks import OWN_TYPES, block_format, own_type

    t = own_type(239, "PAGODA_TEST", 32, 20)
    try:
        assert own_type(239, "PAGODA_TEST", 32, 20) is t and int(t) == 239 and t.name == "PAGODA_TEST"
        assert block_format(t) == (32, 20) and block_format(12) == (256, 144)   # Q4_K
        with pytest.raises(ValueError, match="taken"):
            own_type(239, "OTHER", 32, 20)
        with pytest.raises(ValueError, match="below"):
            own_type(12, "Q4_K_AGAIN", 256, 144)
        with pytest.raises(ValueError, match="20 bytes per row do not hold 64"):
            BlockWeight(torch.zeros(2, 20, dtype=torch.uint8), t, 64)
        assert BlockWeight(torch.zeros(2, 40, dtype=torch.uint8), t, 64).in_features == 64
    finally:
        OWN_TYPES.pop(239)
