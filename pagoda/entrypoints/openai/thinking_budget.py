"""A cap on the tokens of the reasoning section (Anthropic's ``thinking.budget_tokens``, and
vLLM's ``thinking_token_budget`` in chat completions), kept by running one generation as at most two engine requests, one after the other.

The sampler has no per-request logits processor that could force ``</think>`` once the
budget is spent, so the cap is kept here, with what every engine already does exactly:
stop at ``max_tokens``.

1. Phase 1 is the request with ``max_tokens = budget``. If it ends before that (end of turn,
   a stop sequence), that was the whole generation: one engine request, as without a budget.
2. If it used the whole budget, phase 2 continues it: its prompt is the original prompt, the
   phase-1 tokens, and, when phase 1 ended inside the reasoning, the parser's
   ``end_of_reasoning`` (``"\\n</think>\\n\\n"``) as if the model had written it; it may
   generate what is left of ``max_tokens``. A continuation of greedy decoding is what one
   request would have generated, and the prefix cache makes re-reading phase 1 cheap. (The
   costs: an output longer than the budget takes two requests even when the reasoning ended
   within it; seeded sampling is re-seeded at the seam; frequency and presence penalties in
   phase 2 count only its own tokens, as phase 1's are now prompt.)

To the serving code ``BudgetedGroup`` is a ``RequestGroup`` of one subrequest whose outputs
are the two phases joined: one text, one token list (the forced tokens counted as output
tokens), one finish, the original prompt. One engine request runs at a time; disconnect,
timeout (over both phases together) and shutdown abort whichever one runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Self

from starlette.requests import Request

from pagoda.entrypoints.openai.request_group import (
    RequestGroup,
    RequestStopped,
    SubRequest,
)
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.reasoning import ReasoningParser

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.serving_engine import OpenAIServing


class BudgetedGroup:
    """``sub`` (already checked by ``prepare``, one choice) with at most ``budget`` tokens of
    reasoning, as read by ``parser``."""

    def __init__(self, serving: OpenAIServing, raw_request: Request, sub: SubRequest, budget: int,
                 parser: ReasoningParser, params: tuple[str, str] = ("messages", "max_tokens"), priority: int = 0,
                 cache_salt: str | None = None) -> None:  # fmt: skip
        """``params``: the request's fields a 400 about phase 2's prompt or length names."""
        if sub.params.n != 1 or sub.params.logprobs is not None or sub.params.structured_outputs is not None:
            # A constraint would restart at the seam, and forced tokens have no alternatives.
            raise ValueError("a thinking budget applies to one choice, without logprobs or a constraint")
        self.serving, self.sub, self.budget, self.parser = serving, sub, budget, parser
        self.params = params
        self.subrequests = [sub]
        self.last: list[RequestOutput | None] = [None]
        self.num_phases = 1
        # What phase 2 continues: phase 1's text and tokens, with the forced ones.
        self._prefix_text = ""
        self._prefix_ids: list[int] = []
        self._num_cached_tokens = 0
        self._started_at = 0.0
        params = dataclasses.replace(sub.params, max_tokens=budget, min_tokens=min(sub.params.min_tokens, budget))
        phase1 = dataclasses.replace(sub, params=params)
        self._group = serving.group(raw_request, [phase1], priority, cache_salt)

    @property
    def _max_tokens(self) -> int:
        limit = self.sub.params.max_tokens
        return limit if limit is not None else self.serving.engine.max_model_len - len(self.sub.prompt_token_ids)

    # ---- RequestGroup's interface ------------------------------------------------------
    def start(self) -> None:
        self._started_at = time.monotonic()
        self._group.start()

    async def close(self) -> None:
        await self._group.close()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def next(self) -> tuple[int, RequestOutput] | None:
        item = await self._group.next()
        if item is None:
            return None
        raw = item[1]
        out = self._joined(raw)
        c = raw.outputs[0] if raw.outputs else None
        if self.num_phases == 1 and c is not None and c.just_finished and self._budget_spent(c):
            out = await self._continue(raw, c)
        self.last = [out]
        return 0, out

    async def first_outputs(self) -> list[tuple[int, RequestOutput]]:
        item = await self.next()
        return [] if item is None else [item]

    async def final_outputs(self) -> list[RequestOutput | None]:
        while await self.next() is not None:
            pass
        return self.last

    # ---- the seam ----------------------------------------------------------------------
    def _budget_spent(self, c: CompletionOutput) -> bool:
        return c.finish_reason == "length" and len(c.token_ids) >= self.budget and self.budget < self._max_tokens

    async def _continue(self, raw: RequestOutput, c: CompletionOutput) -> RequestOutput:
        """Start phase 2 after ``c``, phase 1's last output; that output, made unfinished and
        carrying the forced tokens (if any), is what the client sees of the seam."""
        closing = self.parser.end_of_reasoning if self.parser.in_reasoning(c.text) else ""
        closing_ids = self.serving.tokenizer.encode(closing, add_special_tokens=False) if closing else []
        left = self._max_tokens - len(c.token_ids) - len(closing_ids)
        if left < 1:
            return raw  # no room to end the reasoning and answer: it ends at max_tokens
        while await self._group.next() is not None:
            pass  # phase 1 finished; only the end of its stream is left
        await self._group.close()
        self._prefix_text, self._prefix_ids = c.text + closing, [*c.token_ids, *closing_ids]
        self._num_cached_tokens = raw.num_cached_tokens
        self._group = self._phase2(left)
        self.num_phases = 2
        self._group.start()
        joined = dataclasses.replace(
            c, text=self._prefix_text, token_ids=list(self._prefix_ids), finish_reason=None, stop_reason=None,
            just_finished=False, delta_text=c.delta_text + closing, delta_token_ids=[*c.delta_token_ids, *closing_ids],
        )  # fmt: skip
        return dataclasses.replace(raw, outputs=[joined], finished=False)

    def _phase2(self, max_tokens: int) -> RequestGroup:
        first = self._group
        sub = self.sub
        min_tokens = max(sub.params.min_tokens - len(self._prefix_ids), 0)
        params = dataclasses.replace(sub.params, max_tokens=max_tokens, min_tokens=min_tokens)
        continued = self.serving.prepare(f"{sub.request_id}-2", None, [*sub.prompt_token_ids, *self._prefix_ids],
                                         lambda _: params, *self.params,
                                         lora_request=sub.lora_request, mm_inputs=sub.mm_inputs)  # fmt: skip
        timeout = first.timeout
        if timeout is not None:
            timeout -= time.monotonic() - self._started_at
            if timeout <= 0:
                raise RequestStopped("timeout", first.timeout)
        return RequestGroup(self.serving.engine, self.serving.state, [continued], first.raw_request, timeout,
                            priority=first.priority, cache_salt=first.cache_salt, tenant=first.tenant,
                            background=first.background)  # fmt: skip

    def _joined(self, raw: RequestOutput) -> RequestOutput:
        """A phase-2 output as part of the whole generation (phase 1's are that already)."""
        if self.num_phases == 1:
            return raw
        outputs = [dataclasses.replace(c, text=self._prefix_text + c.text, token_ids=[*self._prefix_ids, *c.token_ids])
                   for c in raw.outputs]  # fmt: skip
        sub = self.sub
        return dataclasses.replace(raw, request_id=sub.request_id, prompt=sub.prompt,
                                   prompt_token_ids=sub.prompt_token_ids, outputs=outputs,
                                   num_cached_tokens=self._num_cached_tokens)  # fmt: skip
