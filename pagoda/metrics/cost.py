"""FLOPs and bytes of one model step, from the architecture alone (no torch, no timing).

    flops, nbytes = step_cost(arch, num_tokens=64, context_lens=[300] * 64)   # 64 decodes
    flops, nbytes = step_cost(arch, num_tokens=512, context_lens=[0])         # one 512-token prefill

The byte count is the *ideal* traffic to memory: every weight, KV entry and activation
read or written once per step. A real kernel moves more (pagoda's torch attention gathers
K/V into padded copies; caches miss), so achieved bytes/s computed from this count is a
lower bound on the true traffic, and the arithmetic intensity an upper bound. It is the
number the roofline literature uses, and what an optimised engine could reach.

Counted: the linear layers (q/k/v, o, gate/up, down, LM head on the sampled rows) and
attention's two matmuls (QK^T and PV) over each query's causal context. Left out: norms,
RoPE, SiLU, softmax and residual adds; a few FLOPs per element, well under 1 % of a step.

Families (pagoda.model.arch): a MoE layer computes its router and num_experts_per_tok
experts per token, and reads the experts its tokens pick (expected count under uniform
routing: E (1 - (1 - k/E)^T) for T tokens); a windowed layer attends to at most its
window and reads only that much K/V.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol, Sequence


class ArchLike(Protocol):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def _query_lens(num_tokens: int, context_lens: Sequence[int], query_lens: Sequence[int] | None) -> list[int]:
    if query_lens is not None:
        q = list(query_lens)
        if len(q) != len(context_lens) or sum(q) != num_tokens:
            raise ValueError("query_lens must have one entry per request and sum to num_tokens")
        return q
    if num_tokens == len(context_lens):
        return [1] * num_tokens               # a batch of decodes
    if len(context_lens) == 1:
        return [num_tokens]                   # one request's prompt (chunk)
    raise ValueError("ambiguous batch: pass query_lens (tokens of each request in this step)")


def linear_params_per_layer(arch: ArchLike) -> int:
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    return h * (q + 2 * kv) + q * h + h * 2 * i + i * h


def _layer_kinds(arch: ArchLike) -> list[tuple[bool, int | None]]:
    """Per layer: (a MoE layer, its attention window or None)."""
    moe = getattr(arch, "is_moe_layer", None)
    window = getattr(arch, "sliding_window_of", None)
    return [(bool(moe and moe(i)), window(i) if window else None) for i in range(arch.num_hidden_layers)]


def _attended(q_lens: Sequence[int], context_lens: Sequence[int], window: int | None) -> int:
    """Keys attended over all queries: query j of a request with c cached tokens sees
    c + j + 1 keys (causal), at most ``window``."""
    total = 0
    for q, c in zip(q_lens, context_lens):
        first, last = c + 1, c + q               # keys seen by the first and the last query
        if window is None or last <= window:
            total += (first + last) * q // 2
        elif first > window:
            total += q * window
        else:                                     # growing up to the window, then capped
            total += (first + window) * (window - first + 1) // 2 + (last - window) * window
    return total


def step_cost_breakdown(
    arch: ArchLike,
    num_tokens: int,
    context_lens: Sequence[int],
    query_lens: Sequence[int] | None = None,
    *,
    num_logits: int | None = None,
    weight_bytes: float = 4.0,
    act_bytes: float = 4.0,
    kv_bytes: float = 4.0,
) -> dict[str, float]:
    """FLOPs and ideal bytes of one step, by part.

    context_lens[i]: tokens request i already has in the KV cache before this step.
    query_lens[i]: tokens request i computes this step (default: all 1 when num_tokens
    equals the number of requests, else one request computing num_tokens).
    num_logits: rows that go through the LM head (default: one per request, as the runner
    samples only the last token of each).
    *_bytes: bytes per element of weights, activations, KV cache (4 = fp32; a Q4_1 GGUF
    read by a kernel that dequantises on the fly would be 0.625 for weights).
    """
    if num_tokens < 1 or not context_lens:
        raise ValueError("a step needs at least one token and one request")
    q_lens = _query_lens(num_tokens, context_lens, query_lens)
    n_logits = len(context_lens) if num_logits is None else num_logits
    layers = arch.num_hidden_layers
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q_dim = arch.num_attention_heads * arch.head_dim
    kv_dim = arch.num_key_value_heads * arch.head_dim
    p_lin = linear_params_per_layer(arch)
    p_attn = h * (q_dim + 2 * kv_dim) + q_dim * h
    experts, per_token = getattr(arch, "num_experts", 0), getattr(arch, "num_experts_per_tok", 0)
    p_expert = 3 * h * getattr(arch, "moe_intermediate_size", 0)
    # A MoE layer: the router and k experts per token; the experts its tokens pick, read once.
    p_moe_per_token = p_attn + h * experts + per_token * p_expert
    picked = experts * (1 - (1 - per_token / experts) ** num_tokens) if experts else 0.0
    p_moe_read = p_attn + h * experts + picked * p_expert
    kinds = _layer_kinds(arch)
    n_moe = sum(m for m, _ in kinds)
    windows = Counter(w for _, w in kinds)   # layers per attention window (None: whole context)

    flops_linear = 2.0 * num_tokens * (p_lin * (layers - n_moe) + p_moe_per_token * n_moe)
    attended = sum(n * _attended(q_lens, context_lens, w) for w, n in windows.items())
    flops_attn = 4.0 * arch.num_attention_heads * arch.head_dim * attended
    flops_lm_head = 2.0 * n_logits * h * v

    bytes_weights = (p_lin * (layers - n_moe) + p_moe_read * n_moe + (v * h if n_logits else 0)) * weight_bytes
    bytes_weights += (num_tokens * h + (2 * layers + 1) * h) * weight_bytes   # embedding rows, norm weights
    # Read the K/V each layer's queries see (all, or its window's), write the new.
    keys_read = sum(n * sum(min(c + q, w) if w else c + q for q, c in zip(q_lens, context_lens))
                    for w, n in windows.items())
    bytes_kv = 2 * kv_dim * (keys_read + layers * num_tokens) * kv_bytes
    # Per token and layer: each linear's input and output, attention's q in and out, and
    # the hidden state read and written by the two norms and two residual adds.
    i_moe = per_token * getattr(arch, "moe_intermediate_size", 0)
    act_attn = (h + q_dim + 2 * kv_dim) + (q_dim + h) + 2 * q_dim + 8 * h
    act_per_token = act_attn * layers + (h + 2 * i + i + h) * (layers - n_moe) + (h + 3 * i_moe + h) * n_moe
    bytes_act = num_tokens * act_per_token * act_bytes + n_logits * v * 4.0   # fp32 logits out

    flops = flops_linear + flops_attn + flops_lm_head
    nbytes = bytes_weights + bytes_kv + bytes_act
    return {
        "flops": flops, "bytes": nbytes,
        "flops_linear": flops_linear, "flops_attention": flops_attn, "flops_lm_head": flops_lm_head,
        "bytes_weights": bytes_weights, "bytes_kv": bytes_kv, "bytes_activations": bytes_act,
        "intensity": flops / nbytes,
    }


def step_cost(
    arch: ArchLike,
    num_tokens: int,
    context_lens: Sequence[int],
    query_lens: Sequence[int] | None = None,
    **kwargs: float,
) -> tuple[float, float]:
    """(FLOPs, ideal bytes moved) of one step; see step_cost_breakdown for the arguments."""
    d = step_cost_breakdown(arch, num_tokens, context_lens, query_lens, **kwargs)  # type: ignore[arg-type]
    return d["flops"], d["bytes"]
