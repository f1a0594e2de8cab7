"""Mamba-2 (Granite 4.0-H, pagoda/model/models/granite_hybrid.py; other Mamba-2 hybrids):
the hidden state is projected to a gate z, the convolution's input xBC and a time step per
head; a depthwise causal convolution (width d_conv, SiLU) over xBC gives x, B and C (B and C
per group of heads); then per head h, with dt = softplus(dt + dt_bias) and A = -exp(A_log)
(held as A: converted at load from HF checkpoints; GGUF files store it so),
the state S [head_dim, d_state] runs

    S <- exp(dt A) S + dt x B^T,     y = S C + D x,

and the output is out_proj(RMSNorm_groups(y * silu(z))). What a request carries from one
step to the next, in its slot of the state pool (pagoda/core/state_pool.py), is the
convolution's last d_conv - 1 inputs and every head's S, one flat vector per layer; with
prefix caching, both at saved block ends too (pagoda/attention/state.py). The scan
(``scan``: shared by the families whose gate differs, Falcon-H1's) runs token by token
(exact): in pagoda's C++ kernel on the CPU (pagoda/csrc/recurrent.cpp: every sequence of
the step in place in its slot, (sequence, head) pairs in parallel), else in torch (a step's
decodes in one batch).

The geometry comes from ``ModelArchConfig.mamba``: heads, head_dim, groups, d_state,
d_conv, intermediate, conv_bias, proj_bias, dt_min, dt_max.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.attention.state import StateCache, StepStates
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.hybrid import kernel_calls, processing_order, renamed, sequence_spans, state_kernels

# The mixer's tensor names -> those llama.cpp's table knows them by (HF's, dt_bias as the
# dt projection's bias as its converter renames it).
_GGUF_NAMES = (
    (".mamba.conv_weight", ".mamba.conv1d.weight"), (".mamba.conv_bias", ".mamba.conv1d.bias"),
    (".mamba.norm_weight", ".mamba.norm.weight"), (".mamba.dt_bias", ".mamba.dt_proj.bias"),
)  # fmt: skip


def hf_mixer_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Mamba-2 tensor of an HF checkpoint as the mixer holds it: the convolution
    [conv_dim, 1, d_conv] as [conv_dim, d_conv], A_log as A = -exp(A_log)."""
    if name.endswith(".conv1d.weight"):
        return tensor.reshape(tensor.shape[0], -1)
    if name.endswith(".A_log"):
        return -torch.exp(tensor.float())
    return tensor


def gguf_mixer_lookup_name(name: str) -> str:
    """One of the mixer's tensor names (``...mamba.A``) as llama.cpp's table knows it."""
    return name + "_log" if name.endswith(".mamba.A") else renamed(name, _GGUF_NAMES)


