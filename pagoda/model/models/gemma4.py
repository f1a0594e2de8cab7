"""Gemma 4 (text; the 31B dense and 26B-A4B MoE checkpoints, and the language model of
``Gemma4ForConditionalGeneration``): Gemma 3's five windowed layers to one global, its
sandwich norms (plain weights here, not 1 + w) and tanh-GELU MLP, with what is new:

- the global layers' heads are wider and fewer (``global_head_dim``,
  ``num_global_key_value_heads``, or ``per_layer_config``): per-layer cache shapes, which
  the KV layout keeps in buffers of their own shape (``pagoda/core/kv_layout.py``);
- ``attention_k_eq_v``: a global layer's values are its keys' projection (no v_proj in the
  checkpoint; the loader fills the value rows with the key's), normed per head without a
  weight (every layer's values are) while the keys get their weighted norm and RoPE;
- the attention scale is 1 (the q/k norms set the scale);
- RoPE: base 10^4 on the windowed layers; "proportional" on the global ones (base 10^6, the
  first quarter of each half-head's frequencies turning, the rest still);
- the MoE variant: beside each layer's dense MLP, experts routed on the stream (an unweighted
  RMSNorm, a learned scale and 1 / sqrt(hidden) before the router; softmax, top-k renormalised,
  times a per-expert scale), each path with norms of its own, their sum normed;
- ``layer_scalar``: each layer's output stream times a learned scalar;
- E2B / E4B: per-layer inputs (a per-layer embedding of each token averaged with a normed
  projection of its embedding; each layer adds a projection of its slice gated by the stream),
  the last ``num_kv_shared_layers`` layers reading the KV cache of the last earlier layer of
  their type (no keys or values of their own: a mechanism of the shared attention), and
  double-wide MLPs there (``use_double_wide_mlp``).

Refused by name: bidirectional attention ("all")."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, moe_fields
from pagoda.model.layers.decoder import CausalLM, DecoderLayer, GatedMLP, SparseMoeBlock, split_stacked_experts
from pagoda.model.layers.hybrid import renamed
from pagoda.model.layers.norm import RMSNorm, UnitRMSNorm

# transformers' Gemma4TextConfig defaults a checkpoint's config.json may leave out.
TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "sliding_window": 512, "max_position_embeddings": 131072,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
}
WINDOW_PATTERN = 6   # transformers' default: five windowed layers to one global
_RENAMES = ((".router.proj.", ".moe.gate."), (".router.scale", ".moe.router_scale"),
            (".router.per_expert_scale", ".moe.per_expert_scale"))
# The model's names as the gguf library's table knows llama.cpp's (router and expert scales
# beside the router and the down experts).
_GGUF_NAMES = ((".moe.gate.", ".router.proj."), (".moe.router_scale", ".router.proj.scale"),
               (".moe.per_expert_scale", ".mlp.experts.down_proj.scale"), (".moe.experts.", ".mlp.experts."))


class Gemma4Moe(SparseMoeBlock):
    """Gemma 4's experts: routed on the layer's stream through an unweighted RMSNorm, a
    learned scale and 1 / sqrt(hidden); softmax, top-k renormalised, each chosen expert's
    weight times its learned scale."""

    stack_layout = "gemma4"   # the C++ decode stack runs this routing (pagoda/model/layers/decode_stack.py)

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.router_norm = UnitRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.router_scale = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts), requires_grad=False)
        self.root = config.hidden_size ** -0.5

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights, ids, picks = super().route(self.router_norm(x) * self.router_scale * self.root)
        return weights * self.per_expert_scale.float()[ids], ids, picks


class Gemma4DecoderLayer(DecoderLayer):
    stack_layout = "gemma4"   # the C++ decode stack runs this forward (pagoda/model/layers/decode_stack.py)

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        if config.layer_intermediate_sizes is not None:   # double-wide MLPs on the KV-sharing layers
            self.mlp = GatedMLP(config, config.layer_intermediate_sizes[layer_idx])
        # Per-layer inputs (E2B / E4B): this layer's slice of the step's, from the model's embed.
        self.per_layer: dict[str, torch.Tensor] | None = None
        if config.per_layer_input_size:
            p = config.per_layer_input_size
            self.per_layer_input_gate = nn.Linear(h, p, bias=False)
            self.per_layer_projection = nn.Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.moe = None
        if config.is_moe_layer(layer_idx):
            # The dense MLP stays; the experts run beside it, each path normed on its own.
            self.mlp = GatedMLP(config)
            self.moe = Gemma4Moe(config)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        h = self.mlp(h)
        if self.moe is not None:   # residual: the stream after attention, the experts' input
            routed = self.moe.experts_forward(self.pre_feedforward_layernorm_2(residual), *self.moe.route(residual))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        h = self.post_feedforward_layernorm(h)
        if self.per_layer is not None:
            # The stream, then a residual of the layer's per-layer input gated by the stream.
            inputs = self.per_layer.get("inputs")
            if inputs is None:
                raise RuntimeError("Gemma 4 per-layer inputs are computed by the model's embed (not on this "
                                   "pipeline stage)")
            stream = residual.add_(h)
            g = F.gelu(self.per_layer_input_gate(stream), approximate="tanh") * inputs[:, self.layer_idx]
            h, residual = self.post_per_layer_input_norm(self.per_layer_projection(g)), stream
        # The layer's output stream (residual + h) times its scalar.
        return h * self.layer_scalar, residual.mul_(self.layer_scalar)


def _kv_sources(types: list[str], shared: int) -> tuple[int | None, ...]:
    """Per layer the layer whose KV cache it reads: the last ``shared`` layers read the last
    earlier layer of their own type (transformers' kv_sharing_modes); the others their own."""
    n = len(types)
    first = n - shared
    if shared and not 0 < first:
        raise UnsupportedModelError(f"Gemma 4: {shared} KV-sharing layers of {n}")
    out: list[int | None] = []
    for i, t in enumerate(types):
        if i < first:
            out.append(None)
            continue
        sources = [j for j in range(first) if types[j] == t]
        if not sources:
            raise UnsupportedModelError(f"Gemma 4: layer {i} ({t}) shares the KV of no earlier layer of its type")
        out.append(sources[-1])
    return tuple(out)


def _layer_geometry(config: dict[str, Any], types: list[str]) -> tuple[list[int], list[int]]:
    """(head size, KV heads) per layer: the global layers' own (``per_layer_config``, or
    ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``)."""
    head_dim, kv = config.get("head_dim", 256), config.get("num_key_value_heads") or config["num_attention_heads"]
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        full: dict[str, Any] = {"head_dim": config.get("global_head_dim", 512)}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    dims, heads = [], []
    for i in range(len(types)):
        over = per_layer.get(str(i)) or per_layer.get(i) or {}   # type: ignore[call-overload]
        unknown = set(over) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedModelError(f"Gemma 4 per_layer_config {sorted(unknown)} is not supported")
        dims.append(int(over.get("head_dim", head_dim)))
        heads.append(int(over.get("num_key_value_heads", kv)))
    return dims, heads


class Gemma4ForCausalLM(CausalLM):
    layer_cls = Gemma4DecoderLayer

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        p = config.per_layer_input_size
        if p:
            n = config.num_hidden_layers
            weight = torch.empty(config.per_layer_vocab_size, n * p)
            self.model.embed_tokens_per_layer = nn.Embedding(config.per_layer_vocab_size, n * p, _weight=weight)
            self.model.per_layer_model_projection = nn.Linear(config.hidden_size, n * p, bias=False)
            self.model.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps)
            self.per_layer: dict[str, torch.Tensor] = {}   # the step's per-layer inputs [T, layers, p]
            for layer in self.model.layers:
                if isinstance(layer, Gemma4DecoderLayer):
                    layer.per_layer = self.per_layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        if self.config.per_layer_input_size:
            self.per_layer_inputs(input_ids, x)
        return x

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        """The step's per-layer inputs (E2B, E4B): the token's own per-layer embedding
        (x sqrt(p)) and a projection of its embedding ``x`` (x 1 / sqrt(hidden), RMS-normed
        per layer), averaged (x 1 / sqrt(2))."""
        p = self.config.per_layer_input_size
        t, n = x.shape[0], self.config.num_hidden_layers
        own = self.model.embed_tokens_per_layer(input_ids).view(t, n, p) * float(p) ** 0.5
        proj = self.model.per_layer_model_projection(x) * self.config.hidden_size ** -0.5
        proj = self.model.per_layer_projection_norm.rows(proj.view(t, n, p))
        self.per_layer["inputs"] = (proj + own) * 2.0 ** -0.5
    unquantized_modules = (".moe.gate",)
    tensor_parallel = False   # (per-layer head shapes: not split yet)
    lora = False              # (adapters over per-layer head shapes: not tested yet)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _RENAMES)

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor,
                   checkpoint: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, Any]]:  # fmt: skip
        ours = cls.hf_name(name)
        if ours is None or ".experts." not in ours or ours.endswith(".weight"):
            yield from super().hf_tensors(name, tensor, checkpoint)
            return
        base, _, proj = ours.replace(".experts.", ".moe.experts.").rpartition(".")
        yield from split_stacked_experts(base, proj, tensor, transposed=False)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        config = {**TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if config.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError("bidirectional attention is not supported")
        n = config["num_hidden_layers"]
        types = config.get("layer_types") or ["sliding_attention" if (i + 1) % WINDOW_PATTERN else "full_attention"
                                              for i in range(n)]
        types = [*types[:-1], "full_attention"]   # transformers forces the last layer global
        config = {**config, "layer_types": types}
        fields = ModelArchConfig.hf_fields(config, architecture)
        dims, heads = _layer_geometry(config, types)
        moe = {}
        if config.get("enable_moe_block"):
            moe = moe_fields(config["num_experts"], config["top_k_experts"], config["moe_intermediate_size"], True)
        sources = _kv_sources(types, int(config.get("num_kv_shared_layers") or 0))
        widths = None
        if config.get("use_double_wide_mlp") and any(src is not None for src in sources):
            widths = tuple(fields["intermediate_size"] * (2 if src is not None else 1) for src in sources)
        return ModelArchConfig(
            **fields, **moe,
            kv_source=sources if any(src is not None for src in sources) else None,
            layer_intermediate_sizes=widths,
            per_layer_input_size=int(config.get("hidden_size_per_layer_input") or 0),
            per_layer_vocab_size=int(config.get("vocab_size_per_layer_input") or fields["vocab_size"]),
            qk_norm="head", v_norm=True, norm_placement="sandwich",
            layer_head_dims=tuple(dims) if len(set(dims)) > 1 else None,
            layer_kv_heads=tuple(heads) if len(set(heads)) > 1 else None,
            value_from_key=tuple(bool(config.get("attention_k_eq_v")) and t == "full_attention" for t in types),
            attention_multiplier=1.0, o_proj_bias=fields["attention_bias"],
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            final_logit_softcapping=config.get("final_logit_softcapping") or None)


    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        return renamed(name, _GGUF_NAMES)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        widths = md.get(p + "feed_forward_length")
        if isinstance(widths, list):   # per layer: double-wide MLPs on the KV-sharing layers
            md = {**md, p + "feed_forward_length": widths[0]}
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        n = fields["num_hidden_layers"]
        swa = md.get(p + "attention.sliding_window_pattern")
        if not isinstance(swa, list) or len(swa) < n:
            raise UnsupportedModelError("gemma4 GGUF: attention.sliding_window_pattern must flag every layer")
        types = ["sliding_attention" if swa[i] else "full_attention" for i in range(n)]
        kv = md.get(p + "attention.head_count_kv")
        kv = list(kv) if isinstance(kv, list) else [kv or fields["num_attention_heads"]] * n
        full_dim, swa_dim = int(md[p + "attention.key_length"]), int(md[p + "attention.key_length_swa"])
        if int(md.get(p + "rope.dimension_count_swa") or swa_dim) != swa_dim:
            raise UnsupportedModelError("gemma4 GGUF: partial rotary on the windowed layers is not supported")
        dims = [swa_dim if t == "sliding_attention" else full_dim for t in types]
        moe = {}
        if md.get(p + "expert_count"):
            moe = moe_fields(md[p + "expert_count"], md[p + "expert_used_count"],
                             md[p + "expert_feed_forward_length"], True)
        local_theta = float(md.get(p + "rope.freq_base_swa") or 10000.0)
        sources = _kv_sources(types, int(md.get(p + "attention.shared_kv_layers") or 0))
        widths = tuple(widths[:n]) if isinstance(widths, list) and len(set(widths[:n])) > 1 else None
        return ModelArchConfig(
            kv_source=sources if any(src is not None for src in sources) else None,
            layer_intermediate_sizes=widths,
            per_layer_input_size=int(md.get(p + "embedding_length_per_layer_input") or 0),
            per_layer_vocab_size=fields["vocab_size"],
            **{**fields, "head_dim": swa_dim, "num_key_value_heads": kv[types.index("sliding_attention")]
               if "sliding_attention" in types else kv[0], "hidden_act": "gelu_pytorch_tanh",
               "layer_types": tuple(types), "local_rope_theta": local_theta},
            **moe,
            qk_norm="head", v_norm=True, norm_placement="sandwich",
            layer_head_dims=tuple(dims) if len(set(dims)) > 1 else None,
            layer_kv_heads=tuple(kv[:n]) if len(set(kv[:n])) > 1 else None,
            value_from_key=tuple(f"blk.{i}.attn_v.weight" not in tensor_names for i in range(n)),
            attention_multiplier=1.0, o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            final_logit_softcapping=md.get(p + "final_logit_softcapping") or None)
