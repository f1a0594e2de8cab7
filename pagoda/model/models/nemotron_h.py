"""NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H, Nemotron Nano 2, Nemotron 3): a
hybrid whose every layer is one pre-norm block holding exactly one mixer, named by
``layers_block_type`` (or the older ``hybrid_override_pattern``, one letter a layer):

    "mamba" (M)      Mamba-2 (pagoda/model/layers/mamba2.py: the same mixer as Granite 4.0-H's)
    "attention" (*)  GQA attention without RoPE (the Mamba layers carry the positions)
    "mlp" (-)        up_proj, relu², down_proj: not gated
    "moe" (E)        relu² experts chosen by sigmoid scores plus a correction bias (it chooses,
                     it does not weigh) among the best ``topk_group`` of ``n_group`` groups,
                     their weights renormalised and scaled, plus one shared relu² MLP; with
                     ``moe_latent_size``, the routed experts work in a smaller width between
                     two projections

and a layer computes ``x + mixer(RMSNorm(x))``. The Mamba layers keep their state per
request in the state pool as Granite 4.0-H's do; only the attention layers have KV caches.

llama.cpp's GGUF files are read: ``nemotron_h`` (without experts) and ``nemotron_h_moe``
(Nemotron 3: every feed-forward layer experts, ``ffn_up_exps`` / ``ffn_down_exps`` stacked,
the router ``ffn_gate_inp`` with its correction bias ``exp_probs_b``, the shared expert
``ffn_*_shexp``, the latent projections ``ffn_latent_down`` / ``ffn_latent_up``); the Mamba
tensors as its converter stores them (``pagoda.model.layers.mamba2.gguf_mixer_tensor``).

Not served: the multi-token-prediction layers (``num_nextn_predict_layers``; their ``mtp.*``
tensors are skipped, as is a GGUF file's block past the last layer, ``nextn_predict_layers``),
tensor parallelism and LoRA (as for Granite 4.0-H), and GGUF files whose MoE layers differ in
expert width or experts per token (NVIDIA's Puzzle models).

The time step is clamped to ``time_step_limit`` on every token, as transformers' prompt
path does (its one-token decode path does not; the published configs' limit, (0, inf),
makes the two agree).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, moe_fields
from pagoda.model.layers.decoder import Attention, CausalLM, KVSpec, SparseMoeBlock
from pagoda.model.layers.mamba2 import Mamba2Mixer, gguf_mixer_lookup_name, gguf_mixer_tensor, hf_mixer_tensor
from pagoda.model.layers.norm import RMSNorm
from pagoda.model.layers.pipeline import MissingLayer
from pagoda.model.models import UnsupportedModelError

# The config's layer kinds (current names, older names and pattern letters) -> ours.
_BLOCK_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
                "attention": "attention", "full_attention": "attention", "*": "attention",
                "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}  # fmt: skip

# The first name part after ``mixer.`` -> the module this model keeps it in.
_MIXER_PARTS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "mamba": ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj"),
                "mlp": ("up_proj", "down_proj", "gate", "experts", "shared_experts", "fc1_latent_proj",
                        "fc2_latent_proj")}  # fmt: skip
_OWNER = {part: module for module, parts in _MIXER_PARTS.items() for part in parts}
_MIXER = re.compile(r"^model\.layers\.(\d+)\.mixer\.([A-Za-z0-9_]+)")
# The latent projections: llama.cpp's table knows them under the checkpoint's names only.
_LATENT = re.compile(r"^model\.layers\.(\d+)\.mlp\.(fc[12]_latent_proj\..+)$")
_LEAVES = {".mamba.conv1d.weight": ".mamba.conv_weight", ".mamba.conv1d.bias": ".mamba.conv_bias",
           ".mamba.norm.weight": ".mamba.norm_weight", ".mamba.A_log": ".mamba.A",
           ".mlp.gate.e_score_correction_bias": ".mlp.score_bias"}


@dataclasses.dataclass(frozen=True)
class NemotronHArch(ModelArchConfig):
    """ModelArchConfig and what only Nemotron-H has: each layer's one mixer ("mamba",
    "attention", "mlp" or "moe"), and the experts' latent width (None: they see the hidden
    state). ``hidden_act`` is not read: every MLP and expert of Nemotron-H is relu²."""

    block_types: tuple[str, ...] = ()
    moe_latent_size: int | None = None


def _option(config: dict[str, Any], key: str, legacy: str | None, default: Any) -> Any:
    """A config value under its name or the name older configs gave it (``mamba_n_groups``
    for ``n_groups``), else transformers' default."""
    if key in config:
        return config[key]
    return config.get(legacy, default) if legacy else default


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))²): Nemotron-H's MLP, shared expert and experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHMoE(SparseMoeBlock):
    """SparseMoeBlock's router (sigmoid scores, correction bias, group-limited choice) over relu²
    experts, in a latent width when the checkpoint has one, plus the shared expert of
    its own width. (The parent's gated experts are built and replaced: on the meta
    device, where the loader builds the model, that costs nothing.)"""

    def __init__(self, config: NemotronHArch) -> None:
        super().__init__(config)
        h, latent = config.hidden_size, config.moe_latent_size
        width = latent or h
        self.experts = nn.ModuleList(ReluSquaredMLP(width, config.moe_intermediate_size, False)
                                     for _ in range(config.num_experts))  # fmt: skip
        self.shared_experts = ReluSquaredMLP(h, config.shared_expert_intermediate_size, config.mlp_bias)
        self.fc1_latent_proj = nn.Linear(h, latent, bias=config.mlp_bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, h, bias=config.mlp_bias) if latent else None

    def _fused_args(self) -> bool:
        return False   # the fused expert kernels are for gated SiLU experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, picks = self.route(x)
        weights = weights.to(x.dtype)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        if self.ep is not None:
            from pagoda.model.layers.expert_parallel import dispatch_combine

            routed = dispatch_combine(h, weights, ids, self.experts, self.num_experts, self.ep)
        else:
            routed = self._experts_sum(h, weights, ids, picks)
            if self.comm is not None:
                routed = self.comm.all_reduce(routed)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHLayer(nn.Module):
    """x + mixer(RMSNorm(x)), the residual stream carried separately (as ``DecoderLayer``):
    forward returns (the mixer's output, the stream before it). The mixer is held under
    the name the shared code looks for: ``mamba``, ``self_attn`` or ``mlp`` (an MLP or
    the experts)."""

    def __init__(self, config: NemotronHArch, layer_idx: int) -> None:
        super().__init__()
        self.kind = config.block_types[layer_idx]
        if self.kind == "mamba":
            self.mamba = Mamba2Mixer(config)
        elif self.kind == "attention":
            self.self_attn = Attention(config, layer_idx)
        elif self.kind == "moe":
            self.mlp = NemotronHMoE(config)
        else:
            self.mlp = ReluSquaredMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def rope_table(self) -> str:
        return "none"   # no layer applies RoPE

    def forward(self, x, residual, cos, sin, cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.norm(x)
        else:
            h, residual = self.norm(x, residual)
        if self.kind == "mamba":
            return self.mamba(h, cache, meta), residual
        if self.kind == "attention":
            return self.self_attn(h, cos, sin, cache, meta), residual
        return self.mlp(h), residual


class NemotronHForCausalLM(CausalLM):
    layer_cls = NemotronHLayer
    # q/k/v stacked; the MLPs' up_proj is a projection of its own (no gate).
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    gguf_qk_permuted = True   # llama.cpp's converter permutes them (its GraniteHybridModel's LlamaModel)
    unquantized_modules = (".mlp.gate",)
    # Not yet: the Mamba heads split over ranks, adapters on the mixers' projections.
    tensor_parallel = False
    lora = False

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        names = config.get("layers_block_type") or config.get("layer_types") or config.get("hybrid_override_pattern")
        if not names:
            raise UnsupportedModelError("Nemotron-H config without layers_block_type or hybrid_override_pattern")
        unknown = sorted({t for t in names if t not in _BLOCK_TYPES})
        if unknown:
            raise UnsupportedModelError(f"Nemotron-H layer types {unknown} are not supported")
        types = tuple(_BLOCK_TYPES[t] for t in names)
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if config.get(key, want) != want:
                raise UnsupportedModelError(f"Nemotron-H with {key} {config[key]!r} is not supported (only {want!r})")
        n = len(types)
        heads, head_dim = _option(config, "mamba_num_heads", None, 128), _option(config, "mamba_head_dim", None, 64)
        limit = _option(config, "time_step_limit", "mamba_dt_limit", None) or (0.0, float("inf"))
        dt_max = limit[1]
        if isinstance(dt_max, dict):   # JSON's infinity as transformers writes it
            dt_max = float(dt_max.get("__float__", "inf"))
        fields = {**config, "num_hidden_layers": n, "rms_norm_eps": config.get("layer_norm_epsilon", 1e-5),
                  "intermediate_size": config.get("intermediate_size", 21504),
                  # transformers' default head size is 128, not hidden / heads (Nemotron Nano 2: 4480 / 40)
                  "head_dim": config.get("head_dim") or config.get("attention_head_dim") or 128,
                  "layer_types": None, "sliding_window": None, "hidden_act": None, "hidden_activation": None,
                  "attention_bias": False}   # transformers' attention has no biases, whatever the config says
        moe: dict[str, Any] = {}
        if "moe" in types:
            groups, kept = config.get("n_group", 1), config.get("topk_group", 1)
            moe = dict(moe_layers=tuple(t == "moe" for t in types), expert_scoring="sigmoid", expert_score_bias=True,
                       expert_groups=(groups, kept) if groups > 1 else None, expert_group_score="top2",
                       routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                       num_shared_experts=1,
                       shared_expert_intermediate_size=config.get("moe_shared_expert_intermediate_size", 7688),
                       moe_latent_size=config.get("moe_latent_size"),
                       **moe_fields(_option(config, "n_routed_experts", "num_local_experts", 8),
                                    config.get("num_experts_per_tok", 2), config.get("moe_intermediate_size", 7688),
                                    bool(config.get("norm_topk_prob", True))))
        return NemotronHArch(
            **ModelArchConfig.hf_fields(fields, architecture),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_layers=tuple(False for _ in range(n)), block_types=types,
            mamba_layers=tuple(t == "mamba" for t in types),
            mamba=dict(heads=heads, head_dim=head_dim, groups=_option(config, "n_groups", "mamba_n_groups", 8),
                       d_state=_option(config, "ssm_state_size", None, 128),
                       d_conv=_option(config, "conv_kernel", "mamba_d_conv", 4), intermediate=heads * head_dim,
                       conv_bias=bool(_option(config, "use_conv_bias", "mamba_conv_bias", True)),
                       proj_bias=bool(config.get("use_bias", False)), dt_min=float(limit[0]), dt_max=float(dt_max)),
            **moe)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``nemotron_h`` and ``nemotron_h_moe`` files: a layer's kind from its
        ``attention.head_count_kv`` and ``feed_forward_length`` (arrays): attention where it
        has KV heads, the feed-forward layer where it has a width (experts when the file has
        ``expert_count``: llama.cpp then builds experts for every such layer), else Mamba-2;
        no RoPE; the time step unclamped (llama.cpp does not clamp it). A block past the
        last layer (``nextn_predict_layers``: the MTP head) is not served.

        The experts (llama.cpp's router: sigmoid whatever ``expert_gating_func`` says):
        ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
        ``expert_shared_feed_forward_length``, ``expert_weights_norm`` (default false),
        ``expert_weights_scale`` (0: none), ``expert_group_count`` / ``expert_group_used_count``
        (groups ranked by their best two, as transformers'), ``moe_latent_size``."""
        p = f"{md['general.architecture']}."
        total = int(md[p + "block_count"])
        n = total - int(md.get(p + "nextn_predict_layers", 0) or 0)

        def per_layer(key: str, default: Any = None) -> list[int]:
            v = md.get(p + key, default)
            if not isinstance(v, (list, tuple)):
                return [int(v)] * n
            if len(v) != total:
                raise UnsupportedModelError(f"Nemotron-H GGUF: {key} {list(v)} for {total} layers")
            return [int(x) for x in v[:n]]

        kv, ff = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
        experts = int(md.get(p + "expert_count") or 0)
        if len({k for k in kv if k}) > 1 or (not experts and len({f for f in ff if f}) > 1):
            raise UnsupportedModelError(f"Nemotron-H GGUF: head_count_kv {kv}, feed_forward_length {ff} for {n} layers")
        types = tuple("attention" if k else ("moe" if experts else "mlp") if f else "mamba" for k, f in zip(kv, ff))
        eps = md.get(p + "attention.layer_norm_rms_epsilon", md.get(p + "attention.layer_norm_epsilon", 1e-5))
        fields = ModelArchConfig.gguf_fields({**md, p + "block_count": n, p + "attention.head_count_kv": max(kv) or 1,
                                              p + "feed_forward_length": max(ff)}, tensor_names, architecture)
        heads, inner = int(md[p + "ssm.time_step_rank"]), int(md[p + "ssm.inner_size"])
        mamba = types.index("mamba") if "mamba" in types else 0
        ffn = next((i for i, t in enumerate(types) if t in ("mlp", "moe")), 0)
        moe: dict[str, Any] = {}
        if "moe" in types:
            on = [i for i, t in enumerate(types) if t == "moe"]
            width = {per_layer("expert_feed_forward_length", 0)[i] or ff[i] for i in on}
            used = {per_layer("expert_used_count", 0)[i] for i in on}
            if 0 in used or 0 in width:
                raise UnsupportedModelError("Nemotron-H GGUF with experts but no expert_used_count or expert width")
            if len(width) > 1 or len(used) > 1:
                raise UnsupportedModelError(f"Nemotron-H GGUF with expert widths {sorted(width)} and experts per "
                                            f"token {sorted(used)} varying by layer is not supported")
            groups, kept = int(md.get(p + "expert_group_count") or 0), int(md.get(p + "expert_group_used_count") or 0)
            scale = float(md.get(p + "expert_weights_scale") or 0.0)
            latent = int(md.get(p + "moe_latent_size") or 0)
            moe = dict(moe_layers=tuple(t == "moe" for t in types), expert_scoring="sigmoid", expert_score_bias=True,
                       expert_groups=(groups, kept) if groups > 1 else None, expert_group_score="top2",
                       routed_scaling_factor=scale or 1.0, num_shared_experts=1,
                       shared_expert_intermediate_size=int(md[p + "expert_shared_feed_forward_length"]),
                       moe_latent_size=latent or None,
                       **moe_fields(experts, used.pop(), width.pop(), bool(md.get(p + "expert_weights_norm", False))))
        return NemotronHArch(
            **{**fields, "rms_norm_eps": eps, "attention_bias": False},
            mlp_bias=f"blk.{ffn}.ffn_up.bias" in tensor_names or f"blk.{ffn}.ffn_up_shexp.bias" in tensor_names,
            rope_layers=(False,) * n, block_types=types, mamba_layers=tuple(t == "mamba" for t in types),
            mamba=dict(heads=heads, head_dim=inner // heads, groups=int(md[p + "ssm.group_count"]),
                       d_state=int(md[p + "ssm.state_size"]), d_conv=int(md[p + "ssm.conv_kernel"]),
                       intermediate=inner, conv_bias=f"blk.{mamba}.ssm_conv1d.bias" in tensor_names,
                       proj_bias=f"blk.{mamba}.ssm_in.bias" in tensor_names, dt_min=0.0, dt_max=float("inf")),
            **moe)

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        """The router's correction bias and the latent projections under the names llama.cpp's
        table knows them by (``exp_probs_b``, ``ffn_latent_down`` / ``ffn_latent_up``); the
        Mamba-2 tensors as ``gguf_mixer_lookup_name``."""
        if name.endswith(".mlp.score_bias"):
            return name[: -len("score_bias")] + "gate.e_score_correction.bias"
        m = _LATENT.match(name)
        if m is not None:
            return f"backbone.layers.{m.group(1)}.mixer.{m.group(2)}"
        return gguf_mixer_lookup_name(name)

    gguf_tensor = staticmethod(gguf_mixer_tensor)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        if name.startswith(("mtp.", "model.mtp.", "backbone.mtp.")):
            return None   # the multi-token-prediction layers: not served
        if name.startswith("backbone."):   # NVIDIA's checkpoints; transformers loads them as model.*
            name = "model." + name[len("backbone."):]
        name = name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
        m = _MIXER.match(name)
        if m is not None and m.group(2) in _OWNER:
            name = name.replace(".mixer.", f".{_OWNER[m.group(2)]}.", 1)
            for old, new in _LEAVES.items():
                if name.endswith(old):
                    name = name[: -len(old)] + new
        return name

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor, checkpoint=None):
        if re.search(r"\.mixer\.experts\.(up|down)_proj$", name):   # transformers' [experts, out, in] stack
            base = cls.hf_name(name)
            prefix, _, proj = base.rpartition(".")
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.{proj}.weight", tensor[e]
            return
        yield from super().hf_tensors(name, tensor, checkpoint)

    hf_tensor = staticmethod(hf_mixer_tensor)

    def kv_specs(self) -> list[KVSpec | None]:
        c = self.config
        return [KVSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, None)
                if not isinstance(layer, MissingLayer) and c.block_types[i] == "attention" else None
                for i, layer in enumerate(self.model.layers)]

    def state_shapes(self) -> list[tuple[int, ...] | None]:
        c = self.config
        return [(Mamba2Mixer.state_size(c),) if c.is_mamba_layer(i) else None for i in range(len(self.model.layers))]
