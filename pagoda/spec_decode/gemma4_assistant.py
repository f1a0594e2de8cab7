"""Gemma 4's assistant drafts: ``{"model": "path/to/gemma-4-E2B-it-assistant",
"num_speculative_tokens": k}`` (vLLM's form; ``"method": "draft_model"`` is implied), a
``gemma4_assistant`` checkpoint (``Gemma4AssistantForCausalLM``) beside its Gemma 4 target.

The assistant is a few Gemma 4 layers that compute queries only: every layer attends over the
target's KV cache, the sliding layers over the target's last sliding layer that keeps its own
cache, the global ones over its last such global layer (transformers' ``kv_sharing_modes``
"store" layers), through the target's block tables. It holds no cache and writes none. A
draft round for a request whose last token t sits at position p (not computed yet): the
target's embedding of t joined with the target's final (normed) hidden state at p - 1,
through ``pre_projection``; the layers with their queries at p over the target's keys at
positions [0, p); the final norm; the logits (the tied embedding, or with
``use_ordered_embeddings`` only the tokens of the ``centroid_intermediate_top_k`` best
centroids); the greedy token; ``post_projection`` of the normed stream replaces the hidden
state, and the next draft runs again at p. This is transformers'
``SinglePositionMultiTokenCandidateGenerator`` (tested against it), except that a draft never
sees the key of position p itself, which after a rejected draft is a stale one there.

As for every proposer, verification keeps the output that of decoding without speculation.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.loader import LoadedModel, _checkpoint_reader, _checkpoint_tensors, _target
from pagoda.model.models import UnsupportedModelError
from pagoda.model.models.gemma4 import Gemma4ForCausalLM
from pagoda.spec_decode.proposer import DraftRequest, HiddenRows


def assistant_config(path: str) -> dict[str, Any] | None:
    """The checkpoint's config when ``path`` is a gemma4_assistant folder, else None."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    return config if config.get("model_type") == "gemma4_assistant" else None


def target_sources(arch: Any) -> dict[str, int]:
    """Per layer type, the target layer whose cache the assistant's layers of that type read:
    the last layer of the type before the target's own KV-sharing layers."""
    n = arch.num_hidden_layers
    shared = [i for i in range(n) if arch.kv_source is not None and arch.kv_source[i] is not None]
    first = shared[0] if shared else n
    types = arch.layer_types or tuple("full_attention" for _ in range(n))
    return {t: max(i for i in range(first) if types[i] == t) for t in set(types[:first])}


