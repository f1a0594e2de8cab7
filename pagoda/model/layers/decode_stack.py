"""A decode-only step's decoder layers in one C++ call (pagoda/csrc/decode_stack.cpp).

Single-stream decode of a small model is mostly per-call overhead: on the bundled 135M
model a step spent 28 % of its time in the kernels and the rest in about ten Python calls
per layer (modules, views, argument parsing, weight lists converted on every call).
``build`` reads each layer's weights and settings once; ``CausalLM.run_layers`` then hands
a decode-only step (one token per sequence, attention through the block tables) to the
stack, which calls the kernels DecoderLayer.forward would call, in its order, with its
arguments: the same bits (tested against the Python path).

The layers it takes: pre-norm and sandwich-norm (Gemma's) ``DecoderLayer`` with
``Attention`` (per-head or whole-projection q/k norms, weightless ones, norms after RoPE
(HunYuan), partial rotary, values normed (Gemma 4), no RoPE with per-token query scales
(Llama 4), windows, caps, sinks) and a ``GatedMLP`` (SiLU, tanh-GELU, GPT-OSS's clamped
SwiGLU) or a ``SparseMoeBlock`` (every router the Python block has; experts in the fused
GGUF kernel, biased or not, or one projection pair each as ``_experts_sum`` runs them;
shared experts, gated or not); Gemma 4's layer (experts
beside the dense MLP, layer scalars); a hybrid model's ``HybridDecoderLayer`` (Qwen3.5's: a
Gated DeltaNet, or attention with an output gate and partial rotary; the state layers' slots
updated in place). Layers of several KV groups (chunked attention) read each their group's
block tables. Every projection one of ``BlocksLinear`` (the exact and gguf modes),
``Int8Linear`` or ``Q4Linear`` on pagoda's kernels or a float32 ``nn.Linear`` (an HF
checkpoint's exact mode); float32 activations on the CPU, no LoRA, no tensor-parallel
collectives or experts split over processes, no hooks. Anything else (latent attention, KV
shared across layers, per-layer inputs, GPT-OSS's clamped SwiGLU, LoRA, bf16 mode, a step
with prompts) runs the Python path.
``PAGODA_DECODE_STACK=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pagoda.attention import AttentionMetadata, kernel_cache
from pagoda.attention.state import StateCache
from pagoda.model.layers.blocks import BlocksLinear
from pagoda.model.layers.decoder import Attention, DecoderLayer, GatedMLP, SparseMoeBlock
from pagoda.model.layers.gated_deltanet import GatedDeltaNet
from pagoda.model.layers.hybrid import HybridDecoderLayer, kernel_calls
from pagoda.model.layers.norm import RMSNorm, UnitRMSNorm
from pagoda.model.layers.pipeline import MissingLayer
from pagoda.model.layers.quantization import Int8Linear, Q4Linear
from pagoda.ops import cpu_kernels

# A query-scale table ("tuned") has no sines.
_NO_SINES = torch.empty(0)


class DecodeStack:
    """The C++ stack of a model's layers, and the step-time arguments it needs."""

    def __init__(self, stack: Any, tables: list[str]) -> None:
        self.stack = stack
        self.tables = tables
        self._caches_of: list | None = None   # the kv_caches list the arguments below were read from
        self._caches: list[torch.Tensor] = []
        self._scales: list[torch.Tensor | None] = []
        self._states: list[torch.Tensor] = []            # a state layer's slots (empty: attention)
        self._saved: list[torch.Tensor | None] = []      # and its saved states
        self._usable = False

    def _cache_args(self, kv_caches: list) -> bool:
        """Per layer, the cache tensor and scales the kernels read (kept for the runner's
        list, which lives as long as the engine); False when a held layer's cache is of a
        kind the kernels do not read (fp8, bfloat16)."""
        if kv_caches is not self._caches_of:
            empty = torch.empty(0)
            caches, scales, states, saved, usable = [], [], [], [], True
            for kv in kv_caches:
                state = kv if isinstance(kv, StateCache) else None
                found = None if kv is None or state is not None else kernel_cache(kv)
                usable &= kv is None or found is not None or (state is not None and state.slots.dtype == torch.float32)
                caches.append(empty if found is None else found[0])
                scales.append(None if found is None else found[1])
                states.append(empty if state is None else state.slots)
                saved.append(None if state is None else state.blocks)
            self._caches_of, self._caches, self._scales, self._usable = kv_caches, caches, scales, usable
            self._states, self._saved = states, saved
        return self._usable

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
            kv_caches: list, meta: AttentionMetadata, start: int,
            end: int) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """Layers [start, end) of the step, or None when the step is not one the stack runs
        (the caller runs the Python layers)."""
        if isinstance(meta, AttentionMetadata):
            metas = [meta]
        else:   # several KV groups (chunked attention): one metadata per layer
            metas = list(meta)
            if len(metas) != len(kv_caches):
                return None
        t = x.shape[0]
        if (x.dtype != torch.float32 or x.dim() != 2 or not self._cache_args(kv_caches)
                or any(m.decode_block_tables is None or m.num_decodes != t
                       for m in {id(m): m for m in metas}.values())):
            return None
        meta = metas[0]
        state_args: list[torch.Tensor] = []
        if getattr(meta, "states", None) is not None:
            calls = kernel_calls(meta)
            if len(calls) != 1 or calls[0][0] or calls[0][1] != slice(0, x.shape[0]):
                return None   # a decode restoring a prefix hit's state: the Python path
            state_args = list(calls[0][2])
        cos = [tables[name][0] for name in self.tables]
        sin = [_NO_SINES if tables[name][1] is None else tables[name][1] for name in self.tables]
        out, residual = self.stack.run(x, residual, cos, sin, self._caches, self._scales,
                                       [m.slot_mapping for m in metas], [m.decode_block_tables for m in metas],
                                       [m.decode_seq_lens for m in metas], start, end,
                                       states=self._states, saved=self._saved, state_args=state_args)
        return out, residual


