"""A small, fast reader for GGUF model files.

`gguf.GGUFReader` builds a numpy view for every field and array element, which takes
seconds for a vocabulary of ~50k strings. We only need plain Python values, so we walk
the header once with `struct` over a read-only memory map and keep tensor data on disk
until a tensor is asked for.

Layout (all little-endian, GGUF v2/v3):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv    x (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data section.
A string is a u64 byte length followed by UTF-8 bytes; an array is a u32 element type,
a u64 count and the elements.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.constants import GGUFValueType

__all__ = ["GGUFError", "GGUFTensorInfo", "GGUFFile", "SUPPORTED_TYPES"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# llama.cpp's ggml tensors have at most 4 dimensions; allow a little slack but refuse nonsense.
_MAX_DIMS = 8

_Q = GGMLQuantizationType
# Types stored as plain numbers: we reinterpret the bytes ourselves.
_PLAIN_DTYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    _Q.F32: np.dtype("<f4"),
    _Q.F16: np.dtype("<f2"),
}
# Block-quantized types (and BF16, which numpy has no dtype for) go through gguf.quants.
_QUANTIZED_TYPES = frozenset(
    {_Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.MXFP4}
)
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_PLAIN_DTYPES) | _QUANTIZED_TYPES

# Fixed-size scalar value types: struct format and numpy dtype (for fast array decoding).
_SCALAR_FORMATS: dict[int, tuple[str, np.dtype[Any]]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
    GGUFValueType.BOOL: ("<?", np.dtype("<u1")),
}


class GGUFError(ValueError):
    """The file is not a GGUF file we can read: corrupt, truncated or unsupported."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: outermost dimension first
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reader over a buffer; every read is bounds-checked."""

    def __init__(self, buf: memoryview, fail: Callable[[str], GGUFError]) -> None:
        self.buf = buf
        self.pos = 0
        self.fail = fail

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated while reading {what} at byte {self.pos}")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        # Some converters write token bytes that are not valid UTF-8 on their own; replace rather than refuse.
        return str(raw, "utf-8", "replace")

    def _strings(self, count: int, what: str) -> list[str]:
        # string() inlined: a tokenizer's vocabulary and merges are ~100k strings.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise self.fail(f"truncated while reading length of {what} at byte {pos}")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise self.fail(f"truncated while reading {what} at byte {pos}")
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def array(self, what: str) -> list[Any]:
        elem_type = self.u32(f"element type of {what}")
        count = self.u64(f"length of {what}")
        if elem_type in _SCALAR_FORMATS:
            dtype = _SCALAR_FORMATS[elem_type][1]
            self._need(count * dtype.itemsize, what)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if elem_type == GGUFValueType.BOOL:
                return [bool(v) for v in values]
            return values.tolist()
        if elem_type == GGUFValueType.STRING:
            # Every string needs at least its 8-byte length; reject absurd counts before looping.
            self._need(count * 8, what)
            return self._strings(count, what)
        if elem_type == GGUFValueType.ARRAY:
            self._need(count * 12, what)
            return [self.array(what) for _ in range(count)]
        raise self.fail(f"unknown array element type {elem_type} in {what}")

    def value(self, value_type: int, what: str) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type == GGUFValueType.ARRAY:
            return self.array(what)
        if value_type == GGUFValueType.BOOL:
            return bool(self.scalar("<B", what))
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type][0], what)
        raise self.fail(f"unknown value type {value_type} for {what}")


class GGUFFile:
    """Metadata and lazily-loaded tensors of one GGUF file."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int  # start of the tensor data section
    alignment: int

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        size = os.stat(self.path).st_size  # raises FileNotFoundError for a missing file
        if size == 0:
            raise self._error("file is empty")
        self._data: np.memmap[Any, np.dtype[np.uint8]] | None = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._cow: np.memmap[Any, np.dtype[np.uint8]] | None = None  # for mapped_rows
        view = memoryview(self._data)
        try:
            self._parse(_Cursor(view, self._error), size)
        finally:
            # A live export would keep the mapping from ever being closed.
            view.release()

    def _error(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    def _parse(self, cur: _Cursor, size: int) -> None:
        if size < 4 or bytes(cur.buf[:4]) != _MAGIC:
            raise self._error(f"not a GGUF file (magic {bytes(cur.buf[:4])!r}, expected {_MAGIC!r})")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            if self.version & 0xFFFF == 0 and self.version != 0:
                raise self._error("big-endian GGUF files are not supported")
            raise self._error(f"unsupported GGUF version {self.version} (need 2 or 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")

        self.metadata = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            value_type = cur.u32(f"value type of {key!r}")
            if key in self.metadata:
                raise self._error(f"duplicate metadata key {key!r}")
            self.metadata[key] = cur.value(value_type, f"metadata {key!r}")

        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self._error(f"general.alignment must be a positive power of two, got {alignment!r}")
        self.alignment = alignment

        raw_infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        # The data section starts at the next multiple of the alignment after the tensor infos.
        self.data_offset = -(-cur.pos // alignment) * alignment

        self.tensors = {}
        for name, shape, ggml_type, rel_offset, nbytes in raw_infos:
            if name in self.tensors:
                raise self._error(f"duplicate tensor {name!r}")
            if rel_offset % alignment:
                raise self._error(f"tensor {name!r} offset {rel_offset} is not aligned to {alignment}")
            offset = self.data_offset + rel_offset
            if offset + nbytes > size:
                raise self._error(
                    f"tensor {name!r} data ({nbytes} bytes at {offset}) extends past end of file ({size} bytes)"
                )
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)

    def _read_tensor_info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
        name = cur.string("tensor name")
        n_dims = cur.u32(f"dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise self._error(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
        raw_type = cur.u32(f"type of tensor {name!r}")
        rel_offset = cur.u64(f"offset of tensor {name!r}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise self._error(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        # ne[0] (the innermost, contiguous dimension) must hold whole quantization blocks.
        if dims and dims[0] % block_size:
            raise self._error(
                f"tensor {name!r} row length {dims[0]} is not a multiple of "
                f"the {ggml_type.name} block size {block_size}"
            )
        nbytes = math.prod(dims) // block_size * type_size
        # GGUF lists dimensions innermost-first; PyTorch wants outermost-first.
        return name, tuple(reversed(dims)), ggml_type, rel_offset, nbytes

    def raw_bytes(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The tensor's bytes as stored (a read-only view into the file)."""
        info = self._info(name)
        if self._data is None:
            raise ValueError(f"{self.path}: file is closed")
        return self._data[info.offset : info.offset + info.nbytes]

    def mapped_rows(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The tensor's stored bytes as [rows, bytes per row] (a row: the innermost
        dimension's blocks), without copying: a view into a copy-on-write map of the file,
        so only the pages a kernel reads become resident, and they are the page cache's
        own. The map lives as long as any array (or tensor) taken from it."""
        info = self._info(name)
        if self._cow is None:
            self._cow = np.memmap(self.path, dtype=np.uint8, mode="c")
        return np.asarray(self._cow[info.offset : info.offset + info.nbytes].reshape(self._row_shape(info)))

    def read_rows(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Like ``mapped_rows``, but a private, writable copy read with pread (for a tensor
        whose rows the loader reorders; no page of the file's maps becomes resident)."""
        info = self._info(name)
        with open(self.path, "rb") as f:
            raw = os.pread(f.fileno(), info.nbytes, info.offset)
        return np.frombuffer(bytearray(raw), dtype=np.uint8).reshape(self._row_shape(info))

    @staticmethod
    def _row_shape(info: GGUFTensorInfo) -> tuple[int, int]:
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = (info.shape[-1] if info.shape else 1) // block_size * type_size
        return (info.nbytes // row_bytes if row_bytes else 0), row_bytes

    def dequantize(self, name: str) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The tensor dequantized into a new float32 array of its own memory, in PyTorch
        dimension order."""
        info = self._info(name)
        if info.ggml_type not in SUPPORTED_TYPES:
            raise self._error(f"tensor {name!r} has unsupported type {info.ggml_type.name}")
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype=np.float32)
        # A plain ndarray view: numpy math on np.memmap slices would keep wrapping results as memmaps.
        raw = np.asarray(self.raw_bytes(name))
        if info.ggml_type in _PLAIN_DTYPES:
            # Copy out of the read-only mapping so the array owns writable memory.
            values = np.array(raw.view(_PLAIN_DTYPES[info.ggml_type]), dtype=np.float32)
        else:
            block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
            row_bytes = info.shape[-1] // block_size * type_size
            values = gguf.quants.dequantize(raw.reshape(-1, row_bytes), info.ggml_type)
        return values.reshape(info.shape)

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def close(self) -> None:
        """Drop the memory maps; arrays and tensors taken from them stay valid (a view keeps its map)."""
        self._data = None
        self._cow = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)})"
