"""Building a proposer for the model runner (torch), re-exported by the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from pagoda.config.speculative import SpeculativeConfig
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.spec_decode.proposer import ModelDraftProposer, Proposer

if TYPE_CHECKING:
    from pagoda.model.loader import LoadedModel


def check_draft_model(spec: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None) -> None:
    """Reject drafts that cannot work with this target, with a message that says why."""
    arch = target.arch
    if spec.method == "layer_skip":
        assert spec.num_layers is not None
        if spec.num_layers >= arch.num_hidden_layers:
            raise ValueError(
                f"speculative_config: num_layers={spec.num_layers} must be smaller than the target's "
                f"{arch.num_hidden_layers} layers"
            )
    if spec.method == "draft_model":
        assert draft is not None
        if draft.arch.is_hybrid:
            raise ValueError("speculative_config: a hybrid draft model (recurrent state layers) is not supported; "
                             "use a draft model of attention layers only, or method ngram")
        if draft.arch.vocab_size != arch.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({draft.arch.vocab_size}) differs from "
                f"the target's ({arch.vocab_size}); a draft must share the target's tokenizer"
            )


def draft_kv_caches(draft: LoadedModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> list[torch.Tensor]:
    # (Each layer's own cache shape: DeepSeek's latent attention caches one latent per token.)
    return [
        torch.empty(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        for spec in draft.model.kv_specs()
    ]


def build_proposer(
    spec: SpeculativeConfig,
    target_model: torch.nn.Module,
    target_kv_caches: list[torch.Tensor],
    block_size: int,
    device: torch.device,
    draft: LoadedModel | None = None,
    draft_caches: list[torch.Tensor] | None = None,
    target_layer_group: Sequence[int] | None = None,
    target_group_chunks: Sequence[int | None] = (),
) -> Proposer:
    """``target_layer_group``: the KV group of each target layer (one group if None);
    ``target_group_chunks``: each group's attention chunk (pagoda/core/kv_layout.py)."""
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "layer_skip":
        # Shares the target's weights and the K/V of its first num_layers layers.
        groups = tuple(target_layer_group or (0,) * len(target_kv_caches))
        return ModelDraftProposer(target_model, target_kv_caches[: spec.num_layers], block_size, device,
                                  num_layers=spec.num_layers, layer_group=groups[: spec.num_layers],
                                  group_chunks=target_group_chunks)
    assert draft is not None
    if getattr(draft.model, "reads_target_kv", False):   # a Gemma 4 assistant
        from pagoda.spec_decode.gemma4_assistant import Gemma4AssistantProposer

        groups = tuple(target_layer_group or (0,) * len(target_kv_caches))
        return Gemma4AssistantProposer(draft.model, target_model, target_kv_caches, groups,
                                       tuple(target_group_chunks) or (None,) * (max(groups) + 1), block_size, device)
    assert draft_caches is not None
    if spec.method == "mtp":
        from pagoda.spec_decode.mtp import MTPProposer

        return MTPProposer(draft.model, draft_caches, block_size, device)
    if target_group_chunks and target_group_chunks[0] is not None:
        # The draft model reads the target's first group's tables: they must be whole.
        raise ValueError("speculative_config: a draft model for a target whose first KV group attends in chunks "
                         "is not supported; use method layer_skip or ngram")
    return ModelDraftProposer(draft.model, draft_caches, block_size, device, needs_sync=True)