def gguf_mixer_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Mamba-2 tensor of a llama.cpp file as the mixer holds it: A (stored as -exp(A_log)
    already) and D as [heads, 1], the gated norm as [groups, inner / groups]: flat here."""
    if name.endswith((".mamba.A", ".mamba.D", ".mamba.norm_weight")):
        return tensor.reshape(-1)
    return tensor


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        m = config.mamba
        self.heads, self.head_dim, self.groups = m["heads"], m["head_dim"], m["groups"]
        self.d_state, self.d_conv, self.inner = m["d_state"], m["d_conv"], m["intermediate"]
        self.dt_min, self.dt_max = m["dt_min"], m["dt_max"]
        self.conv_dim = self.inner + 2 * self.groups * self.d_state
        self.eps = config.rms_norm_eps
        self.in_proj = nn.Linear(config.hidden_size, self.inner + self.conv_dim + self.heads, bias=m["proj_bias"])
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.d_conv), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim), requires_grad=False) if m["conv_bias"] else None
        self.dt_bias = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.A = nn.Parameter(torch.zeros(self.heads), requires_grad=False)   # -exp(A_log), as llama.cpp stores it
        self.D = nn.Parameter(torch.ones(self.heads), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.inner), requires_grad=False)
        self.out_proj = nn.Linear(self.inner, config.hidden_size, bias=m["proj_bias"])

    @staticmethod
    def state_size(config: ModelArchConfig) -> int:
        m = config.mamba
        conv_dim = m["intermediate"] + 2 * m["groups"] * m["d_state"]
        return conv_dim * (m["d_conv"] - 1) + m["heads"] * m["head_dim"] * m["d_state"]

    def _split(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A flat state as (the convolution's last inputs [conv_dim, d_conv - 1], S [heads, head_dim, d_state])."""
        k = self.conv_dim * (self.d_conv - 1)
        return state[:k].view(self.conv_dim, self.d_conv - 1), state[k:].view(self.heads, self.head_dim, self.d_state)

    def _store(self, target: torch.Tensor, window: torch.Tensor, ssm: torch.Tensor) -> None:
        conv, s = self._split(target)
        conv.copy_(window)
        s.copy_(ssm)

    def forward(self, x: torch.Tensor, cache: StateCache, meta: AttentionMetadata) -> torch.Tensor:
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = self.scan(xbc, dt, cache, meta)
        # The gated RMSNorm, per group of channels, in float32.
        z = (y * F.silu(gate.float())).view(-1, self.groups, self.inner // self.groups)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.out_proj((self.norm_weight.float() * z.view(-1, self.inner)).to(x.dtype))

    def scan(self, xbc: torch.Tensor, dt: torch.Tensor, cache: StateCache, meta: AttentionMetadata) -> torch.Tensor:
        """The convolution and the scan of every sequence of the step: y [T, inner] (S C + D x,
        before the gate), in float32; the slots' and the checkpointed blocks' states updated.
        Decodes (one token each, the step's first rows) in one batch, but those starting from
        a prefix hit's block end; then the rest token by token, those restoring last."""
        plan: StepStates = meta.states
        y = torch.empty(xbc.shape[0], self.inner, dtype=torch.float32, device=xbc.device)
        ops = state_kernels(cache.slots, meta)
        if ops is not None and xbc.dtype == torch.float32:
            # pagoda's C++ kernel (pagoda/csrc/recurrent.cpp), every sequence in place in its slot.
            bias = None if self.conv_bias is None else self.conv_bias.float()
            for restores, take, args in kernel_calls(meta):
                for slot, entry in restores:
                    cache.slots[slot] = cache.blocks[entry]
                part = y[take] if isinstance(take, slice) else torch.empty(len(take), self.inner)
                ops.mamba2_scan(cache.slots, args[0], args[1], xbc[take], dt[take], self.conv_weight.float(), bias,
                                self.dt_bias.float(), self.A.float(), self.D.float(), self.dt_min, self.dt_max, part,
                                cache.blocks, *args[2:], self.heads, self.head_dim, self.groups, self.d_state)
                if not isinstance(take, slice):
                    y[take] = part
            return y
        batch = [i for i in range(meta.num_decodes) if plan.restore[i] < 0]
        if batch:
            self._decode(xbc, dt, y, cache, plan, batch)
        spans = sequence_spans(meta)
        for i in processing_order(plan):
            if i >= meta.num_decodes or plan.restore[i] >= 0:
                a, n, context = spans[i]
                self._sequence(xbc[a:a + n], dt[a:a + n], y[a:a + n], cache, plan, i, context > 0)
        return y

    def _ssm_inputs(self, conv_out: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolution's output [n, conv_dim] and dt [n, heads] as x [n, heads, head_dim],
        B and C [n, heads, d_state] (each head its group's) and the time step [n, heads], float32."""
        n, rep, gs = conv_out.shape[0], self.heads // self.groups, self.groups * self.d_state
        xs, B, C = conv_out.float().split([self.inner, gs, gs], -1)
        B = B.view(n, self.groups, self.d_state).repeat_interleave(rep, dim=1)
        C = C.view(n, self.groups, self.d_state).repeat_interleave(rep, dim=1)
        step = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        return xs.view(n, self.heads, self.head_dim), B, C, step

    def _decode(self, xbc, dt, y, cache: StateCache, plan: StepStates, batch: list[int]) -> None:
        """One token of each decoding sequence of ``batch`` (sequence i is row i), their states
        gathered from their slots, updated together and written back (and to a block's end
        they complete)."""
        n = len(batch)
        if n < batch[-1] + 1:
            rows = torch.tensor(batch, device=xbc.device)
            xbc, dt = xbc.index_select(0, rows), dt.index_select(0, rows)
        else:
            rows = None
            xbc, dt = xbc[:n], dt[:n]
        slots = torch.tensor([plan.slots[i] for i in batch], device=xbc.device)
        state = cache.slots.index_select(0, slots)
        keep = self.d_conv - 1
        split = self.conv_dim * keep
        window = torch.cat((state[:, :split].view(n, self.conv_dim, keep).to(xbc.dtype), xbc[:, :, None]), dim=-1)
        conv = (window * self.conv_weight.to(xbc.dtype)).sum(-1)                  # [n, conv_dim]
        if self.conv_bias is not None:
            conv = conv + self.conv_bias.to(conv.dtype)
        xs, B, C, step = self._ssm_inputs(F.silu(conv), dt)
        ssm = state[:, split:].view(n, self.heads, self.head_dim, self.d_state).float()
        ssm = ssm * torch.exp(step * self.A.float())[:, :, None, None] + (step[:, :, None] * xs)[..., None] * B[:, :, None]
        out = (torch.einsum("nhps,nhs->nhp", ssm, C) + self.D.float()[:, None] * xs).reshape(n, -1)
        if rows is None:
            y[:n] = out
        else:
            y.index_copy_(0, rows, out)
        new = torch.cat((window[:, :, 1:].reshape(n, -1).to(state.dtype), ssm.reshape(n, -1).to(state.dtype)), dim=-1)
        cache.slots.index_copy_(0, slots, new)
        for j, i in enumerate(batch):
            for _, block in plan.checkpoints[i]:
                cache.blocks[block] = new[j]

    def _sequence(self, xbc, dt, y, cache: StateCache, plan: StepStates, i: int, context: bool) -> None:
        """A prompt chunk of sequence ``i`` (or a decode restoring a block's end), token by
        token, from its slot's state (or a prefix hit's block end, or zeros for its first
        chunk); the state stored at every block end it completes and in its slot."""
        n, keep, slot = xbc.shape[0], self.d_conv - 1, plan.slots[i]
        if plan.restore[i] >= 0:
            cache.slots[slot] = cache.blocks[plan.restore[i]]
        if context:
            conv, s = self._split(cache.slots[slot])
            before, ssm = conv.to(xbc.dtype), s.float().clone()
        else:
            before = xbc.new_zeros(self.conv_dim, keep)
            ssm = torch.zeros(self.heads, self.head_dim, self.d_state, device=xbc.device)
        window = torch.cat((before, xbc.t()), dim=-1)                             # [conv_dim, keep + n]
        weight, bias = self.conv_weight.to(xbc.dtype), None if self.conv_bias is None else self.conv_bias.to(xbc.dtype)
        conv_out = F.silu(F.conv1d(window[None], weight[:, None, :], bias, groups=self.conv_dim)[0].t())
        xs, B, C, step = self._ssm_inputs(conv_out, dt)
        A, D = self.A.float(), self.D.float()[:, None]
        ends = dict(plan.checkpoints[i])
        for t in range(n):
            ssm = ssm * torch.exp(step[t] * A)[:, None, None] + (step[t][:, None] * xs[t])[:, :, None] * B[t][:, None, :]
            y[t] = (torch.einsum("hpn,hn->hp", ssm, C[t]) + D * xs[t]).reshape(-1)
            block = ends.get(t + 1)
            if block is not None:
                self._store(cache.blocks[block], window[:, t + 1:t + 1 + keep], ssm)
        self._store(cache.slots[slot], window[:, -keep:], ssm)
