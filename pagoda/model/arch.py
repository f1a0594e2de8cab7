"""Architecture hyper-parameters, read from an HF config.json or GGUF metadata.

``ModelArchConfig`` is the one record every family fills; each family's class
(``pagoda.model.models``) parses its own config (``arch_from_hf`` / ``arch_from_gguf``),
starting from the fields every decoder shares (``hf_fields`` / ``gguf_fields``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagoda.model.layers.rotary import SUPPORTED_ROPE_SCALING, rope_kind
from pagoda.model.models import GGUF_ARCHITECTURES, UnsupportedModelError, hf_architectures, model_class

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")


def base_model_family(architecture: str) -> str | None:
    """The causal-LM family of a transformers base-model name ("Qwen3Model" ->
    "Qwen3ForCausalLM"), if pagoda serves that family; else None."""
    if not architecture.endswith("Model"):
        return None
    family = architecture[: -len("Model")] + "ForCausalLM"
    return family if family in hf_architectures() else None


def classifier_family(architecture: str) -> str | None:
    """The causal-LM family of a transformers sequence-classification name
    ("Qwen3ForSequenceClassification" -> "Qwen3ForCausalLM"), if pagoda serves that family as
    a decoder with a score head over its last hidden state; else None."""
    if not architecture.endswith("ForSequenceClassification"):
        return None
    family = architecture[: -len("ForSequenceClassification")] + "ForCausalLM"
    return family if family in hf_architectures() else None


def hf_num_labels(config: dict[str, Any]) -> int:
    """A classification config's labels: its id2label's, else num_labels (transformers' default 2)."""
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else int(config.get("num_labels", 2))


def periodic_layer_types(num_layers: int, period: int) -> tuple[str, ...]:
    """Windowed layers with every period-th one global: period 2 alternates, the first
    windowed (Gemma 2, GPT-OSS); 6 is Gemma 3's five local to one global."""
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers))


