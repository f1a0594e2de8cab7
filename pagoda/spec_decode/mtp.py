"""Multi-token prediction (``{"method": "mtp"}``): the draft head a checkpoint ships after its
last layer (DeepSeek-V3's, GLM-4.5's: ``model.layers.{num_hidden_layers}.*``; Qwen3.5's and
Qwen3-Next's: ``mtp.*``, the same pieces under other names, as llama.cpp's converter maps
them: fc -> eh_proj, pre_fc_norm_embedding -> enorm, pre_fc_norm_hidden -> hnorm, norm ->
shared_head.norm, mtp.layers.0 -> the layer; its layer is full attention beside a hybrid
target's state layers).

The head predicts the token after next: at position i it takes the target's final hidden
state h_i and the embedding of token i + 1, each RMS-normed (``hnorm``, ``enorm``), joins
them (embedding first) through ``eh_proj`` and runs one decoder layer of the family (its own
attention over its own KV cache, over the target's block ids; its MLP or experts); its
``shared_head.norm`` and the target's LM head give the logits. Drafts past the first feed
the head its own output (the layer's stream) with the previous draft, as vLLM does.

Keeping its cache right (``MTPProposer``): every step's batch runs through the head after
the target (``sync_step``), each position with the next token of the step (the last
position of a request has none yet: a placeholder, its K/V rewritten when drafts are asked
for); the target's hidden rows of the step are kept per request, so that at the next step's
``propose`` the last known position runs again with the token sampled for it, and its
output gives the first draft. Drafts are greedy; verification is the same as for every
proposer, so the output equals decoding without speculation. A prefix-cache hit leaves the
head's K/V at the hit's last position as the request that computed it wrote it (with its
own next token): this can only lower acceptance, never change the output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Sequence

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.norm import RMSNorm
from pagoda.model.loader import LoadedModel, _checkpoint_reader, _checkpoint_tensors, _target
from pagoda.model.models import UnsupportedModelError, model_class
from pagoda.spec_decode.proposer import DraftRequest, HiddenRows

# The head's own tensors beside its decoder layer, under model.layers.{N} (DeepSeek) or mtp (Qwen).
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "model.norm.weight",
        "pre_fc_norm_embedding.weight": "enorm.weight", "pre_fc_norm_hidden.weight": "hnorm.weight",
        "fc.weight": "eh_proj.weight", "norm.weight": "model.norm.weight"}
# Per layer whether it keeps a state instead of a KV cache: the head's layer is attention.
_STATE_FLAGS = ("conv_layers", "mamba_layers", "linear_attn_layers")
# The same as the target's (DeepSeek-V3 shares its embedding and output head with the head).
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
# Per-layer options: the head's layer takes the last layer's.
_PER_LAYER = ("layer_types", "rope_layers", "qk_norm_layers", "layer_head_dims", "layer_kv_heads", "value_from_key",
              "moe_layers", "layer_intermediate_sizes")


def _head_arch(arch: ModelArchConfig) -> ModelArchConfig:
    """The target's architecture as a one-layer model of its last layer's kind (an attention
    layer: a hybrid's head is full attention)."""
    if arch.kv_source is not None or arch.per_layer_input_size:
        raise UnsupportedModelError("speculative_config: mtp for shared KV or per-layer inputs is not supported yet")
    one = {name: (getattr(arch, name)[-1],) for name in _PER_LAYER if getattr(arch, name) is not None}
    one.update({name: (False,) for name in _STATE_FLAGS if getattr(arch, name) is not None})
    return dataclasses.replace(arch, num_hidden_layers=1, **one)


def _head_names(names: list[str], n: int) -> dict[str, str]:
    """Checkpoint name -> the head's name (own tensors as ``_OWN`` says, its layer's as layer 0)."""
    out = {}
    for name in names:
        m = re.match(rf"^model\.layers\.{n}\.(.*)$", name) or re.match(r"^(?:model\.)?mtp\.(.*)$", name)
        if m is None:
            continue
        rest = m.group(1)
        layer = re.match(r"^layers\.(\d+)\.(.*)$", rest)
        if layer is not None:   # Qwen's mtp.layers.i
            if layer.group(1) != "0":
                raise UnsupportedModelError("speculative_config: mtp with more than one MTP layer is not supported")
            rest = layer.group(2)
        elif rest in _SHARED:
            continue   # the target's own
        elif rest in _OWN:
            out[name] = _OWN[rest]
            continue
        out[name] = "model.layers.0." + rest
    return out


def load_mtp(path: str, target: LoadedModel, dtype: torch.dtype, device: torch.device,
             quantization: str = "none") -> LoadedModel:
    """The MTP head of an HF checkpoint (safetensors folder) as a one-layer model of the
    target's family, sharing the target's embedding and LM head, its projections in the
    target's quantized mode."""
    from safetensors import safe_open

    if target.gguf_metadata is not None or not os.path.isdir(path):
        raise UnsupportedModelError("speculative_config: mtp reads the head from an HF checkpoint folder; "
                                    "GGUF files' nextn blocks are not supported yet")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    n = target.arch.num_hidden_layers
    handles = [safe_open(os.path.join(path, f), framework="pt") for f in sorted(os.listdir(path))
               if f.endswith(".safetensors")]
    names = {name: handle for handle in handles for name in handle.keys()}
    qwen = any(name.startswith(("mtp.", "model.mtp.")) for name in names)   # (Qwen3-Next's config says nothing)
    if not (config.get("num_nextn_predict_layers") or config.get("mtp_num_hidden_layers") or qwen):
        raise UnsupportedModelError(f"speculative_config: {path} has no multi-token-prediction layers "
                                    "(num_nextn_predict_layers)")
    arch = _head_arch(target.arch)
    cls = model_class(arch.architecture)
    with torch.device("meta"):
        head = cls(arch)
        head.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        head.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        head.eh_proj = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
    head = head.to_empty(device=device).to(dtype)
    head.init_rope(device)
    # (Through the family's own conversions: Qwen's zero-centred norms, stacked experts.)
    convert = _checkpoint_tensors(cls, None, _checkpoint_reader(handles), arch)
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, ours_name in _head_names(list(names), n).items():
            for ours, t in convert(ours_name, names[name].get_tensor(name)):
                target_name, rows = _target(head, ours)
                if target_name not in params:
                    raise UnsupportedModelError(f"speculative_config: the MTP layer's {name} has no place in "
                                                f"{cls.__name__}'s layer")
                (params[target_name] if rows is None else params[target_name][rows]).copy_(t)
                loaded.add(target_name)
    own = {n for n in params if not n.startswith(("model.embed_tokens.", "lm_head."))}
    if own - loaded:
        raise UnsupportedModelError(f"speculative_config: {path}'s MTP layer lacks {sorted(own - loaded)[:6]}")
    # The target's embedding and LM head (shared: no copy).
    head.model.embed_tokens = target.model.model.embed_tokens
    head.lm_head = target.model.lm_head
    head.eval().requires_grad_(False)
    if quantization not in ("none", "auto", "gguf"):   # (the gguf mode: no float projection changes)
        from pagoda.model.layers.quantization import quantize_model

        quantize_model(head, quantization, torch.device(device))
    return LoadedModel(head, arch, path)


def mtp_forward(head: nn.Module, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the head's output stream [T, hidden], its logits [T, vocab] or None) for tokens at
    ``positions`` with the target's hidden states there and the next tokens."""
    e = head.enorm(head.embed(next_ids))
    x = head.eh_proj(torch.cat((e, head.hnorm(hidden.to(e.dtype))), dim=-1))
    x, residual = head.run_layers(x, None, positions, list(kv_caches), meta, 0, 1)
    if not logits:   # (the cache's sync: the stream alone, no final norm)
        return residual.add_(x), None
    normed, stream = head.model.norm(x, residual)
    return stream, head.compute_logits(normed)


class MTPProposer:
    """Drafts from the checkpoint's MTP head (see the module docstring)."""

    needs_sync = True

    def __init__(self, head: nn.Module, kv_caches: list[torch.Tensor], block_size: int, device: torch.device) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.rows = HiddenRows()   # the target's hidden rows of each request's last step

    def sync(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata]) -> None:
        raise RuntimeError("the MTP proposer syncs with the step's hidden states (sync_step)")

    @torch.inference_mode()
    def sync_step(self, order: list[str], query_lens: list[int], input_ids: torch.Tensor, positions: torch.Tensor,
                  metas: Sequence[AttentionMetadata], hidden: torch.Tensor) -> None:
        """The step's batch through the head (its cache at every computed position), each
        position with the step's next token; the hidden rows kept per request."""
        ends = torch.tensor(query_lens, device=input_ids.device).cumsum(0) - 1
        nxt = torch.roll(input_ids, -1)
        nxt[ends] = input_ids[ends]   # a request's last position: no next token yet (placeholder)
        mtp_forward(self.head, nxt, positions, hidden, self.kv_caches, metas[0], logits=False)
        self.rows.keep(order, query_lens, positions, hidden)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active, ids, pos, hid = [], [], [], []
        for i, r in enumerate(requests):
            last = len(r.token_ids) - 1          # its position: not computed yet
            row = self.rows.at(r.req_id, last - 1)
            if r.num_drafts < 1 or row is None:
                continue   # no hidden state of the position before: no drafts this step
            active.append(i)
            ids.append(r.token_ids[-1])
            pos.append(last - 1)
            hid.append(row)
        if not active:
            return drafts
        hidden = torch.stack(hid)
        for j in range(max(requests[i].num_drafts for i in active)):
            if j:
                keep = [k for k, i in enumerate(active) if requests[i].num_drafts > j]
                active, ids, pos, hidden = ([active[k] for k in keep], [ids[k] for k in keep],
                                            [pos[k] for k in keep], hidden[keep])
                if not active:
                    break
            meta = AttentionMetadata.build([1] * len(active), pos, [requests[i].block_ids[0] for i in active],
                                           self.block_size, self.device)
            hidden, logits = mtp_forward(self.head, torch.tensor(ids, device=self.device),
                                         torch.tensor(pos, device=self.device), hidden, self.kv_caches, meta)
            tokens = logits.argmax(dim=-1).tolist()
            for k, i in enumerate(active):
                drafts[i].append(tokens[k])
            ids = tokens
            pos = [p + 1 for p in pos]
        return drafts
