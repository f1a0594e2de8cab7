"""Logits processors for tests/model/test_logits_processors.py, written as a vLLM user writes
them (only the import differs) and loaded by name, as ``--logits-processors`` loads them.

Each reads its own keys of a request's ``extra_args``:

- ``ForceTokens``: {"force_tokens": "12 34 56"}: output position k is the (k mod 3)th of
  those tokens. A row processed as another request's, or an output list that does not grow,
  shows at once.
- ``BatchRecorder``: records every BatchUpdate and keeps its own index -> request map; checks
  that the rows stay dense, that ``apply`` gets as many rows, and that each forced row (after
  ``ForceTokens``: it is argmax-invariant, so it runs later) is its own request's.
- ``TokenBias`` (a per-request callable of 2 arguments): {"bias_token": id, "bias": value}.
- ``RepeatPrompt`` (3 arguments): {"repeat_prompt": true}: the output repeats the prompt's tokens.
"""

from __future__ import annotations

import torch

from pagoda.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)

# The recorders built in this process, newest last (the tests read them).
RECORDERS: list[BatchRecorder] = []


def forced_tokens(params) -> list[int] | None:
    value = (params.extra_args or {}).get("force_tokens")
    return [int(t) for t in value.split()] if value is not None else None


class ForceTokens(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        value = (sampling_params.extra_args or {}).get("force_tokens")
        if value is not None and (not isinstance(value, str) or not value.split()
                                  or not all(t.isdigit() for t in value.split())):
            raise ValueError(f"force_tokens must be token ids separated by spaces, got {value!r}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}   # index -> (tokens, the request's output)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new(params, prompt_ids, output_ids):
            tokens = forced_tokens(params)
            return (tokens, output_ids) if tokens else None

        process_dict_updates(self.rows, batch_update, new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (tokens, output) in self.rows.items():
            logits[index] = float("-inf")
            logits[index, tokens[len(output) % len(tokens)]] = 0.0
        return logits


class BatchRecorder(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.config = vllm_config
        self.updates: list[BatchUpdate | None] = []
        self.rows: dict[int, tuple[str, list[int] | None, list[int]]] = {}   # index -> (tag, forced, output)
        self.num_applied = 0
        self.max_batch_size = 0
        RECORDERS.append(self)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output in batch_update.added:
            self.rows[index] = ((params.extra_args or {}).get("tag", "?"), forced_tokens(params), output)
        for a, b, direction in batch_update.moved:
            at_a, at_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if at_a is not None:
                self.rows[b] = at_a
            if direction is MoveDirectionality.SWAP and at_b is not None:
                self.rows[a] = at_b
        assert sorted(self.rows) == list(range(batch_update.batch_size)), (self.rows.keys(), batch_update)
        self.max_batch_size = max(self.max_batch_size, batch_update.batch_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == len(self.rows), (logits.shape, len(self.rows))
        for index, (tag, forced, output) in self.rows.items():
            if forced:
                want = forced[len(output) % len(forced)]
                assert int(logits[index].argmax()) == want, (tag, index, want, int(logits[index].argmax()))
        self.num_applied += 1
        return logits


class TokenBias(AdapterLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        args = sampling_params.extra_args or {}
        if "bias_token" in args and not isinstance(args["bias_token"], int):
            raise ValueError(f"bias_token must be a token id, got {args['bias_token']!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if "bias_token" not in args:
            return None
        token, bias = args["bias_token"], float(args.get("bias", 100.0))

        def add(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            row[token] += bias   # in place: the batch's row itself
            return row

        return add


class RepeatPrompt(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("repeat_prompt"):
            return None

        def repeat(prompt_ids: list[int], output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            out = torch.full_like(row, float("-inf"))   # a new tensor: copied into the batch's row
            out[prompt_ids[len(output_ids) % len(prompt_ids)]] = 0.0
            return out

        return repeat
