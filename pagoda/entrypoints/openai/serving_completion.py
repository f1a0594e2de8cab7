"""POST /v1/completions: each prompt runs as its own engine request with n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.request_group import RequestGroup, SubRequest
from pagoda.entrypoints.openai.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage, sse
from pagoda.entrypoints.openai.serving_engine import ClientGone, OpenAIServing, client_gone_response
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams


class CompletionServing(OpenAIServing):
    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        lora = self.check_model(body.model)
        body.check_supported()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = body.prompts()
        structured, structured_param = body.structured_output()

        def to_params(default_max_tokens: int) -> SamplingParams:
            return body.to_sampling_params(default_max_tokens, structured, self.model_defaults.sampling)

        subrequests = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                text: str | None = prompt
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            else:
                text, ids = None, list(prompt)
            kept = self.truncate(ids, body.truncate_prompt_tokens, body.truncation_side)
            if len(kept) < len(ids):
                ids, text = kept, None  # the kept tokens are the prompt now
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            subrequests.append(
                self.prepare(sub_id, text, ids, to_params, "prompt", "max_tokens", structured_param,
                             lora_request=lora, priority=body.priority,
                             beam=body.beam_search_params if body.use_beam_search else None)
            )
        group = self.group(raw_request, subrequests, body.priority, body.cache_salt)
        if body.stream:
            return await self._stream(body, request_id, group)
        try:
            outputs = await self.run_to_end(group)
        except ClientGone:
            return client_gone_response()
        return Response(
            self._full_response(body, request_id, subrequests, outputs).model_dump_json(),
            media_type="application/json",
        )

    # ---- one JSON response ------------------------------------------------------------
    def _echo_text(self, sub: SubRequest) -> str:
        """What echo puts before a choice's text: the prompt as given (token ids decoded)."""
        if sub.prompt is not None:
            return sub.prompt
        return self.tokenizer.decode(sub.prompt_token_ids, skip_special_tokens=False)

    def _logprobs(self, body: CompletionRequest, sub: SubRequest, out: RequestOutput,
                  c: CompletionOutput) -> CompletionLogprobs | None:  # fmt: skip
        """The legacy logprobs; with echo the prompt's tokens come first (the first with null
        logprobs: nothing precedes it), as OpenAI returns them."""
        if body.logprobs is None or c.logprobs is None:
            return None
        tracked = body.logprob_token_ids or ()
        as_ids = bool(body.return_tokens_as_token_ids)
        offset, result = 0, None
        if body.echo and out.prompt_logprobs is not None:
            result, offset = self.logprobs.completion(sub.prompt_token_ids, out.prompt_logprobs, body.logprobs, 0,
                                                      tracked, as_token_ids=as_ids)  # fmt: skip
        return self.logprobs.completion(c.token_ids, c.logprobs, body.logprobs, offset, tracked, result,
                                        as_token_ids=as_ids)[0]  # fmt: skip

    def _full_response(
        self,
        body: CompletionRequest,
        request_id: str,
        subrequests: list[SubRequest],
        outputs: list[RequestOutput | None],
    ) -> CompletionResponse:
        choices = []
        for p, (sub, out) in enumerate(zip(subrequests, outputs)):
            echo = self._echo_text(sub) if body.echo else ""
            prompt_logprobs = None
            if body.prompt_logprobs is not None and out is not None and out.prompt_logprobs is not None:
                prompt_logprobs = self.logprobs.prompt(out.prompt_logprobs)
            for i in range(body.n):
                c = out.outputs[i] if out is not None and i < len(out.outputs) else None
                choices.append(
                    CompletionChoice(
                        text=echo + (c.text if c else ""),
                        index=p * body.n + i,
                        logprobs=self._logprobs(body, sub, out, c) if c and out else None,
                        finish_reason=(c.finish_reason if c else None) or "abort",
                        prompt_logprobs=prompt_logprobs,
                        prompt_token_ids=subrequests[p].prompt_token_ids if body.return_token_ids else None,
                        token_ids=(list(c.token_ids) if c else []) if body.return_token_ids else None,
                    )
                )
        return CompletionResponse(
            id=request_id, model=self.response_model(body.model), choices=choices,
            usage=self.usage(subrequests, outputs), metrics=self.request_metrics(outputs),
        )  # fmt: skip

    # ---- streaming ---------------------------------------------------------------------
    async def _stream(self, body: CompletionRequest, request_id: str, group: RequestGroup) -> Response:
        try:
            first = await self.start_stream(group)
        except ClientGone:
            return client_gone_response()
        return self.stream_response(group, self._events(body, request_id, group, first))

    async def _events(
        self, body: CompletionRequest, request_id: str, group: RequestGroup, first: list[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = body.stream_usage(self.force_include_usage)
        exclude = None if include_usage else {"usage"}  # as OpenAI: "usage": null until the last
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        emitted: dict[int, int] = {}  # choice index -> tokens streamed so far (continuous usage)
        started: set[int] = set()  # choices that sent a chunk (the first carries prompt_token_ids)
        prompt_tokens = sum(len(s.prompt_token_ids) for s in group.subrequests)

        def usage_now() -> Usage | None:
            if not continuous_usage:
                return None
            cached = sum(o.num_cached_tokens for o in group.last if o is not None)
            return Usage.of(prompt_tokens, sum(emitted.values()), cached)

        def chunks(p: int, out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                index = p * body.n + c.index
                logprobs = None
                if body.logprobs is not None and c.delta_logprobs:
                    logprobs, offsets[index] = self.logprobs.completion(
                        c.delta_token_ids, c.delta_logprobs, body.logprobs, offsets.get(index, 0),
                        body.logprob_token_ids or (), as_token_ids=bool(body.return_tokens_as_token_ids),
                    )
                emitted[index] = len(c.token_ids)
                tokens_to_show = bool(body.return_token_ids and c.delta_token_ids)
                if not (c.delta_text or logprobs or c.just_finished or tokens_to_show):
                    continue
                first = index not in started
                started.add(index)
                choice = CompletionChoice(
                    text=c.delta_text, index=index, logprobs=logprobs,
                    finish_reason=c.finish_reason if c.just_finished else None,
                    prompt_token_ids=group.subrequests[p].prompt_token_ids if body.return_token_ids and first else None,
                    token_ids=list(c.delta_token_ids) if body.return_token_ids else None,
                )  # fmt: skip
                chunk = CompletionResponse(id=request_id, created=created, model=self.response_model(body.model),
                                           choices=[choice], usage=usage_now())  # fmt: skip
                events.append(sse(chunk, exclude))
            return events

        if body.echo:  # the prompt first, in a chunk of its own per choice, with its logprobs if asked
            first_of = dict(first)
            for p, sub in enumerate(group.subrequests):
                echo_logprobs, offset = None, 0
                out = first_of.get(p)
                if body.logprobs is not None and out is not None and out.prompt_logprobs is not None:
                    echo_logprobs, offset = self.logprobs.completion(
                        sub.prompt_token_ids, out.prompt_logprobs, body.logprobs, 0, body.logprob_token_ids or (),
                        as_token_ids=bool(body.return_tokens_as_token_ids))  # fmt: skip
                for i in range(body.n):
                    offsets[p * body.n + i] = offset
                    choice = CompletionChoice(text=self._echo_text(sub), index=p * body.n + i, logprobs=echo_logprobs)
                    yield sse(CompletionResponse(id=request_id, created=created, model=self.response_model(body.model),
                                                 choices=[choice]), exclude)  # fmt: skip
        for p, out in first:
            for event in chunks(p, out):
                yield event
        while (item := await group.next()) is not None:
            for event in chunks(*item):
                yield event
        # A prompt whose engine stream ended without finishing still owes its choices an ending.
        for p, last in enumerate(group.last):
            for i in range(body.n):
                c = last.outputs[i] if last is not None and i < len(last.outputs) else None
                if c is None or not c.finished:
                    choice = CompletionChoice(text="", index=p * body.n + i, finish_reason="abort",
                                              token_ids=[] if body.return_token_ids else None)  # fmt: skip
                    chunk = CompletionResponse(id=request_id, created=created, model=self.response_model(body.model),
                                               choices=[choice], usage=usage_now())  # fmt: skip
                    yield sse(chunk, exclude)
        if include_usage:
            usage = self.usage(group.subrequests, group.last)
            chunk = CompletionResponse(
                id=request_id, created=created, model=self.response_model(body.model), choices=[], usage=usage,
                metrics=self.request_metrics(group.last),
            )  # fmt: skip
            yield sse(chunk)