class Gemma4Assistant(nn.Module):
    """The assistant's layers (Gemma 4 layers reading another model's KV) and projections."""

    reads_target_kv = True   # no KV cache of its own (the engine plans none)

    def __init__(self, model: Gemma4ForCausalLM, backbone: int, ordered: tuple[int, int] | None) -> None:
        super().__init__()
        self.body = model   # its layers, final norm and tied head; no embedding input of its own
        h = model.config.hidden_size
        self.pre_projection = nn.Linear(2 * backbone, h, bias=False)
        self.post_projection = nn.Linear(h, backbone, bias=False)
        # use_ordered_embeddings: (centroids, the best ones kept) and the vocabulary's order.
        self.ordered = ordered
        if ordered is not None:
            self.centroids = nn.Linear(h, ordered[0], bias=False)
            self.register_buffer("token_ordering", torch.zeros(model.config.vocab_size, dtype=torch.long))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[T, vocab] float32: the head's logits, or (ordered) those of the best centroids'
        tokens and below the least of them everywhere else (transformers' masked embedder)."""
        if self.ordered is None:
            return self.body.compute_logits(normed)
        groups, top = self.ordered
        best = self.centroids(normed).topk(top, dim=-1).indices                        # [T, top]
        tokens = self.token_ordering.view(groups, -1)[best].reshape(normed.shape[0], -1)  # [T, top * per]
        weight = self.body.lm_head.weight
        chosen = torch.einsum("th,tkh->tk", normed, weight[tokens]).float()
        out = torch.full((normed.shape[0], weight.shape[0]), float(chosen.min()) - 1.0, device=normed.device)
        return out.scatter_(1, tokens, chosen)


def load_assistant(path: str, config: dict[str, Any], target: LoadedModel, dtype: torch.dtype,
                   device: torch.device, quantization: str = "none") -> LoadedModel:
    """The gemma4_assistant checkpoint at ``path`` as a ``Gemma4Assistant`` over ``target``."""
    from safetensors import safe_open

    if not isinstance(target.model, Gemma4ForCausalLM):
        raise UnsupportedModelError(f"speculative_config: {path} is a Gemma 4 assistant; the target is "
                                    f"{target.arch.architecture}, not Gemma 4")
    text = dict(config.get("text_config") or {})
    backbone = int(config.get("backbone_hidden_size") or 0)
    if backbone != target.arch.hidden_size:
        raise UnsupportedModelError(f"speculative_config: the assistant was trained beside a model of hidden size "
                                    f"{backbone}; the target's is {target.arch.hidden_size}")
    for key in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if text.get(key):
            raise UnsupportedModelError(f"speculative_config: a Gemma 4 assistant with {key} is not supported")
    if int(text.get("vocab_size") or 0) != target.arch.vocab_size:
        raise UnsupportedModelError(f"speculative_config: the assistant's vocabulary ({text.get('vocab_size')}) "
                                    f"differs from the target's ({target.arch.vocab_size})")
    n = int(text["num_hidden_layers"])
    arch = Gemma4ForCausalLM.arch_from_hf({**text, "num_kv_shared_layers": 0}, "Gemma4ForCausalLM")
    sources = target_sources(target.arch)
    types = arch.layer_types or tuple("full_attention" for _ in range(n))
    if not set(types) <= set(sources):
        raise UnsupportedModelError(f"speculative_config: the assistant's {sorted(set(types) - set(sources))} layers "
                                    "have no layer of that type in the target to read")
    # Every layer reads a target layer's cache: its source, in the target's numbering.
    arch = dataclasses.replace(arch, kv_source=tuple(sources[t] for t in types), kv_source_external=True,
                               value_from_key=None)
    ordered = None
    if config.get("use_ordered_embeddings"):
        groups = int(config.get("num_centroids") or 2048)
        if arch.vocab_size % groups:
            raise UnsupportedModelError(f"speculative_config: {groups} centroids do not split a vocabulary of "
                                        f"{arch.vocab_size}")
        ordered = (groups, int(config.get("centroid_intermediate_top_k") or 32))
    with torch.device("meta"):
        assistant = Gemma4Assistant(Gemma4ForCausalLM(arch), backbone, ordered)
    assistant = assistant.to_empty(device=device).to(dtype)
    if ordered is not None:
        assistant.token_ordering = assistant.token_ordering.long()
    assistant.body.init_rope(device)
    handles = [safe_open(os.path.join(path, f), framework="pt") for f in sorted(os.listdir(path))
               if f.endswith(".safetensors")]
    if not handles:
        raise UnsupportedModelError(f"speculative_config: {path} holds no safetensors files")
    convert = _checkpoint_tensors(Gemma4ForCausalLM, None, _checkpoint_reader(handles), arch)
    params = {**dict(assistant.named_parameters()), **dict(assistant.named_buffers())}
    own = {"pre_projection.weight": "pre_projection.weight", "post_projection.weight": "post_projection.weight",
           "masked_embedding.centroids.weight": "centroids.weight",
           "masked_embedding.token_ordering": "token_ordering"}
    loaded: set[str] = set()
    with torch.no_grad():
        for handle in handles:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if name in own:
                    pairs = [(own[name], None, tensor)]
                else:   # the family's names and conversions, its packed projections
                    pairs = [("body." + key, rows, t) for ours, t in convert(name, tensor)
                             for key, rows in [_target(assistant.body, ours)]]
                for key, rows, t in pairs:
                    if key not in params:
                        raise UnsupportedModelError(f"speculative_config: the assistant's {name} has no place in "
                                                    "its Gemma 4 layers")
                    (params[key] if rows is None else params[key][rows]).copy_(t)
                    loaded.add(key)
    # The head is the assistant's own embedding (tied); rope tables are no parameters.
    assistant.body.tie_weights()
    needed = {k for k in params if not k.startswith("body.lm_head.") and "inv_freq" not in k}
    if needed - loaded:
        raise UnsupportedModelError(f"speculative_config: {path} lacks {sorted(needed - loaded)[:6]}")
    assistant.eval().requires_grad_(False)
    if quantization not in ("none", "auto", "gguf"):
        from pagoda.model.layers.quantization import quantize_model

        quantize_model(assistant.body, quantization, torch.device(device))
    return LoadedModel(assistant, arch, path)


class Gemma4AssistantProposer:
    """Drafts from a Gemma 4 assistant over the target's caches (see the module docstring)."""

    needs_sync = True

    def __init__(self, assistant: Gemma4Assistant, target: nn.Module, target_caches: Sequence[Any],
                 layer_group: Sequence[int], group_chunks: Sequence[int | None], block_size: int,
                 device: torch.device) -> None:
        arch = assistant.body.config
        self.assistant, self.target = assistant, target
        self.sources = list(arch.kv_source)
        if any(group_chunks[layer_group[s]] is not None for s in self.sources):
            raise ValueError("speculative_config: the assistant reads a KV group that attends in chunks")
        self.caches = [target_caches[s] for s in self.sources]
        self.groups = [layer_group[s] for s in self.sources]
        self.block_size, self.device = block_size, device
        # (The layers read no keys and values of the step: queries only.)
        shapes = [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in assistant.body.model.layers]
        empty = {s: (torch.empty(0, h, d, device=device), torch.empty(0, h, d, device=device))
                 for s, (h, d) in zip(self.sources, shapes)}
        for layer in assistant.body.model.layers:
            layer.self_attn.kv_share = empty
        self.rows = HiddenRows()   # the target's hidden rows of each request's last step

    def sync(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata]) -> None:
        raise RuntimeError("the assistant proposer keeps the step's hidden states (sync_step)")

    def sync_step(self, order: list[str], query_lens: list[int], input_ids: torch.Tensor, positions: torch.Tensor,
                  metas: Sequence[AttentionMetadata], hidden: torch.Tensor) -> None:
        """Keep each request's hidden rows of the step (its last one feeds the next drafts)."""
        self.rows.keep(order, query_lens, positions, hidden)

    @torch.inference_mode()
    def draft(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              block_tables: list[list[list[int]]], k: int) -> tuple[list[list[int]], torch.Tensor]:
        """(k greedy drafts per row, their logits [k, T, vocab]) for last tokens ``token_ids``
        at ``positions`` with the target's hidden states at the positions before; per row and
        KV group its block table."""
        body = self.assistant.body
        pos = positions.tolist()
        metas = {}
        for g in set(self.groups):
            metas[g] = AttentionMetadata.build([1] * len(pos), [p - 1 for p in pos], [t[g] for t in block_tables],
                                               self.block_size, self.device,
                                               decode_kernel=self.device.type == "cpu")
        layer_metas = [metas[g] for g in self.groups]
        drafts: list[list[int]] = [[] for _ in pos]
        all_logits = []
        ids = token_ids
        for _ in range(k):
            embedded = CausalLM.embed(self.target, ids)   # (CausalLM's: no per-layer inputs computed)
            x = self.assistant.pre_projection(torch.cat((embedded, hidden.to(embedded.dtype)), dim=-1))
            x, residual = body.run_layers(x, None, positions, self.caches, layer_metas, 0, len(self.caches))
            normed = body.model.norm(x, residual)[0]
            logits = self.assistant.logits(normed)
            ids = logits.argmax(dim=-1)
            for row, token in enumerate(ids.tolist()):
                drafts[row].append(token)
            all_logits.append(logits)
            hidden = self.assistant.post_projection(normed)
        return drafts, torch.stack(all_logits)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = []
        for i, r in enumerate(requests):
            last = len(r.token_ids) - 1          # its position: not computed yet
            row = self.rows.at(r.req_id, last - 1)
            if r.num_drafts < 1 or last < 1 or row is None:
                continue   # no hidden state of the position before: no drafts this step
            active.append((i, last, row))
        for k in sorted({requests[i].num_drafts for i, _, _ in active}):
            rows = [a for a in active if requests[a[0]].num_drafts == k]
            got, _ = self.draft(torch.tensor([requests[i].token_ids[-1] for i, _, _ in rows], device=self.device),
                                torch.stack([h for _, _, h in rows]),
                                torch.tensor([p for _, p, _ in rows], device=self.device),
                                [requests[i].block_ids for i, _, _ in rows], k)
            for (i, _, _), d in zip(rows, got):
                drafts[i] = d
        return drafts