def gguf_layer_types(md: dict[str, Any], n: int, default_pattern: int) -> tuple[str, ...]:
    """llama.cpp's windowed layers: ``attention.sliding_window_pattern`` as one flag per
    layer or as a period (every period-th layer global), else the architecture's period."""
    pattern = md.get(f"{md['general.architecture']}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) < n:
            raise UnsupportedModelError(f"sliding_window_pattern has {len(pattern)} entries for {n} layers")
        return tuple("sliding_attention" if flag else "full_attention" for flag in pattern[:n])
    return periodic_layer_types(n, int(pattern))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal checkpoint (``text_config``), with the
    outer config's tie_word_embeddings where it has one: transformers ties the head by the
    outer config (Qwen3-VL-MoE's text config says true under an outer false, and its
    checkpoints hold a head of their own)."""
    text = dict(config.get("text_config") or {})
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first of ``prefixes``' (old, new) pairs it starts with replaced; as it
    is when none: a multimodal checkpoint's names as its family holds them."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def moe_fields(experts: int, per_token: int, intermediate: int, norm_topk_prob: bool) -> dict[str, Any]:
    """The mixture-of-experts fields of a ModelArchConfig."""
    return dict(num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=intermediate,
                norm_topk_prob=norm_topk_prob)


def gguf_moe_layers(tensor_names: set[str], layers: int) -> tuple[bool, ...] | None:
    """Which layers of a GGUF file have experts (a router, ``ffn_gate_inp``); None: all."""
    moe = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers))
    return None if all(moe) else moe


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    sliding_window: int | None = None
    # Family options (their defaults are Llama's).
    qk_norm: str | None = None               # "head" (per head) | "full" (whole projection) | None
    qk_norm_layers: tuple[bool, ...] | None = None  # per layer whether it has them (None: all do)
    qk_norm_weights: bool = True             # False: RMSNorms without a weight (Llama 4's L2 norm)
    v_norm: bool = False                     # Gemma 4: values RMS-normed per head, without a weight
    # Per layer, where layers differ (Gemma 4's global layers: wider heads, fewer KV heads): the
    # head size and KV heads (None: head_dim and num_key_value_heads everywhere).
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    # Per layer whether its values are its keys' projection (Gemma 4's attention_k_eq_v: the
    # checkpoint has no v_proj there; the loader fills the value rows with the key's).
    value_from_key: tuple[bool, ...] | None = None
    # Per layer, the earlier layer whose KV cache it reads (Gemma 4 E2B / E4B's shared KV: no
    # keys or values of its own), or None for its own (None: every layer its own).
    kv_source: tuple[int | None, ...] | None = None
    # kv_source names layers of another model: a Gemma 4 assistant's over its target's caches.
    kv_source_external: bool = False
    # Per layer the dense MLP's width where layers differ (Gemma 4's double-wide MLPs).
    layer_intermediate_sizes: tuple[int, ...] | None = None
    # The longest context the model is served at, where its attention is exact only up to it
    # (DeepSeek-V3.2: below its indexer's top-k every key is chosen); None: no such bound.
    context_limit: int | None = None
    # Per-layer inputs (Gemma 4 E2B / E4B's per-layer embeddings): their width per layer (0:
    # none) and the vocabulary of their embedding table.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    qk_norm_after_rope: bool = False         # HunYuan: the per-head q/k norms of the rotated heads
    # Attention-temperature tuning (Llama 4) on the layers without RoPE: (floor_scale, scale),
    # queries at position p x (log(floor((p + 1) / floor_scale) + 1) * scale + 1).
    attn_temperature: tuple[float, float] | None = None
    rope_layers: tuple[bool, ...] | None = None  # per layer whether it applies RoPE (None: all do)
    # "pre" (before attention and MLP) | "post" (of their outputs: OLMo 2) | "sandwich" (both: Gemma)
    norm_placement: str = "pre"
    # The gated MLP's: "silu" | "gelu_pytorch_tanh" | "swiglu_oai" (GPT-OSS: gate and up clamped
    # to swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
    hidden_act: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Per layer "full_attention" | "sliding_attention" | "chunked_attention" (None: every
    # layer is windowed when sliding_window is set, else none is).
    layer_types: tuple[str, ...] | None = None
    # Chunked local attention (Llama 4): a "chunked_attention" layer's query at position i
    # sees keys j with i // chunk == j // chunk and j <= i.
    attention_chunk_size: int | None = None
    local_rope_theta: float | None = None    # RoPE base of the windowed layers (Gemma 3), unscaled
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    rotary_dim: int | None = None            # partial rotary: the first rotary_dim of each head (None: all)
    # Mixture of experts: num_experts > 0 replaces the MLP of the layers moe_layers marks
    # (None: every layer) by a router over experts of moe_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True              # renormalise the chosen experts' weights to sum 1
    norm_topk_min: float = 0.0               # ERNIE 4.5: ... divided by max(their sum, this)
    # Llama 4: each chosen expert's weight scales its input (not its output); the choice is
    # the top router logits, the weights their sigmoids.
    expert_weights_on_input: bool = False
    moe_layers: tuple[bool, ...] | None = None
    routed_scaling_factor: float = 1.0       # DeepSeek: the routed experts' weights x this
    num_shared_experts: int = 0              # DeepSeek: an MLP of that many experts' width, every token
    # Qwen2-MoE style: a shared expert of its own width (0: num_shared_experts x the experts'),
    # its output scaled per token by sigmoid(shared_expert_gate(x)) where the flag is set.
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Group-limited routing: (groups, groups kept per token), experts only from the kept
    # groups, ranked by their best expert ("max": DeepSeek-V2) or their best two's sum
    # ("top2": V3); None: all experts compete.
    expert_groups: tuple[int, int] | None = None
    expert_group_score: str = "max"
    # The router's scores: "softmax" (most) or "sigmoid" (DeepSeek-V3, whose per-expert
    # bias, expert_score_bias, moves the choice of experts but not their weights).
    expert_scoring: str = "softmax"
    expert_score_bias: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank > 0): K and V are one
    # compressed latent of kv_lora_rank per token plus a shared rotary key of
    # qk_rope_head_dim; head_dim is then the cached width (their sum), rotary_dim the latter.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    mla_rope_interleaved: bool = True        # the rotary dimensions as pairs (transformers' DeepSeek)
    embedding_multiplier: float = 1.0        # Granite's multipliers
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None   # the attention scale (None: 1 / sqrt(head_dim))
    logits_divisor: float = 1.0
    # GPT-OSS: a learned logit per query head that joins every softmax (a key with no value),
    # biases on the output projection, the router and the experts' projections.
    attention_sinks: bool = False
    o_proj_bias: bool = False
    router_bias: bool = False
    mlp_bias: bool = False
    # False: an embedding checkpoint with no LM head (transformers' base model, e.g. Qwen3Model);
    # its head is tied to the embedding, never used (pagoda/pooling.py).
    has_lm_head: bool = True
    # A sequence-classification checkpoint (Qwen3ForSequenceClassification; BERT's): the rows
    # of its score head over the pooled hidden state, one per label (0: none).
    num_labels: int = 0
    # An encoder-only model (BERT): its own geometry (type_vocab_size, layer_norm_eps,
    # hidden_act: pagoda/model/models/bert.py); every token attends to its whole prompt, so
    # the scheduler computes a prompt in one step. None: a decoder.
    encoder: dict[str, Any] | None = field(default=None, hash=False)
    # Hybrid models (LFM2): per layer whether it is a gated short convolution (a fixed-size
    # state per request, no KV cache) instead of attention; its kernel width and bias.
    conv_layers: tuple[bool, ...] | None = None
    conv_kernel: int = 0
    conv_bias: bool = False
    # Hybrid models with Mamba-2 layers (Granite 4.0-H): per layer whether it is one, and
    # their geometry: heads, head_dim, groups, d_state, d_conv, intermediate, conv_bias,
    # proj_bias, dt_min, dt_max (pagoda/model/models/granite_hybrid.py).
    mamba_layers: tuple[bool, ...] | None = None
    mamba: dict[str, Any] | None = field(default=None, hash=False)
    # Hybrids with Gated DeltaNet layers (Qwen3.5, Qwen3-Next): per layer whether it is one,
    # and their geometry: k_heads, v_heads, k_dim, v_dim, conv_kernel
    # (pagoda/model/layers/gated_deltanet.py).
    linear_attn_layers: tuple[bool, ...] | None = None
    linear_attn: dict[str, Any] | None = field(default=None, hash=False)
    # Vision-language models: the vision tower's and connector's geometry as the family reads
    # it (pagoda/model/models/idefics3.py), with ``image_token_id``; None: text only.
    vision: dict[str, Any] | None = field(default=None, hash=False)
    # Qwen3-Next / Qwen3.5 attention: q_proj also yields a gate per query head's output
    # (o = attention * sigmoid(gate)), its rows interleaved with the query's per head.
    attn_output_gate: bool = False
    # M-RoPE (Qwen2-VL and later): frequencies per position row (temporal, height, width),
    # contiguous or interleaved (Qwen3-VL); positions are then [3, T] where a step holds an
    # image's tokens (pagoda/model/layers/rotary.py). None: one position per token.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in hf_architectures():
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(hf_architectures())}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        kind = rope_kind(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_SCALING:
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported; supported: {SUPPORTED_ROPE_SCALING}")
        if self.qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {self.qk_norm!r}")
        if self.qk_norm_after_rope and self.qk_norm != "head":
            raise ValueError(f"q/k norms after RoPE are per head, not {self.qk_norm!r}")
        if self.norm_placement not in ("pre", "post", "sandwich"):
            raise ValueError(f"norm_placement must be 'pre', 'post' or 'sandwich', got {self.norm_placement!r}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                                        f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - {"full_attention", "sliding_attention", "chunked_attention"}
            if unknown:
                raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")
            if "chunked_attention" in self.layer_types and not (self.attention_chunk_size or 0) > 0:
                raise ValueError("chunked_attention layers need an attention_chunk_size")
        if self.kv_source is not None and not self.kv_source_external and any(
                src is not None and not 0 <= src < i for i, src in enumerate(self.kv_source)):
            raise ValueError(f"kv_source {self.kv_source}: a layer reads an earlier layer's cache")
        for name in ("rope_layers", "qk_norm_layers", "layer_head_dims", "layer_kv_heads", "value_from_key",
                     "kv_source", "layer_intermediate_sizes"):
            flags = getattr(self, name)
            if flags is not None and len(flags) != self.num_hidden_layers:
                raise ValueError(f"{name} has {len(flags)} entries for {self.num_hidden_layers} layers")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise UnsupportedModelError(f"rotary_dim {self.rotary_dim} for heads of {self.head_dim}")
        if kind == "freq_factors" and len(self.rope_scaling["factors"]) != self.global_rope_dim // 2:
            raise UnsupportedModelError(f"rope_freqs has {len(self.rope_scaling['factors'])} entries for "
                                        f"{self.global_rope_dim // 2} frequencies")
        if kind == "yarn" and not (self.rope_scaling.get("factor") and
                                   self.rope_scaling.get("original_max_position_embeddings")):
            raise UnsupportedModelError("YaRN needs a factor and original_max_position_embeddings")
        if kind == "longrope":
            half = self.global_rope_dim // 2
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling.get(key) or ()) != half:
                    raise UnsupportedModelError(f"LongRoPE {key} must have {half} entries")
            if not self.rope_scaling.get("original_max_position_embeddings"):
                raise UnsupportedModelError("LongRoPE needs original_max_position_embeddings")
        if self.expert_scoring not in ("softmax", "sigmoid") or self.expert_group_score not in ("max", "top2"):
            raise UnsupportedModelError(f"expert scoring {self.expert_scoring!r} / {self.expert_group_score!r}")
        if self.expert_groups is not None:
            groups, kept = self.expert_groups
            if not (0 < kept <= groups and self.num_experts % groups == 0):
                raise UnsupportedModelError(f"{self.num_experts} experts in {groups} groups, {kept} kept")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(f"{self.num_experts_per_tok} experts per token of {self.num_experts}")
        if self.conv_layers is not None and (len(self.conv_layers) != self.num_hidden_layers or self.conv_kernel < 2):
            raise ValueError(f"conv_layers has {len(self.conv_layers)} entries for {self.num_hidden_layers} layers "
                             f"(kernel {self.conv_kernel})")

    def without_lm_head(self) -> ModelArchConfig:
        """This architecture as an embedding checkpoint of it holds it: no LM head."""
        return dataclasses.replace(self, has_lm_head=False, tie_word_embeddings=True)

    def is_conv_layer(self, layer: int) -> bool:
        return self.conv_layers is not None and self.conv_layers[layer]

    def is_mamba_layer(self, layer: int) -> bool:
        return self.mamba_layers is not None and self.mamba_layers[layer]

    def is_linear_attn_layer(self, layer: int) -> bool:
        return self.linear_attn_layers is not None and self.linear_attn_layers[layer]

    def is_state_layer(self, layer: int) -> bool:
        """A layer that keeps a fixed-size state per request instead of a KV cache."""
        return self.is_conv_layer(layer) or self.is_mamba_layer(layer) or self.is_linear_attn_layer(layer)

    @property
    def trained_context(self) -> int:
        """The longest context the checkpoint's positions cover, as vLLM derives it:
        max_position_embeddings (a GGUF file's context_length), or what a RoPE scaling
        stretches to where that is longer (linear: it times the factor; YaRN: the original
        length times the factor: Qwen3's 32,768 x 4); Llama 3's and LongRoPE's configs give the
        stretched length already."""
        n, kind = self.max_position_embeddings, rope_kind(self.rope_scaling)
        if kind == "linear":
            return max(n, int(n * self.rope_scaling["factor"]))
        if kind == "yarn":
            return max(n, int(self.rope_scaling["original_max_position_embeddings"] * self.rope_scaling["factor"]))
        return n

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state per request instead of a KV cache."""
        return any(self.is_state_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    def sliding_window_of(self, layer: int) -> int | None:
        """The attention window of a layer: a query at position i sees keys j with
        i - window < j <= i (None: the whole context)."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

    @property
    def global_rope_dim(self) -> int:
        """The width the global rotary table turns (its scaling's factors are per half of it):
        the rotary width, or the head size of the layers that read the table."""
        if self.rotary_dim:
            return self.rotary_dim
        users = [i for i in range(self.num_hidden_layers) if self.rope_table_of(i) == "global"]
        return self.head_dim_of(users[0]) if users else self.head_dim

    def kv_source_of(self, layer: int) -> int:
        """The layer whose KV cache ``layer`` reads: itself, or the one it shares."""
        src = self.kv_source[layer] if self.kv_source is not None else None
        return layer if src is None else src

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims is not None else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads is not None else self.num_key_value_heads

    def chunk_of(self, layer: int) -> int | None:
        """A chunked-attention layer's chunk (None: not chunked)."""
        if self.layer_types is not None and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk_size
        return None

    def kv_window_of(self, layer: int) -> int | None:
        """The keys a layer's queries may read lie within this many positions before them
        (None: the whole context): its window, or its chunk. The KV manager gives back
        the blocks behind it."""
        return self.sliding_window_of(layer) or self.chunk_of(layer)

    def has_qk_norm(self, layer: int) -> bool:
        return self.qk_norm is not None and (self.qk_norm_layers is None or self.qk_norm_layers[layer])

    def rope_table_of(self, layer: int) -> str:
        """Which rotary table a layer uses: "none" (no RoPE: SmolLM3's every fourth layer),
        "tuned" (no RoPE, queries scaled by attention-temperature tuning: Llama 4), "local"
        (windowed layers of a family with a base of their own) or "global"."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return "tuned" if self.attn_temperature is not None else "none"
        return "local" if self.local_rope_theta is not None and self.sliding_window_of(layer) else "global"

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + 2 * h
        if self.kv_lora_rank:   # MLA: queries, the latent and its expansion, the output
            heads, rope = self.num_attention_heads, self.rotary_dim or 0
            q_out = heads * (self.qk_nope_head_dim + rope)
            queries = h * q_out if self.q_lora_rank is None else self.q_lora_rank * (h + q_out)
            attention = (queries + h * (self.kv_lora_rank + rope) + self.kv_lora_rank * heads * (
                self.qk_nope_head_dim + self.v_head_dim) + heads * self.v_head_dim * h + 2 * h)
        experts = h * self.num_experts + (self.num_experts + self.num_shared_experts) * 3 * h * self.moe_intermediate_size
        mlps = sum(experts if self.is_moe_layer(n) else 3 * h * i for n in range(self.num_hidden_layers))
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * attention + mlps + h + lm_head

    # ---- parsing ------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in hf_architectures()), None)
        base = next((a for a in archs if base_model_family(a) is not None), None) if arch is None else None
        if base is not None:
            # A base model (no LM head): an embedding checkpoint of a family we serve.
            parsed = model_class(base_model_family(base)).arch_from_hf(config, base_model_family(base))
            return parsed.without_lm_head()
        classifier = next((a for a in archs if classifier_family(a) is not None), None) if arch is None else None
        if classifier is not None:
            # A decoder with a score head instead of an LM head (pagoda/pooling.py: task classify).
            family = classifier_family(classifier)
            parsed = model_class(family).arch_from_hf(config, family).without_lm_head()
            return dataclasses.replace(parsed, num_labels=hf_num_labels(config))
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or config.get('model_type')!r} is not supported; "
                f"supported: {', '.join(hf_architectures())}"
            )
        return model_class(arch).arch_from_hf(config, arch)

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], tensor_names: set[str]) -> ModelArchConfig:
        gguf_arch = md.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {gguf_arch!r} is not supported; supported: "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        arch = GGUF_ARCHITECTURES[gguf_arch]
        return model_class(arch).arch_from_gguf(md, tensor_names, arch)

    @staticmethod
    def hf_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
        """The fields every decoder's config.json holds, checked for what the shared
        layers cannot do."""
        heads = config["num_attention_heads"]
        rope_scaling = config.get("rope_scaling")
        rope_theta = config.get("rope_theta")
        local_theta = config.get("rope_local_base_freq")
        # transformers 5 moved rope settings into "rope_parameters" (per layer type for
        # families whose windowed layers have their own).
        params = config.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"rope scaling {local['rope_type']!r} of windowed layers is not supported")
            local_theta = local.get("rope_theta", local_theta)
            params = params["full_attention"]
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_kind(rope_scaling) == "yarn" and rope_scaling.get("original_max_position_embeddings") is None:
            # transformers' default: the configured context is the original one.
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": config.get("max_position_embeddings")}
        # Qwen2/3 write a window they do not use unless use_sliding_window.
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        layer_types = config.get("layer_types")
        if window and layer_types is None and config.get("use_sliding_window"):
            # Qwen2's rule when the config predates layer_types: layers from max_window_layers on.
            first = config.get("max_window_layers", 0)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(config["num_hidden_layers"])]
        if not window:
            layer_types = None
        return dict(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias")),
            rope_scaling=rope_scaling,
            sliding_window=window or None,
            layer_types=tuple(layer_types) if layer_types else None,
            local_rope_theta=float(local_theta) if local_theta is not None and window else None,
            hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "silu",
        )

    @staticmethod
    def gguf_fields(md: dict[str, Any], tensor_names: set[str], architecture: str) -> dict[str, Any]:
        """The fields every decoder's GGUF metadata holds (keys ``{arch}.*``)."""
        p = f"{md['general.architecture']}."
        hidden = md[p + "embedding_length"]
        heads = md[p + "attention.head_count"]
        vocab = md.get(p + "vocab_size") or len(md["tokenizer.ggml.tokens"])
        rope_scaling = None
        if md.get(p + "rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": md[p + "rope.scaling.factor"]}
        elif md.get(p + "rope.scaling.type") == "yarn":
            # llama.cpp's YaRN keys; its beta_fast / beta_slow defaults (32, 1) are YaRN's.
            rope_scaling = {"rope_type": "yarn", "factor": md[p + "rope.scaling.factor"],
                            "original_max_position_embeddings": md[p + "rope.scaling.original_context_length"]}
            if md.get(p + "rope.scaling.yarn_log_multiplier"):
                raise UnsupportedModelError("GGUF YaRN with a log multiplier (DeepSeek's mscale) is not supported")
        elif md.get(p + "rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"GGUF rope scaling {md[p + 'rope.scaling.type']!r} is not supported")
        if "rope_freqs.weight" in md:   # the tensor's values, read by the loader (Llama 3.1's scaling)
            if rope_scaling is not None:
                raise UnsupportedModelError("a GGUF file with both rope_freqs and rope scaling")
            rope_scaling = {"rope_type": "freq_factors", "factors": md["rope_freqs.weight"]}
        return dict(
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=md[p + "feed_forward_length"],
            num_hidden_layers=md[p + "block_count"],
            num_attention_heads=heads,
            num_key_value_heads=md.get(p + "attention.head_count_kv") or heads,
            head_dim=md.get(p + "attention.key_length") or hidden // heads,
            rms_norm_eps=md.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
            max_position_embeddings=md.get(p + "context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=rope_scaling,
            sliding_window=md.get(p + "attention.sliding_window") or None,
        )
