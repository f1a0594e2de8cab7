"""``--quantization auto`` made concrete for a model file: which mode it loads in, and why.

Reads a GGUF file's header (pagoda.hub.gguf_file) for its size and tensor types; the
configuration itself (pagoda.config) reads no file.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

from pagoda.config import EngineConfig
from pagoda.hub.gguf_file import GGUFFile

# --quantization auto: a GGUF file of at least this many bytes runs in the gguf mode on the
# CPU (float32), a smaller one in the exact mode. Measured (docs/benchmarks.md, "Defaults"):
# the 1B-shaped Q4_K_M file (638 MiB) decodes one stream 2.1x faster in the gguf mode (28.8
# against 13.9 tok/s; llama-server 25.7), where the bundled 135M Q4_1 file was as fast or
# faster in the exact mode (73.7 / 236 tok/s at 1 / 16 streams against 70.5 / 158). Since the
# 32-weight types run repacked (AVX-512 VNNI), the gguf mode is the faster there too (2.23x /
# 4.31x llama-server against the exact mode's 1.18x / 2.08x), but a small file stays exact:
# the bundled model's default output stays transformers' own (its greedy tokens, its
# logits; the gguf mode's int8 activations move its logits by up to ~2 and change some
# greedy answers), which its reference tests and a first user's check rest on;
# --quantization gguf takes the speed.
GGUF_MODE_MIN_BYTES = 256 << 20
# ... and only when most of its quantized bytes are of the types the gguf mode has its own
# kernels for (the repacked Q4_K / Q6_K ones, on the AMX tiles where there are some; MXFP4's
# experts). Of other types the exact mode was the faster before the 32-weight types were
# repacked, and is where they are not (docs/benchmarks.md, "Which mode a GGUF file runs in"): 1B-shaped files, 1 / 16 streams against llama-server -t 2 in the same
# run, Q8_0 exact 1.21x / 1.32x, gguf 0.97x / 0.84x; Q4_0 exact 0.95x / 0.93x, gguf 0.81x /
# 0.62x (one stream decodes level, the exact mode prefills in half the time); one product of
# each type from memory, gguf against exact at 1 / 16 rows (benchmarks/gguf_modes.py): Q4_0,
# Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL 0.95-1.13x / 0.69-1.01x, Q2_K, Q3_K, Q5_K, IQ4_XS
# 0.75-0.90x / 0.51-0.98x, Q4_K 1.97x / 4.69x, Q6_K 1.61x / 3.76x.
GGUF_MODE_TYPES = ("Q4_K", "Q6_K", "MXFP4")
# ... and, on CPUs where the gguf mode repacks them with 16 channels in the vector lanes
# (AVX-512 VNNI: pagoda.model.layers.quantization.gguf_repacks), these: one product from
# memory, gguf against exact, 1 / 16 / 128 rows (benchmarks/gguf_modes.py, AMX Xeon,
# docs/results/lanes32/products.txt): Q8_0 1.75x / 3.77x / 3.07x, Q4_0 2.28x / 3.68x / 3.17x,
# Q4_1 2.53x / 3.69x / 2.81x, IQ4_NL 2.01x / 3.87x / 3.11x, Q5_K 1.77x / 3.67x / 3.77x;
# served, 1B-shaped files against llama-server -t 2 at 1 / 16 streams: Q4_0 1.97x / 2.48x
# (exact 0.99x / 0.93x), Q8_0 1.83x / 3.26x (exact 1.14x / 1.21x), Q5_K_M 1.74x / 2.64x
# (exact 0.93x / 0.86x).
# Q2_K, Q3_K, Q5_0, Q5_1, IQ4_XS, repacked since (docs/results/lanes-all/products.txt): Q2_K
# 2.62x / 6.39x / 4.18x, Q3_K 2.84x / 5.12x / 3.70x, Q5_0 2.02x / 3.64x / 2.95x, Q5_1 2.11x /
# 3.60x / 2.79x, IQ4_XS 1.81x / 3.78x / 2.87x: every integer block type pagoda reads.
LANES_MODE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "Q5_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1", "IQ4_XS")
# Types whose weights the gguf mode leaves to the exact mode's kernels (float ones).
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def gguf_mode_types() -> tuple[str, ...]:
    """The types the gguf mode has kernels of its own for on this CPU."""
    from pagoda.model.layers.quantization import gguf_repacks

    return GGUF_MODE_TYPES + LANES_MODE_TYPES if gguf_repacks() else GGUF_MODE_TYPES


def gguf_mode_share(path: str, types: tuple[str, ...] = GGUF_MODE_TYPES) -> tuple[float, str] | None:
    """The share of a GGUF file's quantized bytes in ``types``, and its type holding the
    most bytes; None when it has no quantized tensor."""
    nbytes: Counter[str] = Counter()
    with GGUFFile(path) as f:
        for info in f.tensors.values():
            if info.ggml_type.name not in _FLOAT_TYPES:
                nbytes[info.ggml_type.name] += info.nbytes
    total = sum(nbytes.values())
    if not total:
        return None
    return sum(nbytes[t] for t in types) / total, nbytes.most_common(1)[0][0]


def auto_quantization(path: str, device: str, dtype: str) -> tuple[str, str]:
    """``--quantization auto`` for the model at ``path``: the mode, and why (for the log)."""
    if not os.path.isfile(path):
        return "none", "an HF checkpoint runs in the exact mode"
    if device.split(":")[0] != "cpu" or dtype not in ("auto", "float32", "fp32", "float"):
        return "none", f"a GGUF file on {device} in {dtype} is dequantized at load (the exact mode)"
    size = os.path.getsize(path)
    if size < GGUF_MODE_MIN_BYTES:
        return "none", (f"a GGUF file under {GGUF_MODE_MIN_BYTES >> 20} MiB runs in the exact mode (as fast there); "
                        f"--quantization gguf for llama.cpp's arithmetic")
    types = gguf_mode_types()
    share = gguf_mode_share(path, types)
    if share is not None and share[0] < 0.5:
        return "none", (f"a GGUF file mostly of {share[1]} runs in the exact mode (faster there: "
                        f"{', '.join(types)}, the types the gguf mode has kernels of its own for on this CPU, are "
                        f"{share[0]:.0%} of its quantized bytes); --quantization gguf for llama.cpp's arithmetic")
    return "gguf", (f"a GGUF file of {size / 2**20:.0f} MiB on the CPU runs in the gguf mode (llama.cpp's "
                    f"arithmetic: int8 activations times the file's blocks); --quantization none for the exact one")


def resolve_quantization(config: EngineConfig, path: str) -> tuple[EngineConfig, str | None]:
    """``config`` with ``--quantization auto`` made concrete for the model at ``path``, and
    why (None when it was not auto)."""
    if config.quantization != "auto":
        return config, None
    mode, why = auto_quantization(path, config.device, config.dtype)
    return dataclasses.replace(config, quantization=mode), f"--quantization auto: {why}"
