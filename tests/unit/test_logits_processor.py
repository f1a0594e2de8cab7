"""Logits processors without a model: the BatchUpdates ProcessorBatch computes from the
runner's rows (exact indices), process_dict_updates (moves and swaps), where the sampler
applies the two groups and through which permutation, loading by name, extra_args and the
options that do not combine."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagoda.config import EngineConfig
from pagoda.config.engine import GROUPS
from pagoda.config.options import add_option_groups, option_values
from pagoda.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
    processor_name,
    resolve_processor_names,
)
from pagoda.sample.processor_batch import ProcessorBatch, ProcessorRow
from pagoda.sample.sampler import Sampler, SamplingMetadata, SamplingRow
from pagoda.sampling_params import SamplingParams
from pagoda.validation import InvalidRequestError, RequestLimits, validate_request

UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
CPU = torch.device("cpu")
PLUGINS = "tests.model.logits_processor_plugins"


class Rows:
    """Requests by name, each with its own output list (the runner's state)."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = {}

    def __call__(self, *names: str) -> list[ProcessorRow]:
        return [ProcessorRow(n, SamplingParams(extra_args={"tag": n}), [1], self.outputs.setdefault(n, []))
                for n in names]


def _summary(update: BatchUpdate | None) -> tuple | None:
    if update is None:
        return None
    return (update.batch_size, list(update.removed), [(i, p.extra_args["tag"]) for i, p, _, _ in update.added],
            list(update.moved))


def test_batch_updates_keep_rows_dense_and_stable() -> None:
    batch, rows = ProcessorBatch([], CPU), Rows()
    update, order = batch.update(rows("a", "b", "c", "d"))
    assert _summary(update) == (4, [], [(0, "a"), (1, "b"), (2, "c"), (3, "d")], []) and order == [0, 1, 2, 3]
    # The runner lists decodes first, in any order: the rows stay, the permutation follows.
    update, order = batch.update(rows("d", "a", "b", "c"))
    assert update is None and order == [1, 2, 3, 0]
    # b finishes: d, the last row, fills its hole.
    update, order = batch.update(rows("a", "c", "d"))
    assert _summary(update) == (3, [1], [], [(3, 1, UNI)]) and [r.req_id for r in batch.rows] == ["a", "d", "c"]
    assert order == [0, 2, 1]
    # a finishes and e arrives: e takes a's row, nothing moves.
    update, order = batch.update(rows("c", "d", "e"))
    assert _summary(update) == (3, [0], [(0, "e")], []) and [r.req_id for r in batch.rows] == ["e", "d", "c"]
    # Two leave, one arrives: the lowest hole is taken, the other filled from the end.
    update, _ = batch.update(rows("c", "f"))
    assert _summary(update) == (2, [0, 1], [(0, "f")], [(2, 1, UNI)]) and [r.req_id for r in batch.rows] == ["f", "c"]
    # The last row leaves: nothing moves.
    update, _ = batch.update(rows("f"))
    assert _summary(update) == (1, [1], [], [])
    # A request rebuilt by the runner (preempted, resumed: a new output list) is removed and added again.
    rows.outputs["f"] = []
    update, _ = batch.update(rows("f"))
    assert _summary(update) == (1, [0], [(0, "f")], [])
    update, order = batch.update([])
    assert _summary(update) == (0, [0], [], []) and order == []


def test_the_added_output_list_is_the_runners_own() -> None:
    batch, rows = ProcessorBatch([], CPU), Rows()
    update, _ = batch.update(rows("a"))
    rows.outputs["a"].append(5)
    assert update.added[0][3] == [5]


def test_process_dict_updates_moves_and_swaps() -> None:
    state = {0: "a", 1: "b", 2: "c"}
    update = BatchUpdate(3, removed=[1], added=[(1, SamplingParams(extra_args={"x": "e"}), None, [])],
                         moved=[(0, 2, SWAP)])
    assert process_dict_updates(state, update, lambda p, _, __: p.extra_args["x"])
    assert state == {0: "c", 1: "e", 2: "a"}
    # One-way: the source row is empty afterwards; an added request with nothing to hold clears its row.
    update = BatchUpdate(2, removed=[], added=[(0, SamplingParams(), None, [])], moved=[(2, 1, UNI)])
    process_dict_updates(state, update, lambda p, _, __: None)
    assert state == {1: "a"}
    assert not process_dict_updates(state, None, lambda p, _, __: None)


class AddToRow(LogitsProcessor):
    """Adds 100 x (1 + its row index) to token (its row index): the sampler's row order shows."""

    def __init__(self, vllm_config, device, is_pin_memory, invariant: bool = False) -> None:
        self.invariant, self.calls = invariant, 0

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for i in range(logits.shape[0]):
            logits[i, i] += 100.0 * (1 + i)
        return logits


def _row(temperature: float = 0.0, **kwargs) -> SamplingRow:
    params = SamplingParams(temperature=temperature, seed=0, **kwargs)
    return SamplingRow(params, [1], [], torch.Generator().manual_seed(0) if temperature else None, frozenset())


def test_the_sampler_applies_processors_in_their_row_order() -> None:
    proc = AddToRow(None, CPU, False)
    batch, rows = ProcessorBatch([proc], CPU), Rows()
    batch.step(rows("a", "b", "c"))
    logits = torch.zeros(3, 8)
    before = logits.clone()
    md = SamplingMetadata.from_rows([_row(), _row(), _row()], 8, CPU)
    md.logits_processors = batch.step(rows("c", "a", "b"))   # the sampler's rows: c, a, b
    out = Sampler()(logits, md)
    # Processors' rows: a 0, b 1, c 2, so the sampler's row j gets token (a, b, c).index.
    assert out.sampled_token_ids.tolist() == [2, 0, 1]
    assert torch.equal(logits, before)   # the sampler's input stays untouched


def test_masks_and_bans_win_over_processors_and_logprobs_show_them() -> None:
    proc = AddToRow(None, CPU, False)
    batch, rows = ProcessorBatch([proc], CPU), Rows()
    md = SamplingMetadata.from_rows([_row(allowed_token_ids=[3, 4], logprobs=1)], 8, CPU)
    md.logits_processors = batch.step(rows("a"))
    out = Sampler()(torch.zeros(1, 8), md)
    # Token 0 got +100 but allowed_token_ids keeps it out.
    assert out.sampled_token_ids.item() in (3, 4) and proc.calls == 1
    md = SamplingMetadata.from_rows([_row(logprobs=1)], 8, CPU)
    md.logits_processors = batch.step(rows("a"))
    out = Sampler()(torch.zeros(1, 8), md)
    assert out.sampled_token_ids.item() == 0 and out.logprobs.item() > -1e-6


def test_argmax_invariant_processors_run_for_random_rows_only() -> None:
    proc = AddToRow(None, CPU, False, invariant=True)
    batch, rows = ProcessorBatch([proc], CPU), Rows()
    assert batch.argmax_invariant == [proc] and not batch.non_argmax_invariant
    md = SamplingMetadata.from_rows([_row()], 8, CPU)
    md.logits_processors = batch.step(rows("a"))
    logits = torch.zeros(1, 8)
    logits[0, 5] = 1.0
    assert Sampler()(logits, md).sampled_token_ids.item() == 5 and proc.calls == 0
    md = SamplingMetadata.from_rows([_row(temperature=1.0, logprobs=0)], 8, CPU)
    md.logits_processors = batch.step(rows("a"))
    out = Sampler()(logits, md)
    # After temperature and logprobs: token 0's +100 decides the draw, not the logprob shown.
    assert out.sampled_token_ids.item() == 0 and proc.calls == 1 and out.logprobs.item() < -1.0


def test_names_load_and_bad_ones_are_refused() -> None:
    from tests.model.logits_processor_plugins import ForceTokens

    assert processor_name(ForceTokens) == f"{PLUGINS}:ForceTokens"
    assert resolve_processor_names([ForceTokens, f"{PLUGINS}.TokenBias"]) == (f"{PLUGINS}:ForceTokens",
                                                                             f"{PLUGINS}.TokenBias")

    class Local(AddToRow):
        pass

    for spec, message in [(Local, "cannot be loaded by its name"), ("nothing", "is not a class name"),
                          ("no_such_module_xyz:P", "no module named 'no_such_module_xyz'"),
                          (f"{PLUGINS}:Nope", "has no 'Nope'"), ("json:dumps", "is not a subclass"),
                          ("pagoda.sample.logits_processor:AdapterLogitsProcessor", "is abstract"),
                          ([ForceTokens, f"{PLUGINS}.ForceTokens"], "listed twice"), (3, "entries are class names")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(logits_processors=spec if isinstance(spec, list) else [spec])


def test_the_option_and_what_it_does_not_combine_with() -> None:
    parser = argparse.ArgumentParser()
    add_option_groups(parser, GROUPS, "serve")
    args = parser.parse_args(["--logits-processors", f"{PLUGINS}:ForceTokens", f"{PLUGINS}:TokenBias"])
    config = EngineConfig(**option_values(args, GROUPS))
    assert config.logits_processors == (f"{PLUGINS}:ForceTokens", f"{PLUGINS}:TokenBias")
    assert EngineConfig().logits_processors is None
    with pytest.raises(ValueError, match="--logits-processors cannot be combined with --speculative-config"):
        EngineConfig(logits_processors=[f"{PLUGINS}:ForceTokens"],
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="--logits-processors cannot be combined with --task embed"):
        EngineConfig(logits_processors=[f"{PLUGINS}:ForceTokens"], task="embed")


def test_extra_args_are_checked_and_need_processors() -> None:
    assert SamplingParams(extra_args={"a": "x", "b": 2, "c": 0.5, "d": True}).extra_args == {
        "a": "x", "b": 2, "c": 0.5, "d": True}
    for bad, message in [([1], "must be an object"), ({1: "x"}, "keys must be non-empty strings"),
                         ({"a": None}, "values must be strings"), ({"a": float("nan")}, "must be finite"),
                         ({"a": 2**70}, "signed 64-bit"), ({"a": "x" * 20000}, "at most 16384 characters")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(extra_args=bad)
    params = SamplingParams(extra_args={"force_tokens": "1 2"})
    with pytest.raises(InvalidRequestError, match="loads none") as e:
        validate_request([1], params, RequestLimits(32, 100))
    assert e.value.param == "extra_args"
    limits = RequestLimits(32, 100, logits_processors=(f"{PLUGINS}:ForceTokens",))
    validate_request([1], params, limits)
    with pytest.raises(InvalidRequestError, match="force_tokens must be token ids"):
        validate_request([1], SamplingParams(extra_args={"force_tokens": "x"}), limits)
