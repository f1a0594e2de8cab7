"""Tiny integer-quantized checkpoints for the GPTQ / AWQ / compressed-tensors tests: the
tiny float32 fixtures' projections quantized round-to-nearest in groups (the
quantizers' definition: a group's range includes 0, scale = range / maxq in float16,
zero = round(-min / scale), or 2^(bits-1) when symmetric), then packed by each format's
published layout (test-side packers, written apart from pagoda's unpackers). Each
writer returns the float32 weights the checkpoint stands for (its dequantization,
computed here), and ``reference_copy`` writes the float32 model of those weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pagoda.model.loader import load_model
from tests.model.test_reference import pagoda_prompt_logits

PROMPT = [1, 17, 300, 42, 7, 255, 3, 99, 480, 12]


def quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool,
             scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in], zeros [out, groups] (unsigned), scales [out, groups]) of w, group of
    input i = g_idx[i]."""
    maxq = 2 ** bits - 1
    groups = int(g_idx.max()) + 1
    out = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int64)
    zeros = torch.empty(out, groups, dtype=torch.int64)
    scales = torch.empty(out, groups, dtype=scale_dtype)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        lo, hi = wg.min(1).values.clamp(max=0), wg.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-8).to(scale_dtype)
        zero = torch.full((out,), (maxq + 1) // 2) if sym else torch.round(-lo / scale.float()).long()
        q[:, cols] = (torch.round(wg / scale.float()[:, None]) + zero[:, None]).clamp(0, maxq).long()
        zeros[:, g], scales[:, g] = zero, scale
    return q, zeros, scales


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The float32 weights: scale (as float32) times the integer q - zero."""
    return scales.float()[:, g_idx] * (q - zeros[:, g_idx]).float()


def pack_words(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [..., n * 32 / bits] -> int32 [..., n]: value k of each run in bits
    [bits k, bits (k + 1)) of its word (shift and or, word by word)."""
    per = 32 // bits
    v = values.astype(np.uint64).reshape(*values.shape[:-1], -1, per)
    words = np.zeros(v.shape[:-1], dtype=np.uint64)
    for k in range(per):
        words |= v[..., k] << np.uint64(bits * k)
    return words.astype(np.uint32).view(np.int32)


def write_quantized(src: str, dst: str, config_entry: dict,
                    convert: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]) -> dict:
    """A copy of the checkpoint at ``src`` with every projection converted: convert(prefix,
    weight) -> (the tensors to store, the float32 weight they stand for). Returns those
    weights by checkpoint name."""
    shutil.copytree(src, dst)
    meant = {}
    for f in sorted(os.listdir(dst)):
        if not f.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(dst, f))
        out = {}
        for name, t in tensors.items():
            if name.endswith("_proj.weight"):
                stored, w = convert(name[: -len(".weight")], t.float())
                out.update(stored)
                meant[name] = w
            else:
                out[name] = t
        save_file(out, os.path.join(dst, f), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = config_entry
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return meant


def reference_copy(src: str, dst: str, weights: dict[str, torch.Tensor]) -> str:
    """The float32 checkpoint at ``src`` with ``weights`` in place of its own."""
    shutil.copytree(src, dst)
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, f))
            save_file({n: weights.get(n, t).contiguous() for n, t in tensors.items()}, os.path.join(dst, f),
                      metadata={"format": "pt"})
    return dst


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(pagoda_prompt_logits(model, ids, [len(ids)])[-1].argmax()))
    return ids[len(prompt):]


def assert_serves_its_dequantized_model(quantized_dir: str, reference_dir: str, kept_types: set[str]) -> None:
    """pagoda on the quantized checkpoint (its layers kept as ``kept_types`` blocks): the
    logits of the float32 model of the dequantized weights within 1e-3, the same greedy tokens."""
    from pagoda.model.layers.blocks import BlocksLinear

    model = load_model(quantized_dir, show_progress=False).model
    kept = {p.ggml_type.name for m in model.modules() if isinstance(m, BlocksLinear) and m is not model.lm_head
            for p in m.parts}
    assert kept == kept_types, kept
    reference = load_model(reference_dir, show_progress=False).model
    got = pagoda_prompt_logits(model, PROMPT, [len(PROMPT)])
    ref = pagoda_prompt_logits(reference, PROMPT, [len(PROMPT)])
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert greedy(model, PROMPT, 6) == greedy(reference, PROMPT, 6)


def groups_of(in_features: int, group_size: int) -> torch.Tensor:
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features) // size


def act_order_g_idx(in_features: int, group_size: int, seed: int) -> torch.Tensor:
    """GPTQ's act-order group index: the inputs taken in a (here random) order, group j of
    that order the inputs at its positions j * group_size ... (g_idx[perm[k]] = k // size)."""
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_features) // group_size
    return g_idx
