"""AWQ checkpoints (GEMM packing: 8 output channels per int32 in AWQ's interleaved
order): tiny Llama / Qwen3 models quantized and packed by the layout's definition, the
packing read back by a word-by-word unpacker; pagoda serves the float32 model of the
dequantized weights."""

from __future__ import annotations

import numpy as np
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

# Nibble k of a word holds output channel ORDER[k] of its 8 (AutoAWQ's pack order).
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit -> int32 [rows, cols / 8], nibble k = column 8j + ORDER[k]."""
    v = values.numpy().reshape(values.shape[0], -1, 8)[:, :, ORDER].reshape(values.shape[0], -1)
    return torch.from_numpy(pack_words(v, 4))


def unpack_word_by_word(packed: torch.Tensor) -> np.ndarray:
    """The independent reader: every word, every nibble, by the definition."""
    p = packed.numpy().view(np.uint32)
    out = np.zeros((p.shape[0], p.shape[1] * 8), dtype=np.int64)
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            word = int(p[i, j])
            for k in range(8):
                out[i, 8 * j + ORDER[k]] = (word >> (4 * k)) & 15
    return out


def awq_tensors(prefix: str, w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g_idx = groups_of(w.shape[1], group_size)
    q, zeros, scales = quantize(w, 4, g_idx, sym=False)
    tensors = {f"{prefix}.qweight": pack_awq(q.t().contiguous()), f"{prefix}.qzeros": pack_awq(zeros.t().contiguous()),
               f"{prefix}.scales": scales.t().contiguous()}
    if prefix.endswith("layers.0.self_attn.q_proj"):   # one layer read back nibble by nibble (slow in Python)
        assert np.array_equal(unpack_word_by_word(tensors[f"{prefix}.qweight"]), q.t().numpy())
        assert np.array_equal(unpack_word_by_word(tensors[f"{prefix}.qzeros"]), zeros.t().numpy())
    return tensors, dequantize(q, zeros, scales, g_idx)


def _awq_dir(src, tmp_path, group_size=32, entry=None):
    entry = entry or {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                      "version": "gemm"}
    meant = write_quantized(src, str(tmp_path / "q"), entry, lambda p, w: awq_tensors(p, w, group_size))
    return str(tmp_path / "q"), reference_copy(src, str(tmp_path / "ref"), meant)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pagoda_serves_the_dequantized_awq_model(family, tmp_path, tiny_llama_dir, tiny_qwen3_dir):
    src = tiny_llama_dir if family == "llama" else tiny_qwen3_dir
    qdir, ref = _awq_dir(src, tmp_path, group_size=32 if family == "llama" else 64)
    assert_serves_its_dequantized_model(qdir, ref, {"PAGODA_Q4Z"})


def test_autoawq_config_names_are_read(tiny_llama_dir, tmp_path):
    """AutoAWQ's own quant_config spells bits and group size w_bit / q_group_size, version GEMM."""
    entry = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}
    qdir, ref = _awq_dir(tiny_llama_dir, tmp_path, group_size=64, entry=entry)
    got = load_model(qdir, show_progress=False).model.model.layers[0].mlp.gate_up_proj.dequantized()
    assert torch.equal(got, load_model(ref, show_progress=False).model.model.layers[0].mlp.gate_up_proj.weight)


def test_errors_name_the_field_or_tensor(tiny_llama_dir, tmp_path):
    with pytest.raises(QuantConfigError, match="version 'gemv' is not supported"):
        method_for({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}})
    with pytest.raises(QuantConfigError, match="bits 8 is not supported for awq"):
        method_for({"quantization_config": {"quant_method": "awq", "bits": 8, "version": "gemm"}})
    method = method_for({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}})
    tensors, _ = awq_tensors("l", torch.randn(16, 64), 32)
    with pytest.raises(QuantConfigError, match="l.scales: expected float \\[2, 16\\]"):
        list(method.tensors("l.qweight", tensors["l.qweight"], lambda n: tensors[n][:1] if n == "l.scales" else tensors[n]))
    with pytest.raises(QuantConfigError, match="l.qweight: its companion tensor l.qzeros is missing"):
        from pagoda.hub.paths import ModelLoadError

        def reader(n):
            if n == "l.qzeros":
                raise ModelLoadError("no tensor")
            return tensors[n]
        list(method.tensors("l.qweight", tensors["l.qweight"], reader))
    with pytest.raises(QuantConfigError, match="'awq'.*--quantization q4"):
        method.check_quantization("q4")
