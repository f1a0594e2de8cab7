"""Gated DeltaNet (Qwen3.5, Qwen3-Next: pagoda/model/models/qwen3_5.py), linear attention
with a decaying, delta-rule-updated memory per value head.

One projection gives q, k (``k_heads`` of ``k_dim``), v (``v_heads`` of ``v_dim``), the
output gate z (per value head), and b, a (one per value head). A depthwise causal
convolution (width ``conv_kernel``, SiLU) runs over [q; k; v]; q and k are L2-normalised,
q scaled by 1/sqrt(k_dim); each value head reads the query/key head of its group. Per
value head, with beta = sigmoid(b) and g = A softplus(a + dt_bias) (A = -exp(A_log), held as
A: llama.cpp's files hold it so), the memory
S [k_dim, v_dim] runs

    S <- exp(g) S,    S <- S + k (beta (v - S^T k))^T,    o = S^T q,

and the output is out_proj(RMSNorm(o) w * silu(z)), the norm per value head. What a
request carries from one step to the next, in its slot of the state pool
(pagoda/core/state_pool.py), is the convolution's last ``conv_kernel - 1`` inputs and every
value head's S, one flat vector per layer; with prefix caching, both at checkpointed block
ends too (pagoda/attention/state.py). The recurrence runs token by token (exact), in
pagoda's C++ kernel on the CPU (pagoda/csrc/recurrent.cpp: every sequence of the step in
place in its slot, (sequence, head) pairs in parallel), else in torch (decodes batched).

The projection's rows come in one of three layouts: ``split`` (Qwen3.5: [q; k; v], z, b, a),
``next`` (Qwen3-Next's HF checkpoints, and llama.cpp's first qwen3next files: q, k, v, z
stacked per key head, then b, a per key head) or ``split_ba`` (llama.cpp's qwen3next
files: [q; k; v], z, then b, a per key head); what is stacked per key head is unpacked
after the product. Value heads come in one of two orders: ``grouped`` (transformers': the heads of one
query/key head next to each other; llama.cpp's qwen3next files too) or ``tiled`` (llama.cpp's
qwen35 / qwen35moe files: value head j reads query/key head j mod k_heads). Every
per-value-head tensor of a checkpoint is in its order, so a file is served in its own
order and no weight is permuted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.attention.state import StateCache, StepStates
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.hybrid import kernel_calls, processing_order, sequence_spans, state_kernels


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        g = config.linear_attn
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = g["k_heads"], g["v_heads"], g["k_dim"], g["v_dim"]
        self.kernel = g["conv_kernel"]
        self.tiled = g.get("v_order", "grouped") == "tiled"
        self.layout = g.get("layout", "split")
        if self.layout not in ("split", "next", "split_ba"):
            raise ValueError(f"Gated DeltaNet projection layout {self.layout!r}")
        # Parts stacked per key head (b, a; with ``next``, q, k, v, z too): unpacked after
        # the product (the decode stack takes the ``split`` layout only).
        self.stacked = self.layout != "split"
        if self.v_heads % self.k_heads:
            raise ValueError(f"{self.v_heads} value heads for {self.k_heads} key heads")
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.eps = config.rms_norm_eps
        # [q; k; v], z, b, a in one GEMM (the loader fills the four row ranges).
        self.in_proj = nn.Linear(config.hidden_size, self.conv_dim + self.value_size + 2 * self.v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.v_heads), requires_grad=False)
        self.A = nn.Parameter(torch.zeros(self.v_heads), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.v_dim), requires_grad=False)
        self.out_proj = nn.Linear(self.value_size, config.hidden_size, bias=False)

    @property
    def row_sizes(self) -> list[int]:
        """The rows of the stacked projection's parts: [q; k; v], z, b, a (``next``: qkvz,
        ba; ``split_ba``: [q; k; v], z, ba)."""
        if self.layout == "next":
            return [self.conv_dim + self.value_size, 2 * self.v_heads]
        if self.layout == "split_ba":
            return [self.conv_dim, self.value_size, 2 * self.v_heads]
        return [self.conv_dim, self.value_size, self.v_heads, self.v_heads]

    def _parts(self, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[q; k; v], z, b, a of the projection's output."""
        if not self.stacked:
            return projected.split(self.row_sizes, dim=-1)
        t, nk, r = projected.shape[0], self.k_heads, self.v_heads // self.k_heads
        if self.layout == "split_ba":
            mixed, z, ba = projected.split(self.row_sizes, dim=-1)
            b, a = ba.view(t, nk, 2 * r).split([r, r], dim=-1)
            return mixed, z, b.reshape(t, -1), a.reshape(t, -1)
        qkvz, ba = projected.split(self.row_sizes, dim=-1)
        q, k, v, z = qkvz.view(t, nk, -1).split([self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim], dim=-1)
        b, a = ba.view(t, nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def state_numel(self) -> int:
        """This layer's state per request (its heads': a tensor-parallel rank's share)."""
        return self.conv_dim * (self.kernel - 1) + self.v_heads * self.k_dim * self.v_dim

    @staticmethod
    def state_size(config: ModelArchConfig) -> int:
        g = config.linear_attn
        conv_dim = 2 * g["k_heads"] * g["k_dim"] + g["v_heads"] * g["v_dim"]
        return conv_dim * (g["conv_kernel"] - 1) + g["v_heads"] * g["k_dim"] * g["v_dim"]

    def _split(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A flat state as (the convolution's last inputs [conv_dim, kernel - 1], S [v_heads, k_dim, v_dim])."""
        n = self.conv_dim * (self.kernel - 1)
        return state[:n].view(self.conv_dim, self.kernel - 1), state[n:].view(self.v_heads, self.k_dim, self.v_dim)

    def _store(self, target: torch.Tensor, window: torch.Tensor, memory: torch.Tensor) -> None:
        conv, s = self._split(target)
        conv.copy_(window)
        s.copy_(memory)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[n, k_heads, d] -> [n, v_heads, d]: each value head's query/key head."""
        r = self.v_heads // self.k_heads
        if r == 1:
            return x
        return x.repeat(1, r, 1) if self.tiled else x.repeat_interleave(r, dim=1)

    def forward(self, x: torch.Tensor, cache: StateCache, meta: AttentionMetadata) -> torch.Tensor:
        mixed, z, b, a = self._parts(self.in_proj(x))
        plan: StepStates = meta.states
        ops = state_kernels(cache.slots, meta)
        if ops is not None:
            out = torch.empty(x.shape[0], self.v_heads, self.v_dim)
            self._kernel(ops, mixed, z, b, a, out, cache, plan, meta)
            return self.out_proj(out.view(x.shape[0], -1).to(x.dtype))
        beta = torch.sigmoid(b.float())
        decay = torch.exp(self.A.float() * F.softplus(a.float() + self.dt_bias.float()))  # [T, v_heads]
        out = torch.empty(x.shape[0], self.v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        self._torch(mixed, beta, decay, out, cache, plan, meta)
        # The gated RMSNorm per value head, in float32.
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        gated = normed * F.silu(z.float().view(-1, self.v_heads, self.v_dim))
        return self.out_proj(gated.reshape(x.shape[0], -1).to(x.dtype))

    def _kernel(self, ops, mixed, z, b, a, out, cache: StateCache, plan: StepStates, meta: AttentionMetadata) -> None:
        """pagoda's C++ kernel (pagoda/csrc/recurrent.cpp; the gated norm too) over every
        sequence in place in its slot: first those not restoring a prefix hit's saved
        state, then those (the state they restore may be one the first call saves). The
        index tensors are made once a step, for every layer."""
        for restores, take, args in kernel_calls(meta):
            for slot, entry in restores:
                cache.slots[slot] = cache.blocks[entry]
            part = out[take] if isinstance(take, slice) else torch.empty(len(take), self.v_heads, self.v_dim)
            ops.gated_delta_rule(cache.slots, args[0], args[1], mixed[take], self.conv_weight.float(), a[take],
                                 b[take], z[take], self.A.float(), self.dt_bias.float(), self.norm_weight.float(),
                                 self.eps, part, cache.blocks, *args[2:], self.k_heads, self.k_dim, self.v_dim,
                                 self.tiled)
            if not isinstance(take, slice):
                out[take] = part

    def _torch(self, mixed, beta, decay, out, cache: StateCache, plan: StepStates, meta: AttentionMetadata) -> None:
        """The reference path, in torch."""
        # Decodes (one token each, first in the step) in one batch, but those starting from a
        # prefix hit's block end; then the rest token by token, those restoring last.
        batch = [i for i in range(meta.num_decodes) if plan.restore[i] < 0]
        if batch:
            self._decode(mixed, beta, decay, out, cache, plan, batch)
        spans = sequence_spans(meta)
        for i in processing_order(plan):
            if i >= meta.num_decodes or plan.restore[i] >= 0:
                start, n, context = spans[i]
                rows = slice(start, start + n)
                self._sequence(mixed[rows], beta[rows], decay[rows], out[rows], cache, plan, i, context > 0)

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [n, conv_dim] as q, k (L2-normalised, q scaled; one per
        value head) and v, [n, v_heads, size] each."""
        n = conv_out.shape[0]
        q, k, v = conv_out.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = _l2norm(q.view(n, self.k_heads, self.k_dim)) * self.k_dim ** -0.5
        k = _l2norm(k.view(n, self.k_heads, self.k_dim))
        return self._per_value_head(q), self._per_value_head(k), v.view(n, self.v_heads, self.v_dim)

    def _decode(self, mixed, beta, decay, out, cache: StateCache, plan: StepStates, batch: list[int]) -> None:
        """One token of each decoding sequence of ``batch`` (decodes are the step's first
        rows: sequence i is row i), their states gathered from their slots, updated together
        and written back (and to a block's end they complete)."""
        n = len(batch)
        if n < batch[-1] + 1:
            rows = torch.tensor(batch, device=mixed.device)
            mixed, beta, decay = mixed.index_select(0, rows), beta.index_select(0, rows), decay.index_select(0, rows)
        else:
            rows = None
            mixed, beta, decay = mixed[:n], beta[:n], decay[:n]
        slots = torch.tensor([plan.slots[i] for i in batch], device=mixed.device)
        state = cache.slots.index_select(0, slots)
        keep = self.kernel - 1
        split = self.conv_dim * keep
        window = torch.cat((state[:, :split].view(n, self.conv_dim, keep), mixed[:, :, None].to(state.dtype)), dim=-1)
        conv_out = F.silu((window * self.conv_weight.to(window.dtype)).sum(-1))    # [n, conv_dim]
        q, k, v = self._qkv(conv_out)
        memory = state[:, split:].view(n, self.v_heads, self.k_dim, self.v_dim).float() * decay[:, :, None, None]
        delta = (v - torch.einsum("nhkv,nhk->nhv", memory, k)) * beta[:, :, None]
        memory = memory + k[..., None] * delta[:, :, None, :]
        o = torch.einsum("nhkv,nhk->nhv", memory, q)
        if rows is None:
            out[:n] = o
        else:
            out.index_copy_(0, rows, o)
        new = torch.cat((window[:, :, 1:].reshape(n, -1), memory.reshape(n, -1).to(state.dtype)), dim=-1)
        cache.slots.index_copy_(0, slots, new)
        for j, i in enumerate(batch):
            for _, block in plan.checkpoints[i]:
                cache.blocks[block] = new[j]

    def _sequence(self, mixed, beta, decay, out, cache: StateCache, plan: StepStates, i: int, context: bool) -> None:
        """A prompt chunk of sequence ``i``, token by token, from its slot's state (or a
        prefix hit's block end, or zeros for its first chunk)."""
        n, keep, slot = mixed.shape[0], self.kernel - 1, plan.slots[i]
        if plan.restore[i] >= 0:
            cache.slots[slot] = cache.blocks[plan.restore[i]]
        if context:
            conv, s = self._split(cache.slots[slot])
            before, memory = conv.to(mixed.dtype), s.float().clone()
        else:
            before = mixed.new_zeros(self.conv_dim, keep)
            memory = torch.zeros(self.v_heads, self.k_dim, self.v_dim, device=mixed.device)
        window = torch.cat((before, mixed.t()), dim=-1)                          # [conv_dim, keep + n]
        weight = self.conv_weight.to(mixed.dtype)
        q, k, v = self._qkv(F.silu(F.conv1d(window[None], weight[:, None, :], groups=self.conv_dim)[0].t()))
        ends = dict(plan.checkpoints[i])
        for t in range(n):
            memory = memory * decay[t][:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", memory, k[t])) * beta[t][:, None]
            memory = memory + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", memory, q[t])
            block = ends.get(t + 1)
            if block is not None:
                self._store(cache.blocks[block], window[:, t + 1:t + 1 + keep], memory)
        self._store(cache.slots[slot], window[:, -keep:], memory)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (the fla library's, as transformers')."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
