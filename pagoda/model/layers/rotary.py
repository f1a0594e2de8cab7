"""Rotary position embedding: inverse frequencies (with the scalings checkpoints use) and
the rotate-half rotation of HF's layout."""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3", "longrope", "freq_factors", "yarn", "proportional")


def rope_kind(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # On the CPU even under a meta-device context (where factory functions go through
    # torch._refs and import torch._dynamo, seconds of start-up).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = rope_kind(scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # and the band between is interpolated smoothly.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        inv_freq = scaled
    elif kind == "freq_factors":
        # llama.cpp's rope_freqs tensor (its Llama 3.1 files): a divisor per frequency, the
        # llama3 scaling's factors as its converter computed them.
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
    elif kind == "longrope":
        # The short factors: positions below the original context (longrope_tables).
        inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64, device="cpu")
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    elif kind == "proportional":
        # Gemma 4's global layers: the first partial_rotary_factor of each half-head's
        # frequencies (over the whole head's width) turn, the rest are still (frequency 0),
        # so a rotate-half RoPE over the whole head rotates pairs (i, i + D/2) for the first few.
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = torch.cat((inv_freq[:turning], torch.zeros_like(inv_freq[turning:]))) / scaling.get("factor", 1.0)
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: {SUPPORTED_ROPE_SCALING}")
    return inv_freq.float()


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Qwen2.5/3 long context, GPT-OSS, DeepSeek): frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by ``factor``),
    those that turn more than beta_fast times kept, and the band between ramps linearly
    from one to the other over the dimension index."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:   # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp   # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature for a context stretched by ``factor``: 1 + 0.1 mscale ln(factor)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor on cos and sin a scaling asks for (YaRN's attention temperature:
    1 + 0.1 ln(factor), or its ratio of mscales, or the configured ``attention_factor``);
    1.0 for the others (LongRoPE's applies per position: ``longrope_tables``)."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all else yarn_mscale(factor)


def longrope_tables(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, int, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): (the long factors' inverse frequencies, the original
    context length from which they apply, the factor on cos and sin). Below the original
    context the short factors apply (``rope_inv_freq``): transformers' numbers for every
    sequence that fits it; past it each position takes the long factors (transformers
    switches a whole sequence once it is longer, its earlier keys cached as they were)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    long = (base / torch.tensor(scaling["long_factor"], dtype=torch.float64, device="cpu")).float()
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return long, original, float(attention)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos and sin [T, 1, head_dim] (each frequency twice: the rotate-half layout), times
    ``scale`` (a scaling's attention factor)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x [T, heads, D]; cos/sin [T, 1, R]: the first R <= D
    dimensions rotate (partial rotary), the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def mrope_axes(sections: tuple[int, ...], interleaved: bool = False) -> torch.Tensor:
    """M-RoPE (Qwen2-VL and later): which of the three position rows (temporal, height,
    width) each rotary frequency turns with. ``sections``: frequencies per row (they sum to
    half the rotary width). Qwen2-VL / Qwen2.5-VL give each row a contiguous run of
    frequencies; Qwen3-VL / Qwen3.5 interleave them (T H W T H W ..., the temporal row taking
    what the other two leave)."""
    if len(sections) != 3:
        raise ValueError(f"mrope_section must have three entries (temporal, height, width), got {list(sections)}")
    if not interleaved:
        return torch.cat([torch.full((n,), axis, dtype=torch.long, device="cpu") for axis, n in enumerate(sections)])
    axes = torch.zeros(sum(sections), dtype=torch.long, device="cpu")
    for axis in (1, 2):
        axes[axis:sections[axis] * 3:3] = axis
    return axes


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, dtype: torch.dtype,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``rope_cos_sin`` for M-RoPE's positions [3, T]: frequency i turns with row ``axes[i]``
    (an image's tokens have a height and a width; text's three rows are equal, and then
    this is ``rope_cos_sin`` of any row)."""
    freqs = positions.float()[axes].T * inv_freq[None, :]   # [T, F]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)
