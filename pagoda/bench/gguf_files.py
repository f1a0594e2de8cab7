"""Random-weight GGUF tensors and files of real model shapes, for tests and benchmarks.

Random weights are fine for speed and memory (the kernels read the same bytes whatever
they hold); correctness is checked on the real model and against the reference
dequantization. Types the ``gguf`` library can quantize (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1) are quantized from random floats with its reference quantizers; the
K-quants and IQ4 types, which it only dequantizes, get random blocks whose float16
scale fields hold small finite values (any such bytes are a valid block).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

_Q = GGMLQuantizationType
# Byte offsets of the float16 fields (scales, minimums) inside one block.
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    _Q.Q2_K: (80, 82), _Q.Q3_K: (108,), _Q.Q4_K: (0, 2), _Q.Q5_K: (0, 2), _Q.Q6_K: (208,),
    _Q.IQ4_NL: (0,), _Q.IQ4_XS: (0,),
}
QUANTIZABLE = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1)


def random_blocks(ggml_type: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                  std: float = 0.02) -> np.ndarray:
    """uint8 [rows, bytes per row]: a random [rows, cols] weight stored as ``ggml_type``."""
    if ggml_type in QUANTIZABLE:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        if ggml_type == _Q.F32:
            return w.view(np.uint8)
        if ggml_type == _Q.F16:
            return w.astype(np.float16).view(np.uint8)
        return quants.quantize(w, ggml_type)
    if ggml_type not in FP16_FIELDS:
        raise ValueError(f"no random blocks for {ggml_type.name}")
    block, nbytes = GGML_QUANT_SIZES[ggml_type]
    if cols % block:
        raise ValueError(f"{cols} columns are not whole {ggml_type.name} blocks of {block}")
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    # Scales of about std / 8 (a 4-6 bit q times a 6-bit sub-scale lands near std).
    scales = (rng.uniform(0.5, 1.5, (n_blocks, len(FP16_FIELDS[ggml_type]))) * std / 32).astype(np.float16)
    for i, off in enumerate(FP16_FIELDS[ggml_type]):
        raw[:, off : off + 2] = scales[:, i : i + 1].view(np.uint8)
    return raw.reshape(rows, cols // block * nbytes)
