"""Pipeline parallelism: the decoder layers split into contiguous stages, one per process
group (pagoda/distributed/group.py), the embedding on the first stage, the final norm and
the LM head on the last.

As with tensor parallelism, the model code does not branch on it: the loader builds the
model on the meta device, ``StagePlan.apply`` swaps every module another stage holds for a
placeholder (``MissingLayer``: no parameters, never run), so a stage allocates and reads only
its own tensors, and installs a ``PipelineStage`` as ``model.stage``, through which
``CausalLM.forward`` and ``compute_logits`` go:

- forward: the first stage embeds the tokens; every other stage receives the hidden states
  and the residual stream (one [2, tokens, hidden] tensor) from the stage before; each runs
  its layers; all but the last send the pair on and return an empty [tokens, 0] placeholder;
  the last applies the final norm and returns the hidden states.
- compute_logits: the last stage computes the logits and sends them to rank 0, which
  receives them in place of computing them (it alone samples); other ranks get a placeholder.

Every rank runs the same runner code over the same batch, so both sides of each link call in
the same order, and each link is a FIFO channel. E.g. 5 layers on 2 stages: stage 0 holds
the embedding and layers 0-2, stage 1 layers 3-4, the norm and the LM head (a tied LM head is
read from the embedding's tensor there).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# Layers per stage, e.g. "3,2" (vLLM's VLLM_PP_LAYER_PARTITION); default near-equal, larger first.
PARTITION_ENV = "PAGODA_PP_LAYER_PARTITION"
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


class StageLink(Protocol):
    """What a stage needs of its process groups (pagoda.distributed.group.PipeLink)."""

    stage: int
    num_stages: int

    def send_next(self, t: torch.Tensor) -> None: ...

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def send_logits(self, t: torch.Tensor) -> None: ...

    def recv_logits(self, shape: tuple[int, ...]) -> torch.Tensor: ...


class MissingLayer(nn.Module):
    """Stands for a module another pipeline stage holds: no parameters, and never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def split_layers(num_layers: int, num_stages: int, partition: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: ``partition`` ("3,2") if given, else near-equal
    shares, larger first: split_layers(5, 2) -> [(0, 3), (3, 5)]."""
    if partition:
        try:
            counts = [int(c) for c in partition.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={partition!r}: expected layer counts such as 3,2") from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"{PARTITION_ENV}={partition!r} must give {num_stages} stages at least one layer "
                             f"each, {num_layers} layers in all")
    else:
        if num_layers < num_stages:
            raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    bounds = [sum(counts[:i]) for i in range(num_stages + 1)]
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class StagePlan:
    stage: int
    num_stages: int
    layers: tuple[int, int]   # [start, end) of the decoder layers this stage holds
    tied_head: bool           # the LM head is the embedding's matrix (read from its tensor)

    @classmethod
    def build(cls, num_layers: int, stage: int, num_stages: int, tie_word_embeddings: bool,
              partition: str | None = None) -> StagePlan:
        if partition is None:
            partition = os.environ.get(PARTITION_ENV) or None
        return cls(stage, num_stages, split_layers(num_layers, num_stages, partition)[stage], tie_word_embeddings)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds_layer(self, index: int) -> bool:
        return self.layers[0] <= index < self.layers[1]

    # ---- the module tree (on the meta device) ------------------------------------------

    def apply(self, model: nn.Module, link: StageLink) -> None:
        """Placeholders for what other stages hold; ``model.stage`` routes the forward."""
        layers = model.model.layers
        for i in range(len(layers)):
            if not self.holds_layer(i):
                layers[i] = MissingLayer()
        if not self.is_first:
            model.model.embed_tokens = MissingLayer()
        if not self.is_last:
            model.model.norm = MissingLayer()
            model.lm_head = MissingLayer()
        model.stage = PipelineStage(self, link)

    # ---- the checkpoint's tensors (pagoda's names) ----------------------------------------

    def holds(self, name: str) -> bool:
        """Whether this stage reads tensor ``name``: its layers', the embedding on the first
        stage (and on the last for a tied LM head), the final norm and LM head on the last;
        anything else (not a layer's) everywhere."""
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            return self.holds_layer(int(layer[1]))
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and self.tied_head)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True

    def rename(self, name: str) -> str:
        """The parameter a held tensor fills: on a last stage without the embedding, a tied
        LM head is the embedding's tensor."""
        if self.tied_head and not self.is_first and name == "model.embed_tokens.weight":
            return "lm_head.weight"
        return name


class PipelineStage:
    """``model.stage``: this stage's part of the forward and of the logits (module docstring)."""

    def __init__(self, plan: StagePlan, link: StageLink) -> None:
        self.plan = plan
        self.link = link

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list, meta) -> torch.Tensor:
        plan = self.plan
        num_tokens = input_ids.shape[0]
        if plan.is_first:
            x, residual = model.embed(input_ids), None
        else:
            hidden_size = model.config.hidden_size
            pair = self.link.recv_prev((2, num_tokens, hidden_size), model.activation_dtype)
            x, residual = pair[0], pair[1]
        x, residual = model.run_layers(x, residual, positions, kv_caches, meta, *plan.layers)
        if plan.is_last:
            return model.model.norm(x, residual)[0]
        self.link.send_next(torch.stack((x, residual)))
        return x.new_empty(num_tokens, 0)

    def compute_logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.plan.is_last:
            logits = model.head_logits(hidden)
            self.link.send_logits(logits)
            return logits
        return self.link.recv_logits((hidden.shape[0], model.config.vocab_size))
