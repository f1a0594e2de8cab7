"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) as a plain torch module.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
stacked into one projection each (one GEMM instead of three or two); the
loader maps the checkpoint's separate tensors into their row ranges
(``stacked_param``).
The model takes a flat batch of tokens from many requests plus the attention
metadata for this step; it knows nothing of scheduling or parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig
from pagoda.model.attention import AttentionMetadata, kernel_cache, paged_attention
from pagoda.ops import cpu_kernels


def _fused_ops(x: torch.Tensor):
    """pagoda's C++ ops for this tensor, or None (not float32 on CPU, or not built)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return cpu_kernels.kernels()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual), the sum
        written into ``residual`` in place (one fused op on CPU)."""
        ops = _fused_ops(x)
        if ops is not None and x.dim() == 2:
            if residual is None:
                return ops.rms_norm(x.contiguous(), self.weight, self.eps, None)
            return ops.rms_norm(x.contiguous(), self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelArchConfig) -> torch.Tensor:
    dim = config.head_dim
    # On the CPU even under a meta-device context (where factory functions go through
    # torch._refs and import torch._dynamo, seconds of start-up).
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
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
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x [T, heads, D]; cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        h = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM (the loader fills the three row ranges).
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,      # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        ops = _fused_ops(qkv)
        if ops is not None:
            # One op: rotary q and k, and (a cache the kernels write) k and v into their slots.
            cache, scales = kernel_cache(kv_cache) or (None, None)
            in_place = cache is not None
            q, k, v = ops.rope_qkv(qkv, cos.view(t, -1), sin.view(t, -1), self.num_heads, self.num_kv_heads,
                                   cache, meta.slot_mapping if in_place else None, scales)
            o = paged_attention(q, k, v, kv_cache, meta, self.scale, kv_written=in_place)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
            k = apply_rope(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
            o = paged_attention(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.intermediate_size = i
        # gate and up in one GEMM (rows [0, i) and [i, 2i)).
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = _fused_ops(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.shape[1] % 64 == 0:
            # One pass, the same bits as the line below (torch's own SLEEF exp).
            return self.down_proj(ops.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block; the residual stream is carried separately so each "add,
        then norm" is one fused op: returns (this layer's output, the stream before it)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        # nn.Embedding's own init (normal_) on the meta device, where the loader builds
        # the model, goes through torch._refs and imports torch._dynamo: ~2.8 s of start.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Checkpoint projection -> (stacked parameter, shard index). Shard i of a
# stacked weight is a contiguous row range, in this order.
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def shard_rows(self, stacked: str, shard: int) -> tuple[int, int]:
        """Row range [start, end) of a shard inside a stacked projection (read from
        the layers, which hold only a rank's heads under tensor parallelism)."""
        layer = self.model.layers[0]
        if stacked == "qkv_proj":
            q, kv = layer.self_attn.q_size, layer.self_attn.kv_size
            bounds = [0, q, q + kv, q + 2 * kv]
        else:
            i = layer.mlp.intermediate_size
            bounds = [0, i, 2 * i]
        return bounds[shard], bounds[shard + 1]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        num_layers: int | None = None,  # run only the first num_layers (a layer-skip draft)
    ) -> torch.Tensor:                  # hidden states [T, hidden]
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        residual = None
        for layer, kv_cache in zip(layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
