"""POST /api/generate and /api/chat: Ollama's requests onto the engine calls the OpenAI
endpoints make (``OpenAIServing.prepare`` / ``group`` / ``start_stream``), with the
prompt rendered by the chat endpoint's template and tool helpers (``ChatServing``).

The timings of the last line are measured here, in nanoseconds on the monotonic clock:
``load_duration`` is the time from the request's arrival to its submission to the engine
(the template, tokenizing and checks: the model itself is always loaded),
``prompt_eval_duration`` from submission to the first output (queueing and prefill, and
the first token), ``eval_duration`` from the first output to the last, and
``total_duration`` from arrival to the last output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.ollama.protocol import (
    ChatRequest,
    GenerateRequest,
    GenerationRequest,
    image_parts,
)
from pagoda.entrypoints.ollama.responses import (
    NDJSON,
    ChatMessageOut,
    ChatResponse,
    GenerateResponse,
    ToolCallFunctionOut,
    ToolCallOut,
    error_line,
    now_rfc3339,
)
from pagoda.entrypoints.openai.errors import APIError, bad_request, internal_error
from pagoda.entrypoints.openai.request_group import (
    RequestGroup,
    RequestStopped,
    SubRequest,
)
from pagoda.entrypoints.openai.responses import TokenLogprob
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_engine import (
    ClientGone,
    OpenAIServing,
    SSEResponse,
    client_gone_response,
)
from pagoda.entrypoints.openai.tool_parsers import ToolCallStreamer
from pagoda.entrypoints.openai.tools import ToolPlan, plan_tools
from pagoda.lora.request import LoRARequest
from pagoda.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

LATEST = ":latest"


def ollama_name(name: str) -> str:
    """The name Ollama clients see: ``name:latest`` unless it has a tag already."""
    return name if ":" in name else name + LATEST


class NDJSONResponse(SSEResponse):
    """A stream of JSON lines that, like SSEResponse, always closes its request group."""

    media_type = NDJSON


@dataclass
class _Clock:
    """Arrival, submission and first-output times of one request (monotonic nanoseconds)."""

    started: int
    submitted: int = 0
    first: int = 0

    def timings(self, prompt_len: int, eval_count: int) -> dict[str, int]:
        ended = time.monotonic_ns()
        submitted = self.submitted or ended
        first = self.first or ended
        return {"total_duration": ended - self.started, "load_duration": submitted - self.started,
                "prompt_eval_count": prompt_len, "prompt_eval_duration": first - submitted,
                "eval_count": eval_count, "eval_duration": ended - first}  # fmt: skip


class _ToolStream:
    """Tool calls while streaming: Ollama sends each call whole, so the argument fragments
    of a call are held until the next call starts or the output ends."""

    def __init__(self, streamer: ToolCallStreamer) -> None:
        self.streamer = streamer
        self.pending: dict[int, list[str]] = {}  # call index -> [name, arguments so far]
        self.sent = 0

    def feed(self, c: CompletionOutput, text: str) -> tuple[str, list[ToolCallOut]]:
        """``text``: this step's new text of ``c`` (past any reasoning)."""
        delta = self.streamer.feed(text, final=c.just_finished)
        content, ready = delta.content, []
        for call in delta.calls:
            if call.name is not None:
                ready.extend(self._flush(below=call.index))
                self.pending[call.index] = [call.name, ""]
            if call.arguments:
                self.pending[call.index][1] += call.arguments
        if c.just_finished:
            ready.extend(self._flush(below=None))
        calls = []
        for name, arguments in ready:
            parsed = _object(arguments)
            if parsed is None:  # not an object (cut short): left as the text it was
                content += json.dumps({"name": name, "arguments": arguments})
                continue
            calls.append(_tool_call(self.sent, name, parsed))
            self.sent += 1
        return content, calls

    def _flush(self, below: int | None) -> list[list[str]]:
        done = sorted(i for i in self.pending if below is None or i < below)
        return [self.pending.pop(i) for i in done]


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _tool_call(index: int, name: str, arguments: dict[str, Any]) -> ToolCallOut:
    return ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                       function=ToolCallFunctionOut(index=index, name=name, arguments=arguments))  # fmt: skip


