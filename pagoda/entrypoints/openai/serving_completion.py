"""POST /v1/completions: each prompt runs as its own engine request with n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.request_group import RequestGroup, SubRequest
from pagoda.entrypoints.openai.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, sse
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
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            subrequests.append(
                self.prepare(sub_id, text, ids, to_params, "prompt", "max_tokens", structured_param,
                             lora_request=lora, priority=body.priority)
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
    def _logprobs(self, body: CompletionRequest, c: CompletionOutput) -> CompletionLogprobs | None:
        if body.logprobs is None or c.logprobs is None:
            return None
        return self.logprobs.completion(c.token_ids, c.logprobs, body.logprobs, 0)[0]

    def _full_response(
        self,
        body: CompletionRequest,
        request_id: str,
        subrequests: list[SubRequest],
        outputs: list[RequestOutput | None],
    ) -> CompletionResponse:
        choices = []
        for p, out in enumerate(outputs):
            for i in range(body.n):
                c = out.outputs[i] if out is not None and i < len(out.outputs) else None
                choices.append(
                    CompletionChoice(
                        text=c.text if c else "",
                        index=p * body.n + i,
                        logprobs=self._logprobs(body, c) if c else None,
                        finish_reason=(c.finish_reason if c else None) or "abort",
                    )
                )
        return CompletionResponse(
            id=request_id, model=self.response_model(body.model), choices=choices, usage=self.usage(subrequests, outputs)
        )

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
        exclude = None if body.include_usage else {"usage"}
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token

        def chunks(p: int, out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                index = p * body.n + c.index
                logprobs = None
                if body.logprobs is not None and c.delta_logprobs:
                    logprobs, offsets[index] = self.logprobs.completion(
                        c.delta_token_ids, c.delta_logprobs, body.logprobs, offsets.get(index, 0)
                    )
                if not (c.delta_text or logprobs or c.just_finished):
                    continue
                choice = CompletionChoice(
                    text=c.delta_text, index=index, logprobs=logprobs,
                    finish_reason=c.finish_reason if c.just_finished else None,
                )  # fmt: skip
                chunk = CompletionResponse(id=request_id, created=created, model=self.response_model(body.model),
                                           choices=[choice])  # fmt: skip
                events.append(sse(chunk, exclude))
            return events

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
                    choice = CompletionChoice(text="", index=p * body.n + i, finish_reason="abort")
                    chunk = CompletionResponse(id=request_id, created=created, model=self.response_model(body.model),
                                               choices=[choice])  # fmt: skip
                    yield sse(chunk, exclude)
        if body.include_usage:
            usage = self.usage(group.subrequests, group.last)
            chunk = CompletionResponse(
                id=request_id, created=created, model=self.response_model(body.model), choices=[], usage=usage
            )
            yield sse(chunk)
