"""Weights kept in their file's format: GGUF blocks of any type, float16 and bfloat16.

The loader hands each projection's stored bytes (for a GGUF file, a view into a
memory map of it: nothing is copied or dequantized at load) to a ``BlockWeight``,
and the model's linear layers and embedding to ``BlocksLinear`` / ``BlocksEmbedding``.
pagoda's kernels (``gguf_linear``, ``gguf_dequantize`` in pagoda/csrc/gguf_blocks.cpp)
dequantize a few rows at a time in cache to the very float32 values of ggml's
reference dequantization and multiply in float32: the exact mode's numbers, with a
decode step reading 4.5-8.5 bits per weight instead of 32.

A format is one entry of ``BLOCK_TYPES`` (the ggml types the kernels read); a type
missing there is refused by the loader with the tensor's name. Pre-quantized HF formats
(GPTQ, AWQ, FP8, ...: pagoda/model/hf_quant) whose groups no ggml type holds exactly have
block layouts of pagoda's own: an ``OwnType`` each (``own_type``), ids past ggml's, read by
the same kernels.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pagoda.ops import cpu_kernels

_Q = GGMLQuantizationType
# The ggml types pagoda's kernels multiply in place (block layouts: gguf_blocks.cpp).
BLOCK_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ4_NL, _Q.IQ4_XS, _Q.MXFP4,
})
# torch dtypes stored as they are (HF checkpoints), as the ggml type of the same bits.
TORCH_DTYPE_TYPES = {torch.float32: _Q.F32, torch.float16: _Q.F16, torch.bfloat16: _Q.BF16}
_MADV_DONTNEED = 4  # Linux


class OwnType(int):
    """A block layout of pagoda's own: its id (past ggml's, the kernels' switch), name,
    weights per block and bytes per block. Made by ``own_type``."""

    name: str
    block: int
    nbytes: int

    def __new__(cls, value: int, name: str, block: int, nbytes: int) -> OwnType:
        obj = super().__new__(cls, value)
        obj.name, obj.block, obj.nbytes = name, block, nbytes
        return obj

    def __repr__(self) -> str:
        return f"<OwnType.{self.name}: {int(self)}>"


# id -> layout. Ids 200-219: integer groups (GPTQ / AWQ / compressed-tensors int);
# 220-239: float formats (FP8, NVFP4).
OWN_TYPES: dict[int, OwnType] = {}


def own_type(value: int, name: str, block: int, nbytes: int) -> OwnType:
    """Register (once) and return a block layout of pagoda's own."""
    if value < 200 or (value in OWN_TYPES and OWN_TYPES[value].name != name):
        raise ValueError(f"block type id {value} is taken or below pagoda's range")
    OWN_TYPES[value] = OWN_TYPES.get(value) or OwnType(value, name, block, nbytes)
    return OWN_TYPES[value]


# Every integer block type (Q2_K .. Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, MXFP4)
# repacked at load with 16 channels in the vector lanes (gguf_repack_x16; the same bytes
# per channel but Q3_K's, Q4_K's, Q5_K's and IQ4_XS's): the gguf mode's layout for their
# parts on AVX-512 VNNI CPUs (BlocksLinear.repack_for_lanes).
Q4_K_X16 = own_type(204, "Q4_K_X16", 256, 148)
Q6_K_X16 = own_type(205, "Q6_K_X16", 256, 210)
Q4_0_X16 = own_type(206, "Q4_0_X16", 32, 18)
Q4_1_X16 = own_type(207, "Q4_1_X16", 32, 20)
Q8_0_X16 = own_type(208, "Q8_0_X16", 32, 34)
IQ4_NL_X16 = own_type(209, "IQ4_NL_X16", 32, 18)
MXFP4_X16 = own_type(210, "MXFP4_X16", 32, 17)
Q5_K_X16 = own_type(211, "Q5_K_X16", 256, 180)
Q3_K_X16 = own_type(212, "Q3_K_X16", 256, 114)
Q2_K_X16 = own_type(213, "Q2_K_X16", 256, 84)
Q5_0_X16 = own_type(214, "Q5_0_X16", 32, 22)
Q5_1_X16 = own_type(215, "Q5_1_X16", 32, 24)
IQ4_XS_X16 = own_type(216, "IQ4_XS_X16", 256, 138)
LANES_TYPES = {_Q.Q2_K: Q2_K_X16, _Q.Q3_K: Q3_K_X16, _Q.Q4_K: Q4_K_X16, _Q.Q5_K: Q5_K_X16, _Q.Q6_K: Q6_K_X16,
               _Q.Q4_0: Q4_0_X16, _Q.Q4_1: Q4_1_X16, _Q.Q5_0: Q5_0_X16, _Q.Q5_1: Q5_1_X16, _Q.Q8_0: Q8_0_X16,
               _Q.IQ4_NL: IQ4_NL_X16, _Q.IQ4_XS: IQ4_XS_X16, _Q.MXFP4: MXFP4_X16}