class OllamaServing(OpenAIServing):
    def __init__(self, chat: ChatServing) -> None:
        super().__init__(chat.engine, chat.state, chat.served_model_name, chat.request_timeout, chat.model_defaults)
        self.chat = chat

    # ---- models ----------------------------------------------------------------------
    def lookup(self, name: str) -> LoRARequest | None:
        """The adapter ``name`` means (None: the served model). Both ``model`` and
        ``model:latest`` name a model whose own name has no tag; 404 for anything else."""
        candidates = [name, name.removesuffix(LATEST)] if name.endswith(LATEST) else [name]
        for candidate in candidates:
            if candidate == self.served_model_name:
                return None
            lora = self.engine.lora_requests.get(candidate)
            if lora is not None:
                return lora
        raise APIError(404, f"model '{name}' not found: this server serves "
                       f"{', '.join(repr(ollama_name(n)) for n in self.model_names())}",
                       param="model", code="model_not_found")  # fmt: skip

    def model_names(self) -> list[str]:
        """The served model, then the loaded LoRA adapters."""
        return [self.served_model_name, *self.engine.lora_requests]

    # ---- /api/generate ---------------------------------------------------------------
    async def generate(self, body: GenerateRequest, raw_request: Request) -> Response:
        clock = _Clock(time.monotonic_ns())
        lora = self.lookup(body.model)
        body.check_supported()
        if not body.prompt:
            # Ollama's way to load a model: answer at once.
            load = GenerateResponse(model=body.model, created_at=now_rfc3339(), response="", done=True,
                                    done_reason="load")  # fmt: skip
            return Response(load.line(), media_type="application/json")
        context = list(body.context or [])
        images: list = []
        if body.raw:
            text: str | None = body.prompt
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=not context)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            user = {"role": "user", "content": image_parts(body.images, body.prompt)}
            text, ids, images = await asyncio.to_thread(self.chat.encode_chat_images, [*system, user],
                                                        template_kwargs=body.template_kwargs())  # fmt: skip
        if context:
            if images:
                raise bad_request("'images' cannot be combined with 'context'.", param="images")
            text, ids = None, context + ids
        sub = self._prepare(body, text, ids, lora, "prompt", images)
        return await self._respond(body, raw_request, sub, clock, None)

    # ---- /api/chat -------------------------------------------------------------------
    async def chat_turn(self, body: ChatRequest, raw_request: Request) -> Response:
        clock = _Clock(time.monotonic_ns())
        lora = self.lookup(body.model)
        body.check_supported()
        if not body.messages:
            load = ChatResponse(model=body.model, created_at=now_rfc3339(), message=ChatMessageOut(content=""),
                                done=True, done_reason="load")  # fmt: skip
            return Response(load.line(), media_type="application/json")
        plan = plan_tools(body.tools, None, None)
        text, ids, images = await asyncio.to_thread(self.chat.encode_chat_images, body.template_messages(),
                                                    plan=plan, template_kwargs=body.template_kwargs())  # fmt: skip
        sub = self._prepare(body, text, ids, lora, "messages", images, plan)
        return await self._respond(body, raw_request, sub, clock, plan)

    # ---- running ---------------------------------------------------------------------
    def _thinking(self, body: GenerationRequest) -> bool:
        """``think: true``: the reasoning comes back apart (``thinking``), read by the server's
        --reasoning-parser; a 400 without one."""
        if body.think is not True:
            return False
        if self.chat.reasoning_parser is None:
            raise bad_request("'think' needs a server started with --reasoning-parser (the model's reasoning is "
                              "read from its output).", param="think", code="unsupported_parameter")  # fmt: skip
        return True

    def _prepare(self, body: GenerationRequest, text: str | None, ids: list[int], lora: LoRARequest | None,
                 prompt_param: str, images: list | None = None, plan: ToolPlan | None = None) -> SubRequest:  # fmt: skip
        structured = body.structured_output()
        if self._thinking(body):
            structured = self.chat.with_reasoning(structured)  # the format applies after the reasoning
        params = self.chat.keep_markers(body.to_sampling_params(len(ids), self.engine.max_model_len, structured,
                                                                self.model_defaults.sampling), plan)  # fmt: skip
        prefix = "chat" if isinstance(body, ChatRequest) else "generate"
        return self.prepare(f"ollama-{prefix}-{uuid.uuid4().hex}", text, ids, lambda _: params, prompt_param,
                            "options.num_predict", "format", lora_request=lora, mm_inputs=images or ())  # fmt: skip

    async def _respond(self, body: GenerationRequest, raw_request: Request, sub: SubRequest, clock: _Clock,
                       plan: ToolPlan | None) -> Response:  # fmt: skip
        group = self.group(raw_request, [sub])
        clock.submitted = time.monotonic_ns()
        try:
            first = await self.start_stream(group)
        except ClientGone:
            return client_gone_response()
        clock.first = time.monotonic_ns()
        if body.stream is not False:
            lines = self._lines(body, sub, group, first, clock, plan)
            return NDJSONResponse(_guarded(lines), on_close=group.close)
        try:
            while await group.next() is not None:
                pass
        except RequestStopped as e:
            err = e.to_api_error()
            if err is None:
                return client_gone_response()
            raise err from None
        finally:
            await group.close()
        out = group.last[0]
        c = out.outputs[0] if out is not None and out.outputs else None
        return Response(self._final(body, sub, c, clock, plan, whole=True), media_type="application/json")

    def _final(self, body: GenerationRequest, sub: SubRequest, c: CompletionOutput | None, clock: _Clock,
               plan: ToolPlan | None, whole: bool) -> str:  # fmt: skip
        """The last line: the whole output (``whole``, not streaming) or none of it, with the timings."""
        token_ids = c.token_ids if c is not None else []
        reason = (c.finish_reason if c is not None else None) or "abort"
        fields: dict[str, Any] = {"model": body.model, "created_at": now_rfc3339(), "done": True,
                                  "done_reason": reason, **clock.timings(len(sub.prompt_token_ids), len(token_ids))}
        if whole and c is not None:
            fields["logprobs"] = self._logprobs(body, c.token_ids, c.logprobs)
        thinking, text = None, c.text if whole and c is not None else ""
        # (GPT-OSS's output is always split: its Harmony markup is no answer; the thinking shows with think.)
        if text and (self._thinking(body) or self.chat.harmony):
            thinking, content = self.chat.split_reasoning(text, plan)
            text, thinking = content or "", thinking if self._thinking(body) else None
        if isinstance(body, ChatRequest):
            message = self._message(plan, text, reason == "length") if whole else ChatMessageOut(content="")
            message.thinking = thinking
            return ChatResponse(message=message, **fields).line()
        return GenerateResponse(response=text, thinking=thinking, context=sub.prompt_token_ids + list(token_ids),
                                **fields).line()  # fmt: skip

    def _message(self, plan: ToolPlan | None, text: str, truncated: bool) -> ChatMessageOut:
        if plan is None or not plan.active:
            return ChatMessageOut(content=text)
        extracted = self.chat.tool_parser.for_tools(plan.tool_dicts()).extract(text, truncated=truncated)
        arguments = [_object(call.arguments) for call in extracted.calls]
        if any(a is None for a in arguments):  # Ollama's calls carry objects; anything else stays text
            return ChatMessageOut(content=text)
        calls = [_tool_call(i, call.name, a) for i, (call, a) in enumerate(zip(extracted.calls, arguments))]  # type: ignore[arg-type]
        return ChatMessageOut(content=extracted.content or "", tool_calls=calls or None)

    def _logprobs(self, body: GenerationRequest, token_ids: list[int], logprobs: Any) -> list[TokenLogprob] | None:
        if not body.logprobs or not logprobs:
            return None
        return self.logprobs.chat(token_ids, logprobs, body.top_logprobs or 0)

    async def _lines(self, body: GenerationRequest, sub: SubRequest, group: RequestGroup,
                     first: list[tuple[int, RequestOutput]], clock: _Clock, plan: ToolPlan | None,
                     ) -> AsyncIterator[str]:  # fmt: skip
        tools = (_ToolStream(self.chat.tool_parser.for_tools(plan.tool_dicts()).streamer())
                 if plan is not None and plan.active else None)
        show_thinking = self._thinking(body)
        reasoner = self.chat.reasoning_streamer(plan) if show_thinking or self.chat.harmony else None

        def lines(out: RequestOutput) -> list[str]:
            c = out.outputs[0]
            logprobs = self._logprobs(body, c.delta_token_ids, c.delta_logprobs)
            text, thinking = c.delta_text, None
            if reasoner is not None:
                split = reasoner.feed(text, final=c.just_finished)
                text, thinking = split.content, (split.reasoning or None) if show_thinking else None
            if isinstance(body, ChatRequest):
                content, calls = tools.feed(c, text) if tools is not None else (text, [])
                if not (content or calls or thinking or logprobs):
                    return []
                message = ChatMessageOut(content=content, thinking=thinking, tool_calls=calls or None)
                return [ChatResponse(model=body.model, created_at=now_rfc3339(), message=message, done=False,
                                     logprobs=logprobs).line()]  # fmt: skip
            if not (text or thinking or logprobs):
                return []
            return [GenerateResponse(model=body.model, created_at=now_rfc3339(), response=text, thinking=thinking,
                                     done=False, logprobs=logprobs).line()]  # fmt: skip

        for _, out in first:
            for line in lines(out):
                yield line
        while (item := await group.next()) is not None:
            for line in lines(item[1]):
                yield line
        last = group.last[0]
        yield self._final(body, sub, last.outputs[0] if last is not None and last.outputs else None, clock, plan,
                          whole=False)  # fmt: skip


async def _guarded(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass the lines through; an error after the 200 went out becomes a last ``{"error": ...}``
    line, and a client that left gets nothing more."""
    try:
        async for line in lines:
            yield line
    except RequestStopped as e:
        err = e.to_api_error()
        if err is None:
            logger.info("client disconnected; request aborted")
            return
        yield error_line(err)
    except APIError as e:
        yield error_line(e)
    except Exception:
        logger.exception("error while streaming an Ollama response")
        yield error_line(internal_error())
    finally:
        aclose = getattr(lines, "aclose", None)
        if aclose is not None:
            await aclose()
