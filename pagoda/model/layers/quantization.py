"""Quantized linear layers, chosen by the loader (the model code knows nothing of them).

``int8``: weights quantized once, symmetric per output channel; each step's
activations quantized on the fly, symmetric per token (per row); int8 x int8
products with int32 accumulation, rescaled by (token scale x channel scale).
Steps of up to ``INT8_SMALL_STEP_ROWS`` tokens (small decode batches, bound by
weight bytes) run pagoda's int8 GEMV, larger ones ``torch._int_mm``; integer
sums are exact, so both give a token the same numbers.

A few input channels per layer (the 16 with the largest activations on a
calibration text, chosen at load time) stay in float32: with them inside the
per-token scale every other channel is rounded coarsely (LLM.int8()'s outlier
decomposition; ``Int8Linear``).

Per-token scales matter for a serving engine: with one scale per batch (what
FBGEMM's dynamic linear does) a request's numbers would depend on which other
requests share its step. Per token, a request gets the same tokens whatever the
batch, whatever its prefix-cache hits, as in the exact mode.

``q4``: weights in 4-bit groups of 32 along the input dimension, each group
with its own scale and minimum (w = d*q + m, q in 0..15: GGUF's Q4_1 scheme).
A Q4_1 GGUF's weights come back as the file's own 4-bit values (a group's
minimum and maximum are recovered from the dequantized tensor). Activations are
quantized to int8 per token and group of 32 (llama.cpp's Q8_1) and the products
run as integer dot products (pagoda's ``q4_linear``): 5 bits read per weight, so
single-stream decode runs near memory bandwidth. Every step size runs the same
kernel, so a request's numbers do not depend on its batch, chunking or prefix-cache
hits. Needs pagoda's C++ kernels; without them it falls back to dequantizing in
torch (float activations; correct, slow). The LM head stays 8-bit (int8 weights per
channel, activations as above: ``Int8WeightLinear``), as a GGUF's output weights do.

``bf16`` (``--dtype bfloat16`` on the CPU, OpenVINO's default precision on CPUs with
bf16 units): weights rounded to bfloat16 once and packed for oneDNN; each step's
activations rounded to bfloat16 at every projection's input, the products summed in
float32 by oneDNN (AMX tiles where the CPU has amx_bf16, AVX512_BF16 dot products on
Zen 4 and Sapphire Rapids without AMX, converted to float32 elsewhere) and the result
rounded to bfloat16 (``Bf16Linear``). Norms, residuals, RoPE and attention stay
float32. oneDNN computes a row the same way whatever the number of rows (a test
checks it), so a request's numbers do not depend on its batch.

Exact mode (``none``) on the CPU keeps a GGUF's weights in their blocks
(``pagoda.model.layers.blocks``); the quantized modes here start from those blocks,
dequantized one layer at a time.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from tqdm import tqdm

from pagoda.config import QUANTIZATION_MODES
from pagoda.host import release_freed_memory
from pagoda.model.layers.blocks import BlocksLinear, BlockWeight
from pagoda.model.layers.decoder import SparseMoeBlock
from pagoda.model.layers.parallel import Collectives, RowParallelLinear, checkpoint_name
from pagoda.ops import cpu_kernels

logger = logging.getLogger(__name__)

Q4_GROUP = 32
# int8 mode: up to this many tokens per step run pagoda's int8 GEMV (bound by weight
# bytes); more run torch._int_mm. Both are exact integer products. Measured (20 layers
# of 3072x576, one thread, GEMV vs _int_mm): M=1 1.6 vs ~5 ms, M=6 4.9 vs 5.5 ms,
# M=8 6.2 vs 5.9 ms, M=16 11.7 vs 7.5 ms.
INT8_SMALL_STEP_ROWS = 6


def int8_small_step_rows() -> int:
    """Steps of up to this many rows run pagoda's int8 GEMV: INT8_SMALL_STEP_ROWS where
    the CPU has VNNI (oneDNN's int8 GEMM behind torch._int_mm is fast there), every step
    elsewhere: on an AVX2-only Zen 3, _int_mm took 174 ms for 128 x 576 x 1536 against
    3.1 ms for pagoda's GEMV (a 128-token prompt of the bundled model: TTFT 13.7 s).
    The sums are exact either way, so the choice changes no result."""
    flags = cpu_kernels.cpu_flags()
    return INT8_SMALL_STEP_ROWS if flags & {"avx512_vnni", "avx_vnni", "amx_int8"} else 1 << 62


# Rows of a weight quantized at a time (the float temporaries of one block).
QUANTIZE_ROWS = 1024


def q4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed [N, K/2] uint8, scales [N, K/32] fp16, mins [N, K/32] fp16).

    Byte j of a group holds weight j in its low nibble and weight j + 16 in its
    high nibble (ggml's order). Scales and minimums are fp16, as in Q4_1; the
    4-bit values are chosen against the rounded fp16 scale and minimum."""
    n, k = weight.shape
    if k % Q4_GROUP:
        raise ValueError(f"q4 needs in_features divisible by {Q4_GROUP}, got {k}")
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(n, k // Q4_GROUP, dtype=torch.float16)
    mins = torch.empty(n, k // Q4_GROUP, dtype=torch.float16)
    scratch = torch.empty(min(n, QUANTIZE_ROWS), k // Q4_GROUP, Q4_GROUP)  # as in int8_per_channel
    for r in range(0, n, QUANTIZE_ROWS):  # a block of rows at a time, not several weights' worth
        groups = weight[r : r + QUANTIZE_ROWS].float().reshape(-1, k // Q4_GROUP, Q4_GROUP)
        lo = groups.amin(-1).half()
        scale = ((groups.amax(-1) - lo.float()) / 15.0).half()
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
        t = torch.sub(groups, lo.float()[..., None], out=scratch[: groups.shape[0]])
        q = t.div_(safe[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        packed[r : r + QUANTIZE_ROWS] = (q[..., :16] | (q[..., 16:] << 4)).reshape(-1, k // 2)
        scales[r : r + QUANTIZE_ROWS] = scale
        mins[r : r + QUANTIZE_ROWS] = lo
    return packed, scales, mins


def _round_rows(w: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """w / scale per row, rounded and clamped to int8's symmetric range, into ``out``
    (whole numbers in float32: their conversion to int8 is exact)."""
    return torch.div(w, scales[:, None], out=out).round_().clamp_(-127, 127)


def int8_per_channel(weight: torch.Tensor, comm: Collectives | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N]): each output channel rounded
    to int8 of scale max|w| / 127, a block of rows at a time. ``comm``: the tensor-parallel
    ranks that hold the rest of each row (a row-parallel layer's columns): the max over
    the whole row, so that every rank's part is rounded as one process rounds it."""
    n, k = weight.shape
    qweight = torch.empty(n, k, dtype=torch.int8)
    amax = torch.empty(n, dtype=torch.float32)
    # One scratch block for every step (fresh temporaries per block would be freed into
    # malloc's heap, which pagoda lets grow for its steps: gigabytes kept after an 8B load).
    scratch = torch.empty(min(n, QUANTIZE_ROWS), k)
    for r in range(0, n, QUANTIZE_ROWS):
        w = weight[r : r + QUANTIZE_ROWS].float()
        amax[r : r + QUANTIZE_ROWS] = torch.abs(w, out=scratch[: w.shape[0]]).amax(dim=1)
    if comm is not None:
        comm.all_reduce_max(amax)
    scales = (amax / 127.0).clamp(min=1e-12)
    for r in range(0, n, QUANTIZE_ROWS):
        w = weight[r : r + QUANTIZE_ROWS].float()
        qweight[r : r + QUANTIZE_ROWS].copy_(_round_rows(w, scales[r : r + QUANTIZE_ROWS], scratch[: w.shape[0]]))
    return qweight, scales


def _float_rows(layer: nn.Module):
    """rows(r0, r1): float32 rows [r1 - r0, in_features] of a layer's weight: a slice of an
    ``nn.Linear``'s, or a ``BlocksLinear``'s dequantized afresh (no copy of the whole
    weight)."""
    if isinstance(layer, BlocksLinear):
        return layer.dequantized_rows
    return lambda r0, r1: layer.weight.detach()[r0:r1].float()


def int8_with_outliers(layer: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weights [out, in], scales [out], outlier weights [len(idx), out]) of a float
    ``nn.Linear`` or a ``BlocksLinear``, in one pass over blocks of rows: the input
    columns ``idx`` kept in float32 (transposed), set to zero, then each row rounded to int8
    of scale max|w| / 127, int8_per_channel's arithmetic. A block of rows at a time: an 8B
    model's LM head took two float32 copies of 0.8 GB at load (its peak RSS 1.5 GiB above
    the steady state)."""
    n, k = layer.out_features, layer.in_features
    rows = _float_rows(layer)
    qweight = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    outlier_weight = torch.empty(idx.numel(), n)
    # Scratch blocks reused for every block of rows (as in int8_per_channel).
    block, scratch = torch.empty(min(n, QUANTIZE_ROWS), k), torch.empty(min(n, QUANTIZE_ROWS), k)
    for r in range(0, n, QUANTIZE_ROWS):
        w = block[: min(QUANTIZE_ROWS, n - r)]
        w.copy_(rows(r, r + w.shape[0]))
        outlier_weight[:, r : r + w.shape[0]] = w[:, idx].t()
        w.index_fill_(1, idx, 0.0)
        t = scratch[: w.shape[0]]
        s = (torch.abs(w, out=t).amax(dim=1) / 127.0).clamp(min=1e-12)
        scales[r : r + w.shape[0]] = s
        qweight[r : r + w.shape[0]].copy_(_round_rows(w, s, t))
    return qweight, scales, outlier_weight


def q4_dequantize(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The plain-torch inverse of ``q4_quantize`` (reference and fallback)."""
    n, half = packed.shape
    g = packed.reshape(n, half // 16, 16)
    q = torch.cat((g & 0x0F, g >> 4), dim=-1).float()
    return (q * scales.float()[..., None] + mins.float()[..., None]).reshape(n, half * 2)


class Q4Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed, scales, mins = q4_quantize(linear.weight.detach())
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self._ops = cpu_kernels.kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None and x.dim() == 2 and x.dtype == torch.float32:
            # The model's own calls (flat batches of float32 rows), with no reshaping.
            return self._ops.q4_linear(x, self.qweight, self.scales, self.mins, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if self._ops is None:
            y = torch.nn.functional.linear(x2, q4_dequantize(self.qweight, self.scales, self.mins), self.bias)
        else:
            y = self._ops.q4_linear(x2, self.qweight, self.scales, self.mins, self.bias)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {Q4_GROUP}"


class Int8Linear(nn.Module):
    """``int8`` mode: int8 weights per output channel, activations quantized per
    token; the int8 x int8 products run on pagoda's GEMV for steps of up to
    ``INT8_SMALL_STEP_ROWS`` tokens and on torch._int_mm above. Integer sums are
    exact, so a token's result does not depend on its step's size.

    ``outliers``: input channels kept in float32 (LLM.int8()'s decomposition). A
    few channels carry activations far larger than the rest; with them inside the
    per-token scale, every other channel of the token is rounded coarsely. Measured
    on the default model: perplexity +1.5 % to +5.4 % over fp32 without, within
    about +-1.5 % with the 16 largest channels (per layer, from ``calibrate``) in
    float (docs/benchmarks.md)."""

    def __init__(self, linear: nn.Linear | BlocksLinear | None, outliers: torch.Tensor | None = None, *,
                 int8: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
                 split: Collectives | None = None) -> None:
        """From a float ``linear`` or a ``BlocksLinear`` (quantized here a block of rows at
        a time, ``outliers`` kept in float), or from
        ``int8`` = (int8 weights [out, in], float32 scales [out], bias or None) as a W8A8
        checkpoint stores them (``Int8Linear.from_int8``: used as they are).

        ``split``: the tensor-parallel ranks holding the layer's other input channels (a
        row-parallel layer's local part): each channel's weight scale and each token's
        activation scale are the max over every rank's channels (an all-reduce at load,
        and one of [tokens] floats per step), so each rank rounds its part as one process
        rounds the whole layer and the ranks' sums add up to its result."""
        super().__init__()
        self.split = split
        if int8 is not None:
            qweight, scale, bias = int8
            idx = torch.empty(0, dtype=torch.long)
            outlier_weight = torch.empty(0, qweight.shape[0])
        else:
            idx = torch.empty(0, dtype=torch.long) if outliers is None else outliers.to(torch.long).sort().values
            if split is None:
                # [out, in] (_int_mm multiplies by its transposed view at the same speed); the
                # outlier columns [k, out], transposed so each is a contiguous row.
                qweight, scale, outlier_weight = int8_with_outliers(linear, idx)
            else:   # each channel's scale is the max over every rank's part: two passes
                weight = linear.weight.detach().float().clone()
                outlier_weight = weight[:, idx].t().contiguous()
                weight[:, idx] = 0.0
                qweight, scale = int8_per_channel(weight, split)
            bias = linear.bias.detach().float() if linear.bias is not None else None
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("outlier_idx", idx)
        self.register_buffer("outlier_weight", outlier_weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        self._ops = cpu_kernels.kernels() if self.in_features % 16 == 0 else None
        self._small_rows = int8_small_step_rows()
        # On a CPU with AVX-512 VNNI every step's product runs on it, from the weights in
        # its tile layout, packed once here; the plain layout is then dropped (one copy of
        # the int8 weights, not two: an 8B model's 7 GB). ``int8_weight()`` unpacks it.
        vnni = self._ops is not None and cpu_kernels.has_avx512_vnni()
        packed = self._ops.int8_pack_vnni(self.qweight) if vnni else (None, None)
        self.register_buffer("vnni_weight", packed[0], persistent=False)
        self.register_buffer("vnni_comp", packed[1], persistent=False)
        if vnni:
            self.qweight = torch.empty(0, dtype=torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        token_amax = None
        if self.split is not None:   # max |x| of each token's inliers over every rank's channels
            token_amax = self.split.all_reduce_max(x2.abs().index_fill_(1, self.outlier_idx, 0.0).amax(dim=1))
        if self._ops is not None:
            # The same operations as below, in one C++ call (a decode step's linear
            # layers were mostly per-op overhead).
            y = self._ops.int8_linear(x2, self.qweight, self.weight_scale, self.bias, self._small_rows,
                                      self.outlier_idx, self.outlier_weight, self.vnni_weight, self.vnni_comp,
                                      token_amax)
            return y.view(*shape[:-1], self.out_features).to(x.dtype)
        inliers = x2.index_fill(1, self.outlier_idx, 0.0)
        amax = inliers.abs().amax(dim=1) if token_amax is None else token_amax
        x_scale = amax[:, None].clamp(min=1e-12) / 127.0
        xq = torch.round(inliers / x_scale).to(torch.int8)
        acc = torch._int_mm(xq, self.int8_weight().t())
        y = acc.float() * (x_scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        y = y + x2[:, self.outlier_idx] @ self.outlier_weight
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """A W8A8 checkpoint's layer: int8 weights [out, in] and float32 scales [out] per
        output channel, its activations quantized per token as the checkpoint was made for
        (no float channels)."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != (qweight.shape[0],):
            raise ValueError("expected int8 weights [out, in] and one scale per output channel")
        return cls(None, int8=(qweight.contiguous(), scale.float().contiguous(),
                               None if bias is None else bias.float().contiguous()))

    def int8_weight(self) -> torch.Tensor:
        """The int8 weights [out, in] (unpacked from the VNNI tile layout where that is the
        copy kept: [N/64][K/4][64][4])."""
        if self.vnni_weight is None:
            return self.qweight
        n, k = self.out_features, self.in_features
        tiles = self.vnni_weight.view(-1, k // 4, 64, 4)
        return tiles.permute(0, 2, 1, 3).reshape(-1, k)[:n]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, "
                f"{self.outlier_idx.numel()} float input channels")


def bf16_gemm_path() -> str:
    """Where the bf16 mode's products run here:

    - ``onednn``: where the CPU has bf16 units (AMX, AVX512_BF16) and oneDNN may use them:
      oneDNN with each weight packed once (instead of reordered at every call; measured:
      a 1536 x 576 product at one row 94 -> 45 us, the 49152 x 576 LM head 6.5 -> 3.9 ms);
      a row's numbers are the same in steps of any size from two rows, and its one-row
      product (a matrix-vector kernel) may round a sum's last bfloat16 bit the other way
      (measured: 6 of 100 random 1536 x 576 cases; padding to two rows would cost ~20 %).
      With AMX tiles it runs steps of up to 32 rows and longer ones on two kernels instead,
      each the same at every step size, the two a bfloat16 rounding apart in a few elements
      (an AMX Xeon: 1-3 of 1536 x m); padding small steps to 33 rows cost 1.7x at one row and
      cutting large ones into 32-row pieces 1.5-2.8x, so neither is done;
    - ``pagoda``: elsewhere, pagoda's kernel for bfloat16 weights (float32 sums; the exact
      mode's: one order for steps of up to 16 rows, BLAS's above). oneDNN without bf16
      units converts, and its one-row product then sums in another order than its 2-15
      row ones (measured with ONEDNN_MAX_CPU_ISA=AVX512_CORE): a decode step's numbers
      would depend on how many requests share it;
    - ``torch``: without pagoda's kernels, torch's bf16 GEMM."""
    if not cpu_kernels.onednn_units("bf16").startswith("float32") and torch.backends.mkldnn.is_available():
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return "onednn"
        except (AttributeError, RuntimeError):  # a torch without the query
            pass
    return "pagoda" if cpu_kernels.kernels() is not None else "torch"


class Bf16Linear(nn.Module):
    """``bf16`` mode: bfloat16 weights x activations rounded to bfloat16, summed in float32
    (``bf16_gemm_path``), the result rounded to bfloat16 and returned as float32 (the
    bias, if any, added in float32).

    ``partial``: a row-parallel layer's local part (tensor parallelism): its float32 sums
    are returned unrounded, on pagoda's kernel (or torch in float32), for the layer to round
    the ranks' total as one process rounds its sum (``RowParallelLinear.output_dtype``)."""

    def __init__(self, linear: nn.Linear, path: str | None = None, partial: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.partial = partial
        self.path = path or bf16_gemm_path()
        if partial:   # (oneDNN's bfloat16 products return bfloat16)
            self.path = "pagoda" if cpu_kernels.kernels() is not None else "torch"
        weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        # One copy of the weight: packed for oneDNN, in pagoda's block layer, or as it is.
        self.blocks = BlocksLinear([BlockWeight.from_tensor(weight)]) if self.path == "pagoda" else None
        if self.path == "onednn":
            weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.register_buffer("weight", None if self.blocks is not None else weight, persistent=False)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.partial:
            xf = xb.float()
            y = self.blocks(xf) if self.blocks is not None else torch.nn.functional.linear(xf, self.weight.float())
        elif self.path == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(xb, self.weight, None, "none", [], "").float()
        elif self.path == "pagoda":
            y = self.blocks(xb).float()  # float32 sums, returned in x's dtype: rounded to bfloat16
        else:
            y = torch.nn.functional.linear(xb, self.weight).float()
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        part = ", float32 partial sums" if self.partial else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 on {self.path}{part}"


class Int8WeightLinear(nn.Module):
    """int8 weights per output channel, activations in int8 groups of 32 per token
    (pagoda's ``q8_linear``): q4 mode's LM head, one byte read per weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8WeightLinear takes a linear layer without bias")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        qweight, scale = int8_per_channel(linear.weight.detach())
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)
        self._ops = cpu_kernels.kernels() if self.in_features % Q4_GROUP == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if self._ops is None:
            y = torch.nn.functional.linear(x2, self.qweight.float() * self.weight_scale[:, None])
        else:
            y = self._ops.q8_linear(x2, self.qweight, self.weight_scale)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, float activations"


# int8 mode: input channels per linear layer kept in float32 (at most a quarter of them).
INT8_OUTLIER_CHANNELS = 16
# The text whose activations choose them (any ordinary text will do; not a test text).
CALIBRATION_TEXT = (
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make glucose and oxygen. It takes place mainly in the leaves, inside small structures "
    "called chloroplasts.\n\nQ: What is 17 times 3?\nA: 17 times 3 is 51.\n\n"
    "def greet(name):\n    return f\"Hello, {name}!\"\n\n"
    "The meeting has been moved to Thursday at 10 am; please bring the quarterly report and "
    "your notes from the last review."
)


def _range_hook(ranges: dict[str, torch.Tensor], name: str):
    """A forward hook keeping the largest |input| each input channel of layer ``name`` sees."""
    def hook(module, args, output):
        seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
        ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen
    return hook


def calibrate(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Largest |activation| seen by each input channel of every linear layer while the
    (unquantized) model computes ``token_ids`` as one prompt: name -> [in_features]."""
    from pagoda.attention import AttentionMetadata
    from pagoda.attention.metadata import layer_metadata
    from pagoda.attention.state import StateCache, StepStates

    ranges: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(_range_hook(ranges, n)) for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, BlocksLinear))]
    # MoE layers one product per expert, so that each expert's hooks see its inputs (the
    # exact mode's one-call kernel for a layer kept as blocks calls no expert module).
    moe = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    fused = [m._fused for m in moe]
    for m in moe:
        m._fused = False
    try:
        block = 16
        num_blocks = -(-len(token_ids) // block)
        dtype = model.model.norm.weight.dtype
        # (The KV heads this process holds: a tensor-parallel rank's share.)
        caches = [None if spec is None else
                  torch.zeros(2, num_blocks, block, spec.num_kv_heads, spec.head_dim, dtype=dtype)
                  for spec in model.kv_specs()]
        caches = [caches[model.config.kv_source_of(i)] for i in range(len(caches))]   # (shared KV)
        meta = layer_metadata(AttentionMetadata.build, [len(token_ids)], [0], [list(range(num_blocks))], block,
                              torch.device("cpu"), [model.config.chunk_of(i) for i in range(len(caches))])
        # A hybrid model's state layers: one zeroed slot, the prompt's (nothing saved).
        shapes = model.state_shapes()
        if any(shape is not None for shape in shapes):
            caches = [cache if shape is None else StateCache(torch.zeros(1, *shape, dtype=dtype), None, cache)
                      for cache, shape in zip(caches, shapes, strict=True)]
            meta.states = StepStates([0], [-1], [[]])
        with torch.inference_mode():
            hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), caches, meta)
            model.compute_logits(hidden[-1:])
    finally:
        for h in hooks:
            h.remove()
        for m, f in zip(moe, fused, strict=True):
            m._fused = f
    return ranges


def _as_float_linear(module: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` with the layer's float32 weight (dequantized afresh for a
    ``BlocksLinear``: one layer's float copy at a time, dropped once quantized)."""
    if isinstance(module, nn.Linear):
        return module
    lin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    lin.weight = nn.Parameter(module.dequantized(), requires_grad=False)
    for part in module.parts:  # read once; the file's pages need not stay in this process
        part.drop_pages()
    if module.bias is not None:
        lin.bias = nn.Parameter(module.bias.clone(), requires_grad=False)
    return lin


def gguf_repacks() -> bool:
    """Whether the gguf mode repacks its weights of the ``LANES_TYPES`` (blocks.py) with 16
    channels in the vector lanes here (BlocksLinear.repack_for_lanes): CPUs with AVX-512
    VNNI, unless PAGODA_GGUF_REPACK=0."""
    return cpu_kernels.has_avx512_vnni() and os.environ.get("PAGODA_GGUF_REPACK", "1") != "0"


def _int8_activations(model: nn.Module) -> nn.Module:
    """``gguf``: every projection and LM head kept as GGUF blocks multiplies them with
    int8 activations (``BlocksLinear.int8_activations``); the weights stay as they are."""
    layers = [m for m in model.modules() if isinstance(m, BlocksLinear)]
    if not layers:
        raise ValueError("--quantization gguf needs a GGUF file on the CPU in float32 (its weights kept in "
                         "their blocks); for other checkpoints use int8 or q4")
    suffixes = tuple(getattr(model, "unquantized_modules", ()))   # MoE routers stay in float
    keep = {id(m) for n, m in model.named_modules() if n.endswith(suffixes)}
    lanes = gguf_repacks()
    ops = cpu_kernels.kernels()
    tiles = lanes and ops is not None and ops.amx_enabled()
    # A Q6_K LM head stays in the file's layout on CPUs without AMX: one row against it (a
    # one-stream decode step's largest read) ran 2.68 -> 3.12 ms repacked (the 49,152 x 2,048
    # head, Zen 4, before the repacked kernels' prefetches; the 6-bit unpacking then
    # outweighed the blocks it saves decoding). On the AMX Xeon the repacked head is the
    # faster: 5.00 -> 2.08 ms for one row (2.12 with the AVX-512 kernels alone), a 1B Q4_0
    # file's one-stream decode step 34.7 / 35.8 -> 31.9 / 32.3 ms, 16 streams level or better
    # (docs/results/lanes32/head-ab).
    head = getattr(model, "lm_head", None)
    repacked = 0
    for layer in layers:
        if layer.quantized_parts and id(layer) not in keep:
            layer.int8_activations = True
            if lanes:
                repacked += layer.repack_for_lanes(q6k=layer is not head or tiles)
    if repacked:
        logger.info("gguf mode: %d weights repacked with 16 channels in the AVX-512 VNNI lanes%s",
                    repacked, "; steps of 16+ rows on the AMX int8 tiles" if tiles else "")
    return model


def _log_gemm_paths(mode: str, bf16_path: str | None) -> None:
    """Which units each step size's products run on, once at load (AMX needs the kernel's
    permission per process: ``cpu_kernels.amx_permitted``)."""
    if mode == "bf16":
        path = {"onednn": f"oneDNN ({cpu_kernels.onednn_units('bf16')})",
                "pagoda": "pagoda's bf16-weight kernel (no bf16 units)",
                "torch": "torch's bf16 GEMM (no pagoda kernels)"}[bf16_path]
        logger.info("bf16 mode: every projection and the LM head on %s, every step size", path)
    elif mode == "int8":
        small = int8_small_step_rows()
        gemv = "pagoda's AVX-512 VNNI GEMV" if cpu_kernels.has_avx512_vnni() else "pagoda's AVX2 GEMV"
        if small > 1 << 40:
            logger.info("int8 mode: every step size on %s", gemv)
        else:
            logger.info("int8 mode: steps of up to %d tokens on %s, larger on torch._int_mm (oneDNN, %s)",
                        small, gemv, cpu_kernels.onednn_units("int8"))


def calibration_token_ids(path: str, gguf_metadata: dict | None) -> list[int]:
    """``CALIBRATION_TEXT`` in the tokens of the model at ``path`` (its GGUF metadata,
    when it is a GGUF file)."""
    from pagoda.tokenizer import model_tokenizer

    return model_tokenizer(path, gguf_metadata).encode(CALIBRATION_TEXT)


def checkpoint_int8(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 weights [out, in], float32 scales [out]) of a layer kept as 8-bit integer
    groups (a W8A8 / W8A16 checkpoint's ``PAGODA_Q8Z`` / ``PAGODA_Q8ZF`` blocks) whose
    every output channel has one scale and one zero-point and values that fit int8 once the
    zero is taken off: the int8 mode's arithmetic then is the checkpoint's own (per-channel
    int8 weights, per-token int8 activations). None for any other layer."""
    if not isinstance(module, BlocksLinear) or module.permutes_inputs:
        return None
    q8 = {201: (2, torch.float16), 203: (4, torch.float32)}   # PAGODA_Q8Z / Q8ZF: scale bytes, dtype
    if not all(int(p.ggml_type) in q8 for p in module.parts):
        return None
    weights, scales = [], []
    for part in module.parts:
        nbytes, dtype = q8[int(part.ggml_type)]
        blocks = part.data.view(part.out_features, -1, nbytes + 2 + 32)
        scale = blocks[:, :, :nbytes].contiguous().view(dtype).float()   # [out, blocks, 1]
        zero = blocks[:, :, nbytes:nbytes + 2].contiguous().view(torch.int16)
        if not (torch.equal(scale, scale[:, :1].expand_as(scale)) and torch.equal(zero, zero[:, :1].expand_as(zero))):
            return None   # groups within a row: not one scale per channel
        q = blocks[:, :, nbytes + 2:].to(torch.int16) - zero
        if q.numel() and (q.min() < -128 or q.max() > 127):
            return None
        weights.append(q.reshape(part.out_features, -1).to(torch.int8))
        scales.append(scale[:, 0, 0])
    return torch.cat(weights), torch.cat(scales)


def _split_outliers(ranges: torch.Tensor | None, layer: RowParallelLinear) -> torch.Tensor | None:
    """A row-parallel layer's float channels among this rank's inputs: the largest of the
    whole layer's (the ranks' calibration ranges put together), as one process picks them;
    None where calibration did not reach the layer (an expert no token chose)."""
    start, end, total = layer.columns
    whole = torch.zeros(total + 1)   # the last: whether a rank saw the layer
    if ranges is not None:
        whole[start:end] = ranges
        whole[total] = 1.0
    layer.comm.all_reduce_max(whole)   # each rank fills its columns; ranges are >= 0
    if whole[total] == 0:
        return None
    idx = whole[:total].topk(min(INT8_OUTLIER_CHANNELS, total // 4)).indices
    return idx[(idx >= start) & (idx < end)] - start


def quantize_model(model: nn.Module, mode: str, device: torch.device,
                   calibration_ids: list[int] | None = None, show_progress: bool = False) -> nn.Module:
    """Replace the model's projections and LM head with quantized layers, in place.

    The embedding stays in full precision (it is a lookup, not a GEMM); a tied
    LM head gets its own quantized copy of the embedding matrix. ``int8`` runs the
    model once over ``calibration_ids`` first (the tokenized ``CALIBRATION_TEXT``;
    a fixed pseudo-random sequence when None) to choose each layer's float channels.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")
    if mode == "none":
        return model
    if mode == "gguf":
        return _int8_activations(model)
    if device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on the CPU only; use --quantization none on {device}")
    keep = tuple(getattr(model, "unquantized_modules", ()))   # MoE routers stay in float
    tower = tuple(getattr(model, "tower_prefixes", ()))  # and a vision tower (quantize_tower)
    targets = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, BlocksLinear)) and not checkpoint_name(name).endswith(keep)
        and not checkpoint_name(name).startswith(tower)
    ]
    # Tensor parallelism: the local layers of row-parallel layers (their input split over ranks;
    # an expert's, split by rows, is summed over ranks by its MoE block, after its weighting:
    # in the bf16 mode each rank rounds its part of such an expert's output).
    row_parallel = {f"{n}.local": m for n, m in model.named_modules() if isinstance(m, RowParallelLinear)}
    bf16_path = bf16_gemm_path() if mode == "bf16" else None   # the same for every layer
    _log_gemm_paths(mode, bf16_path)
    ranges: dict[str, torch.Tensor] = {}
    if mode == "int8":
        if calibration_ids is None:
            gen = torch.Generator().manual_seed(0)
            calibration_ids = torch.randint(0, model.config.vocab_size, (128,), generator=gen).tolist()
        ranges = calibrate(model, calibration_ids)
    # A bar for the conversion (an 8B model: about a minute), as for the load itself.
    for name, module in tqdm(targets, desc=f"Converting to {mode}", unit="layer", leave=False,
                             disable=not show_progress):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        stored = checkpoint_int8(module) if mode == "int8" else None
        if stored is not None:   # a W8A8 checkpoint's layer: its own int8 weights and scales
            setattr(parent, attr, Int8Linear.from_int8(*stored, module.bias))
            continue
        # The int8 mode quantizes a kept layer from blocks of rows dequantized afresh (no
        # float copy of the whole weight); the other modes take one layer's float copy.
        blocks = module if mode == "int8" and name not in row_parallel and isinstance(module, BlocksLinear) else None
        module = blocks if blocks is not None else _as_float_linear(module)
        # q4 keeps the LM head at 8 bits, as GGUF files do (Q8_0/Q6_K output
        # weights): 4-bit logits cost more quality than the head's share of the
        # bytes saves (measured: q4 head -> wrong answers on the reference prompts).
        if mode == "bf16":
            split = row_parallel.get(name)
            if split is not None and split.reduce:   # the ranks' float32 sums, rounded once added
                layer = Bf16Linear(module, bf16_path, partial=True)
                split.output_dtype = torch.bfloat16
            else:
                layer = Bf16Linear(module, bf16_path)
        elif mode == "int8":
            split = row_parallel.get(name)
            if split is None:
                k = min(INT8_OUTLIER_CHANNELS, module.in_features // 4)
                layer = Int8Linear(module, ranges[name].topk(k).indices if name in ranges else None)
            else:
                layer = Int8Linear(module, _split_outliers(ranges.get(name), split), split=split.comm)
        elif checkpoint_name(name) == "lm_head" and module.bias is None:
            layer = Int8WeightLinear(module)
        else:
            layer = Q4Linear(module)
        setattr(parent, attr, layer)
        if blocks is not None:  # read once: the file's pages need not stay in this process
            for part in blocks.parts:
                part.drop_pages()
        # This layer's float copies go back to the kernel before the next is made (8B int8:
        # 2 GiB more RSS after the load otherwise, and a higher peak during it).
        release_freed_memory()
    if mode == "int8" and tower:
        quantize_tower(model, tower)
    return model


def tower_calibration_pixels(vision: dict) -> torch.Tensor:
    """One image at the tower's resolution for ``quantize_tower``: smooth waves of another
    phase in each channel, within the normalised pixels' range [-1, 1] (deterministic)."""
    side, channels = vision["image_size"], vision["num_channels"]
    y, x = torch.meshgrid(torch.linspace(-1, 1, side), torch.linspace(-1, 1, side), indexing="ij")
    return torch.stack([torch.sin(7 * x + k) * torch.cos(5 * y - 2 * k) for k in range(channels)])[None]


def quantize_tower(model: nn.Module, prefixes: tuple[str, ...]) -> None:
    """int8 mode: a vision-language model's tower and projector in int8 as well (their
    products are most of an image's cost: SmolVLM's tower on 17 tiles, measured in this
    mode's kernels, 1.01 -> 0.65 s a tile), each layer's ``INT8_OUTLIER_CHANNELS`` largest
    input channels over one calibration image (``tower_calibration_pixels``) kept in float."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(prefixes)]
    ranges: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(_range_hook(ranges, n)) for n, m in targets]
    try:
        with torch.inference_mode():
            model.embed_images(tower_calibration_pixels(model.config.vision))
    finally:
        for h in hooks:
            h.remove()
    for name, module in targets:
        if name not in ranges:   # a layer the family does not read (LLaVA's past its feature layer)
            continue
        parent_name, _, attr = name.rpartition(".")
        k = min(INT8_OUTLIER_CHANNELS, module.in_features // 4)
        setattr(model.get_submodule(parent_name), attr, Int8Linear(module, ranges[name].topk(k).indices))
    release_freed_memory()
