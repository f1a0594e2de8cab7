"""Mamba-2 (Granite 4.0-H, pagoda/model/models/granite_hybrid.py; other Mamba-2 hybrids):
the hidden state is projected to a gate z, the convolution's input xBC and a time step per
head; a depthwise causal convolution (width d_conv, SiLU) over xBC gives x, B and C (B and C
per group of heads); then per head h, with dt = softplus(dt + dt_bias) and A = -exp(A_log),
the state S [head_dim, d_state] runs

    S <- exp(dt A) S + dt x B^T,     y = S C + D x,

and the output is out_proj(RMSNorm_groups(y * silu(z))). What a request carries from one
step to the next, in its slot of the state pool (pagoda/core/state_pool.py), is the
convolution's last d_conv - 1 inputs and every head's S, one flat vector per layer; with
prefix caching, both at checkpointed block ends too (pagoda/attention/state.py). The scan
runs token by token in torch here (exact; a chunked C++ scan is the next step).

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
from pagoda.model.layers.hybrid import processing_order, sequence_spans


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
        self.A_log = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
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
        plan: StepStates = meta.states
        spans = sequence_spans(meta)
        weight = self.conv_weight.to(x.dtype)
        A = -torch.exp(self.A_log.float())
        keep = self.d_conv - 1
        y = torch.empty(x.shape[0], self.inner, dtype=torch.float32, device=x.device)
        rep = self.heads // self.groups
        for i in processing_order(plan):
            a, n, context = spans[i]
            slot = plan.slots[i]
            if plan.restore[i] >= 0:
                cache.slots[slot] = cache.blocks[plan.restore[i]]
            if context:
                conv, s = self._split(cache.slots[slot])
                before, ssm = conv.to(x.dtype), s.float().clone()
            else:
                before = x.new_zeros(self.conv_dim, keep)
                ssm = torch.zeros(self.heads, self.head_dim, self.d_state, device=x.device)
            window = torch.cat((before, xbc[a:a + n].t()), dim=-1)             # [conv_dim, keep + n]
            conv_out = F.silu(F.conv1d(window[None], weight[:, None, :], self.conv_bias, groups=self.conv_dim)[0].t())
            xs, B, C = conv_out.float().split([self.inner, self.groups * self.d_state, self.groups * self.d_state], -1)
            xs = xs.view(n, self.heads, self.head_dim)
            B = B.view(n, self.groups, self.d_state).repeat_interleave(rep, dim=1)   # [n, heads, d_state]
            C = C.view(n, self.groups, self.d_state).repeat_interleave(rep, dim=1)
            step = F.softplus(dt[a:a + n].float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)  # [n, heads]
            ends = dict(plan.checkpoints[i])
            for t in range(n):
                ssm = ssm * torch.exp(step[t] * A)[:, None, None] + (step[t][:, None] * xs[t])[:, :, None] * B[t][:, None, :]
                y[a + t] = (torch.einsum("hpn,hn->hp", ssm, C[t]) + self.D.float()[:, None] * xs[t]).reshape(-1)
                block = ends.get(t + 1)
                if block is not None:
                    self._store(cache.blocks[block], window[:, t + 1:t + 1 + keep], ssm)
            self._store(cache.slots[slot], window[:, -keep:], ssm)
        # The gated RMSNorm, per group of channels, in float32.
        z = (y * F.silu(gate.float())).view(-1, self.groups, self.inner // self.groups)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.out_proj((self.norm_weight.float() * z.view(-1, self.inner)).to(x.dtype))