def block_format(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type or one of pagoda's own."""
    if int(ggml_type) in OWN_TYPES:
        own = OWN_TYPES[int(ggml_type)]
        return own.block, own.nbytes
    return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _file_mapped(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one mapping of a file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= start and end <= hi:
                    return len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/")
    except OSError:
        pass
    return False


def release_checkpoint_pages(*tensors: torch.Tensor) -> None:
    """Let go of the resident pages of checkpoint tensors that were copied into blocks.

    safetensors hands out views into a private map of the file, and the map stays alive
    while any view of it does (a bfloat16 embedding kept as it is): without this, every
    page a repacked weight was read from would stay in RSS next to its blocks. Only pages
    wholly inside a tensor that lies in a file's map are dropped (MADV_DONTNEED: a later
    read faults them in again from the file, unchanged, since nothing writes them); a
    tensor in ordinary memory is left alone."""
    page = mmap.PAGESIZE
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        start = (t.data_ptr() + page - 1) & ~(page - 1)
        end = (t.data_ptr() + nbytes) & ~(page - 1)
        if end <= start or not t.is_contiguous() or not _file_mapped(t.data_ptr(), t.data_ptr() + nbytes):
            continue
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


class UnsupportedWeightType(ValueError):
    pass


@dataclass(frozen=True)
class BlockWeight:
    """A [out_features, in_features] weight as stored: ``data`` holds each output
    channel's row of blocks (uint8 [out_features, bytes per row]).

    ``input_order`` (int64 [in_features], a permutation), when set, says the blocks hold
    the input channels in another order: column j of the blocks is input channel
    ``input_order[j]`` (GPTQ's act-order groups, made contiguous). ``BlocksLinear``
    permutes x to match; ``dequantize`` returns the columns in the inputs' order."""

    data: torch.Tensor
    ggml_type: GGMLQuantizationType | OwnType
    in_features: int
    # ``data`` is a view into a read-only (never written) private map of the model file.
    file_mapped: bool = False
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ggml_type not in BLOCK_TYPES and not isinstance(self.ggml_type, OwnType):
            raise UnsupportedWeightType(f"ggml type {self.ggml_type.name} is not supported")
        block, nbytes = block_format(self.ggml_type)
        if self.in_features % block or self.data.dim() != 2 or self.data.dtype != torch.uint8:
            raise ValueError(f"{self.ggml_type.name} weight: expected uint8 rows of whole blocks of {block}")
        if self.data.shape[1] != self.in_features // block * nbytes:
            raise ValueError(f"{self.ggml_type.name} weight: {self.data.shape[1]} bytes per row "
                             f"do not hold {self.in_features} weights")
        order = self.input_order
        if order is not None and (order.dtype != torch.int64 or order.shape != (self.in_features,)
                                  or not torch.equal(order.sort().values, torch.arange(self.in_features))):
            raise ValueError(f"{self.ggml_type.name} weight: input_order must be a permutation of "
                             f"its {self.in_features} input channels (int64)")

    @classmethod
    def from_tensor(cls, weight: torch.Tensor) -> BlockWeight:
        """A float32/float16/bfloat16 [out, in] tensor kept in its own dtype (no copy
        when it is contiguous)."""
        if weight.dtype not in TORCH_DTYPE_TYPES or weight.dim() != 2:
            raise UnsupportedWeightType(f"cannot keep a {weight.dtype} tensor of {weight.dim()} dimensions as blocks")
        w = weight.detach().contiguous()
        return cls(w.view(torch.uint8).reshape(w.shape[0], -1), TORCH_DTYPE_TYPES[w.dtype], w.shape[1])

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def drop_pages(self) -> None:
        """Let go of the resident pages of a file-mapped weight (madvise DONTNEED): a
        later read faults them in again from the page cache, unchanged, since the map's
        pages are never written. The int8 / q4 modes call it on each layer they have
        converted, or the whole file would stay in their RSS. No-op otherwise."""
        if not self.file_mapped or self.data.numel() == 0:
            return
        page = mmap.PAGESIZE
        start = self.data.data_ptr() & ~(page - 1)
        length = self.data.data_ptr() + self.data.numel() - start
        if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a file-mapped weight")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out_features, in_features], or only the rows ``rows`` names: pagoda's
        kernels where they build, else the gguf library's reference dequantization (the
        same values)."""
        ops = cpu_kernels.kernels()
        if ops is not None:
            w = ops.gguf_dequantize(self.data, int(self.ggml_type), self.in_features, rows)
            return w if self.input_order is None else torch.empty_like(w).index_copy_(1, self.input_order, w)
        if isinstance(self.ggml_type, OwnType):
            raise RuntimeError(f"pagoda's CPU kernels are needed to read {self.ggml_type.name} blocks "
                               f"({cpu_kernels.error()})")
        from gguf import quants

        data = self.data if rows is None else self.data[rows]
        values = quants.dequantize(data.numpy(), self.ggml_type).reshape(data.shape[0], self.in_features)
        return torch.from_numpy(values.astype("float32", copy=False))


class BlocksLinear(nn.Module):
    """y = x W^T (+ bias) with W the concatenation of ``parts`` along the output
    channels (a stacked q/k/v or gate/up projection; the parts may differ in type)."""

    def __init__(self, parts: list[BlockWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("BlocksLinear needs one or more parts with the same in_features")
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} output channels")
        # The parts' bytes as buffers, so they count as the model's memory.
        for i, p in enumerate(self.parts):
            self.register_buffer(f"part{i}", p.data, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        # The gguf mode: activations quantized to int8 per group of 32, integer products
        # with the blocks (llama.cpp's arithmetic); needs every part block-quantized.
        self.int8_activations = False
        self._data = [p.data for p in self.parts]
        self._types = [int(p.ggml_type) for p in self.parts]
        # Input orders (BlockWeight.input_order): one shared by every part permutes x once;
        # parts in different orders multiply one at a time.
        orders = [p.input_order for p in self.parts]
        self._input_order = orders[0]
        self._split_orders = any(o is not None for o in orders) and not all(
            o is not None and torch.equal(o, orders[0]) for o in orders)
        self._ops = cpu_kernels.kernels()
        if self._ops is None:
            raise RuntimeError(f"pagoda's CPU kernels are needed for weights kept as blocks ({cpu_kernels.error()})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        matmul = self._ops.gguf_linear_int8 if self.int8_activations else self._ops.gguf_linear
        if self._split_orders:
            y = torch.cat([matmul(x2 if p.input_order is None else x2.index_select(1, p.input_order), [d], [t], None)
                           for p, d, t in zip(self.parts, self._data, self._types, strict=True)], dim=1)
            if self.bias is not None:
                y += self.bias
        else:
            if self._input_order is not None:
                x2 = x2.index_select(1, self._input_order)
            y = matmul(x2, self._data, self._types, self.bias)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def repack_for_lanes(self, q6k: bool = True) -> int:
        """Repack the parts of the ``LANES_TYPES`` (those of a multiple of 16 channels,
        inputs in order) into their repacked layouts, 16 channels side by side in the vector
        lanes: the gguf mode's few-row and prompt products on AVX-512 VNNI CPUs then run
        without decoding blocks or reducing sums across lanes (Q4_K / Q6_K: the same integers
        and float32 operations as their plain kernels, the same bits; Q5_K / Q3_K, Q2_K: Q4_K's /
        Q6_K's kernels, x in groups of 256 as llama.cpp's Q8_K; the 32-weight types: each
        block's integer sum whole, then one float32 step a block; every type the same bits
        for every step size). Call only with ``int8_activations`` set (the exact mode does
        not read the layout). The file's pages the parts were read from are let go.
        ``q6k=False`` leaves Q6_K parts as they are. Returns the parts repacked."""
        if not self.int8_activations:
            raise RuntimeError("repacked weights multiply in the gguf mode (int8 activations) only")
        done = 0
        for i, p in enumerate(self.parts):
            lanes = LANES_TYPES.get(p.ggml_type)
            if lanes is None or (lanes is Q6_K_X16 and not q6k) or p.input_order is not None or p.out_features % 16:
                continue
            packed = BlockWeight(self._ops.gguf_repack_x16(p.data, int(p.ggml_type), p.in_features), lanes, p.in_features)
            p.drop_pages()
            self.parts[i] = packed
            self.register_buffer(f"part{i}", packed.data, persistent=False)
            done += 1
        self._data = [p.data for p in self.parts]
        self._types = [int(p.ggml_type) for p in self.parts]
        return done

    @property
    def permutes_inputs(self) -> bool:
        """Whether a part holds its input channels in another order (``input_order``):
        kernels called with the parts' bytes directly must permute x themselves."""
        return any(p.input_order is not None for p in self.parts)

    @property
    def quantized_parts(self) -> bool:
        """Whether every part is block-quantized (not F32/F16/BF16)."""
        return all(p.ggml_type not in TORCH_DTYPE_TYPES.values() for p in self.parts)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features] (a transient copy)."""
        return torch.cat([p.dequantize() for p in self.parts]) if len(self.parts) > 1 else self.parts[0].dequantize()

    def dequantized_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the float32 weight, dequantized from the parts that hold them."""
        out, start = [], 0
        for p in self.parts:
            a, b = max(r0, start), min(r1, start + p.out_features)
            if a < b:
                out.append(p.dequantize(torch.arange(a - start, b - start)))
            start += p.out_features
        return out[0] if len(out) == 1 else torch.cat(out)

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(p.ggml_type.name for p in self.parts)
        act = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, kept as {kinds}{act}"


class BlocksEmbedding(nn.Module):
    """A token embedding kept as blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.blocks = weight
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.register_buffer("data", weight.data, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The kernel checks every id against the row count.
        return self.blocks.dequantize(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kept as {self.blocks.ggml_type.name}"
