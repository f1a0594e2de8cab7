"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.request_group import RequestGroup
from pagoda.entrypoints.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    sse,
)
from pagoda.entrypoints.openai.serving_engine import ClientGone, OpenAIServing, client_gone_response
from pagoda.outputs import CompletionOutput, RequestOutput


class ChatServing(OpenAIServing):
    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template makes of these messages; 400 if the template refuses them."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:
            # ChatTemplateError (a ValueError) is the template's own raise_exception(), e.g. roles
            # that do not alternate; other template errors also come from what the messages hold.
            raise bad_request(f"The chat template could not render the messages: {e}", param="messages") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        text = self.render(messages, add_generation_prompt)
        # The template already wrote BOS and the role markers; adding special tokens would double BOS.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        text, ids = self.encode_chat(body.template_messages())
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        sub = self.prepare(request_id, text, ids, body.requested_max_tokens, body.to_sampling_params,
                           "messages", max_param)  # fmt: skip
        group = self.group(raw_request, [sub])
        if body.stream:
            try:
                first = await self.start_stream(group)
            except ClientGone:
                return client_gone_response()
            return self.stream_response(group, self._events(body, request_id, group, first))
        try:
            outputs = await self.run_to_end(group)
        except ClientGone:
            return client_gone_response()
        out = outputs[0]
        choices = []
        for i in range(body.n):
            c = out.outputs[i] if out is not None and i < len(out.outputs) else None
            choices.append(
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(content=c.text if c else ""),
                    logprobs=self._logprobs(body, c, c.token_ids, c.logprobs) if c else None,
                    finish_reason=(c.finish_reason if c else None) or "abort",
                )
            )
        response = ChatCompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, usage=self.usage([sub], outputs)
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def _logprobs(
        self, body: ChatCompletionRequest, c: CompletionOutput, token_ids: list[int], logprobs: Any
    ) -> ChatLogprobs | None:
        if not body.logprobs or logprobs is None:
            return None
        return ChatLogprobs(content=self.logprobs.chat(token_ids, logprobs, body.top_logprobs or 0))

    async def _events(
        self, body: ChatCompletionRequest, request_id: str, group: RequestGroup, first: list[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        exclude = None if body.include_usage else {"usage"}

        def chunk(index: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None) -> str:  # fmt: skip
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return sse(
                ChatCompletionChunk(id=request_id, created=created, model=self.served_model_name, choices=[choice]),
                exclude,
            )

        def chunks(out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                logprobs = self._logprobs(body, c, c.delta_token_ids, c.delta_logprobs) if c.delta_logprobs else None
                if c.delta_text or logprobs:
                    events.append(chunk(c.index, {"content": c.delta_text}, logprobs))
                if c.just_finished:
                    # As OpenAI: the finish reason comes in a chunk of its own with an empty delta.
                    events.append(chunk(c.index, {}, finish_reason=c.finish_reason))
            return events

        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        for _, out in first:
            for event in chunks(out):
                yield event
        while (item := await group.next()) is not None:
            for event in chunks(item[1]):
                yield event
        last = group.last[0]
        for i in range(body.n):
            c = last.outputs[i] if last is not None and i < len(last.outputs) else None
            if c is None or not c.finished:
                yield chunk(i, {}, finish_reason="abort")
        if body.include_usage:
            usage = self.usage(group.subrequests, group.last)
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=self.served_model_name, choices=[],
                                          usage=usage))  # fmt: skip