def enabled() -> bool:
    return os.environ.get("PAGODA_DECODE_STACK", "1") != "0"


def build(model: nn.Module) -> tuple[DecodeStack | None, str]:
    """(the stack of ``model``'s layers, "") or (None, why not)."""
    if not enabled():
        return None, "PAGODA_DECODE_STACK=0"
    ops = cpu_kernels.kernels()
    if ops is None or not hasattr(ops, "DecodeStack"):
        return None, "pagoda's CPU kernels are not built"
    c = model.config
    tables = ["global"] + (["local"] if c.local_rope_theta is not None else []) + (
        ["none"] if c.rope_layers is not None else []) + (
        ["tuned"] if c.rope_layers is not None and c.attn_temperature is not None else [])
    layers = []
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer, MissingLayer):
            layers.append(None)
            continue
        entry, why = _layer(ops, layer, tables)
        if entry is None:
            return None, f"layer {i}: {why}"
        layers.append(entry)
    return DecodeStack(ops.DecodeStack(layers), tables), ""


def _hooked(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _layer(ops: Any, layer: nn.Module, tables: list[str]) -> tuple[Any, str]:
    hybrid = isinstance(layer, HybridDecoderLayer)
    # Gemma 4's layer (its forward is the sandwich below, with its experts and scalar): named by
    # its class, not a subclass of it.
    gemma4 = type(layer).__dict__.get("stack_layout") == "gemma4"
    if type(layer) is not DecoderLayer and not hybrid and not gemma4:
        return None, f"{type(layer).__name__} is not a plain DecoderLayer"
    if hybrid and layer.is_state:
        return _delta_layer(ops, layer)
    attn, mlp = layer.self_attn, layer.mlp
    moe = mlp if type(mlp) is SparseMoeBlock else None
    if type(attn) is not Attention or (type(mlp) is not GatedMLP and moe is None):
        return None, f"{type(attn).__name__} / {type(mlp).__name__}"
    sandwich = not hybrid and layer.sandwich
    if (not hybrid and layer.post_norm) or layer.residual_multiplier != 1.0 or (gemma4 and not sandwich):
        return None, "not a pre-norm or sandwich layer"
    if attn.kv_source is not None or attn.stores_kv or (gemma4 and layer.per_layer is not None):
        return None, "KV shared across layers, or per-layer inputs"
    if _hooked(layer):
        return None, "a module has forward hooks"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    beside = layer.moe if gemma4 else None
    if beside is not None:
        norms += [layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_1,
                  layer.post_feedforward_layernorm_2]
    if attn.qk_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if not all(_float_norm(n) for n in norms) or (attn.v_norm is not None and not _float_norm(attn.v_norm)):
        return None, "norms are not float32 RMSNorms on the CPU"
    if attn.norm_after_rope and attn.qk_norm != "head":
        return None, "whole-projection q/k norms after RoPE"
    if attn.rope_table not in tables or attn.qk_comm is not None or (
            attn.rotary_dim != attn.head_dim and attn.norm_after_rope):
        return None, "sharded q/k norms, or partial rotary with norms after RoPE"
    if attn.rope_table == "tuned" and (attn.qk_norm is not None or attn.output_gate):
        return None, "q/k norms or an output gate on a layer without RoPE"
    act = mlp.kernel_activation(ops) if moe is None else 0
    if act is None:
        return None, f"MLP activation {mlp.act}"
    if moe is None:
        projections = _projections(ops, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    else:
        projections = _projections(ops, (attn.qkv_proj, attn.o_proj))
        if not isinstance(projections, str):
            unused = ops.decode_linear(4, [torch.empty(0)], [])
            projections += [unused, unused]
    if isinstance(projections, str):
        return None, projections
    experts = None
    for block in (moe, beside):
        if block is not None:
            experts = _moe(ops, block)
            if isinstance(experts, str):
                return None, experts
    qk = {None: 0, "head": 1, "full": 2}[attn.qk_norm]
    entry = ops.DecodeLayer(
        layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
        layer.input_layernorm.eps, *projections, attn.num_heads, attn.num_kv_heads, attn.head_dim, qk,
        attn.q_norm.weight.detach() if qk else None, attn.k_norm.weight.detach() if qk else None,
        attn.q_norm.eps if qk else 0.0, attn.scale, attn.window or 0, attn.softcap or 0.0,
        None if attn.sinks is None else attn.sinks.detach().float(), tables.index(attn.rope_table),
        output_gate=attn.output_gate, rotary_dim=0 if attn.rotary_dim == attn.head_dim else attn.rotary_dim)
    entry.act = act
    entry.tuned = attn.rope_table == "tuned"
    entry.norm_after_rope = bool(attn.norm_after_rope)
    if attn.v_norm is not None:
        entry.v_unit, entry.v_eps = attn.v_norm.weight.detach(), attn.v_norm.eps
    if sandwich:
        entry.sandwich = True
        entry.pre_ff_norm = layer.pre_feedforward_layernorm.weight.detach()
        entry.post_ff_norm = layer.post_feedforward_layernorm.weight.detach()
    if experts is not None:
        entry.moe = experts
    if beside is not None:
        entry.moe_beside = True
        entry.pre_ff_norm2 = layer.pre_feedforward_layernorm_2.weight.detach()
        entry.post_ff_norm1 = layer.post_feedforward_layernorm_1.weight.detach()
        entry.post_ff_norm2 = layer.post_feedforward_layernorm_2.weight.detach()
    if gemma4:
        entry.layer_scalar = layer.layer_scalar.detach()
    return entry, ""


def _float_norm(n: nn.Module) -> bool:
    """An RMSNorm (or a weightless one) of float32 weights on the CPU, all its eps in one field."""
    return type(n) in (RMSNorm, UnitRMSNorm) and n.weight.dtype == torch.float32 and n.weight.device.type == "cpu"


def _moe(ops: Any, block: nn.Module) -> Any:
    """The stack's MoE block of ``block`` (a SparseMoeBlock, or Gemma 4's routed on a normed,
    scaled stream; its experts in the fused GGUF kernel, or one projection pair each), or why
    it is not one the stack runs."""
    gemma4 = type(block).__dict__.get("stack_layout") == "gemma4"
    if type(block) is not SparseMoeBlock and not gemma4:
        return f"{type(block).__name__} is not a SparseMoeBlock"
    if block.comm is not None or block.ep is not None or list(block.local_experts) != list(range(block.num_experts)):
        return "experts split over processes"
    if block.weights_on_input and block.top_k != 1:
        return "expert weights on the inputs of several experts per token"
    fused = block._fused_args()
    mlps = None
    if fused:
        kernel, gate_up, gate_up_types, down, down_types, activation, gate_up_bias, down_bias = fused
    else:   # one MLP per expert (the int8 mode's, a float checkpoint's), as _experts_sum runs them
        experts = list(block.experts)
        if any(type(m) is not GatedMLP or m.kernel_activation(ops) is None for m in experts) or len(
                {(m.act, m.limit, m.alpha) for m in experts}) != 1:
            return "experts that are not gated MLPs of one activation the stack computes"
        mlps = [_projections(ops, (m.gate_up_proj, m.down_proj)) for m in experts]
        bad = next((m for m in mlps if isinstance(m, str)), None)
        if bad is not None:
            return f"an expert's {bad}"
        kernel, gate_up, gate_up_types, down, down_types, activation = None, [], [], [], [], 0
        gate_up_bias, down_bias = [], []
    router = _linear(ops, block.gate)
    if router is None:
        return f"router {type(block.gate).__name__} is not a projection the stack calls"
    if block.expert_tokens is None:
        block.expert_tokens = torch.zeros(block.num_experts, dtype=torch.long)
    groups, kept = block.groups or (0, 0)
    moe = ops.DecodeMoe(router, block.sigmoid, block.top_k, bool(block.norm_topk_prob), float(block.norm_topk_min or 0.0),
                        bool(block.weights_on_input), float(block.scaling),
                        None if block.score_bias is None else block.score_bias.detach(), groups, kept,
                        block.group_score == "max", kernel is ops.gguf_moe_int8, gate_up, gate_up_types, down,
                        down_types, activation, block.expert_tokens)
    moe.gate_up_bias, moe.down_bias = gate_up_bias, down_bias
    if mlps is not None:
        moe.set_experts([m[0] for m in mlps], [m[1] for m in mlps], block.experts[0].kernel_activation(ops))
    if block.shared_experts is not None:
        shared = block.shared_experts
        act = shared.kernel_activation(ops)
        parts = _projections(ops, (shared.gate_up_proj, shared.down_proj))
        if act is None or isinstance(parts, str):
            return f"shared expert: {parts if isinstance(parts, str) else shared.act}"
        moe.shared_gate_up, moe.shared_down, moe.shared_act = parts[0], parts[1], act
        if block.shared_expert_gate is not None:
            gate = _linear(ops, block.shared_expert_gate)
            if gate is None:
                return "shared expert gate"
            moe.shared_gate = gate
    if gemma4:
        moe.router_scale, moe.root = block.router_scale.detach(), float(block.root)
        moe.router_unit, moe.router_eps = block.router_norm.weight, block.router_norm.eps
        moe.per_expert_scale = block.per_expert_scale.detach()
    return moe


def _delta_layer(ops: Any, layer: HybridDecoderLayer) -> tuple[Any, str]:
    """A hybrid layer whose mixer is a Gated DeltaNet (Qwen3.5), then a SiLU GatedMLP."""
    mixer, mlp = getattr(layer, layer.mixer_name), layer.mlp
    if type(mixer) is not GatedDeltaNet or mixer.stacked or type(mlp) is not GatedMLP:
        return None, f"{type(mixer).__name__} / {type(mlp).__name__} (a stack layer is Qwen3.5's Gated DeltaNet)"
    if layer.residual_multiplier != 1.0 or _hooked(layer) or mlp.act != "silu" or (2 * mlp.intermediate_size) % 64:
        return None, "a multiplier, hooks or the MLP"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms):
        return None, "norms are not float32 RMSNorms on the CPU"
    params = [mixer.conv_weight, mixer.A, mixer.dt_bias, mixer.norm_weight]
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return None, "the Gated DeltaNet's parameters are not float32 on the CPU"
    projections = _projections(ops, (mixer.in_proj, mixer.out_proj, mlp.gate_up_proj, mlp.down_proj))
    if isinstance(projections, str):
        return None, projections
    entry = ops.decode_delta_layer(
        layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
        layer.input_layernorm.eps, *projections, *(p.detach() for p in params), mixer.eps, mixer.k_heads,
        mixer.k_dim, mixer.v_heads, mixer.v_dim, mixer.tiled)
    return entry, ""


def _projections(ops: Any, modules: tuple[nn.Module, ...]) -> list | str:
    """The stack's projections of ``modules``, or why one is not a projection it calls."""
    out = []
    for m in modules:
        p = _linear(ops, m)
        if p is None:
            return f"projection {type(m).__name__} is not one the stack calls"
        out.append(p)
    return out


def _linear(ops: Any, m: nn.Module) -> Any:
    """The kernel call ``m.forward`` makes on a 2-D float32 input, or None."""
    if type(m) is BlocksLinear:
        if m.permutes_inputs:
            return None
        return ops.decode_linear(1 if m.int8_activations else 0, m._data, m._types, m.bias)
    if type(m) is Int8Linear:
        if m.split is not None or m._ops is None:
            return None
        return ops.decode_linear(2, [m.qweight, m.weight_scale, m.outlier_idx, m.outlier_weight], [], m.bias,
                                 m.vnni_weight, m.vnni_comp, m._small_rows)
    if type(m) is Q4Linear:
        if m._ops is None:
            return None
        return ops.decode_linear(3, [m.qweight, m.scales, m.mins], [], m.bias)
    if type(m) is nn.Linear:
        if m.weight.dtype != torch.float32 or m.weight.device.type != "cpu":
            return None
        return ops.decode_linear(4, [m.weight.detach()], [], None if m.bias is None else m.bias.detach())
    return None
