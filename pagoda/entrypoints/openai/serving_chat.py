"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated.

With tools (see ``tools.py``), the output is read by the tool parser: calls become
``message.tool_calls`` (``delta.tool_calls`` while streaming: id, type and name first,
then the arguments in fragments) and ``finish_reason`` becomes ``"tool_calls"``.

With a reasoning parser (``--reasoning-parser``), what the model wrote between ``<think>`` and
``</think>`` is ``message.reasoning_content`` (``delta.reasoning_content``), and only the rest
is content: tool calls are read from it, and a structured output or forced tool constraint
applies to it, after the reasoning the grammar leaves free. vLLM's ``thinking_token_budget``
caps the reasoning (``thinking_budget.py``).

GPT-OSS (a model whose chat template writes Harmony's ``<|channel|>``, or whose vocabulary is
GPT-OSS's) speaks OpenAI's Harmony format (pagoda/reasoning/harmony.py): its prompts are rendered by the
Harmony renderer rather than the chat template, and its outputs are always read by the
``openai_gptoss`` reasoning parser and the ``openai`` tool parser, whatever the flags name, as
vLLM always parses GPT-OSS's channels: the analysis channel is ``reasoning_content``, the final
channel (and preambles) the content, calls ``tool_calls``. ``reasoning_effort`` (low, medium,
high) is the system message's ``Reasoning:`` line there; on other models it is handed to a chat
template that reads a ``reasoning_effort`` variable, and refused (400) by the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.client import EngineClient
from pagoda.entrypoints.openai.errors import bad_request, unsupported
from pagoda.reasoning.harmony import (
    CALL,
    DEFAULT_MODEL_IDENTITY,
    EFFORTS,
    RETURN,
    HarmonyRenderError,
    is_harmony,
    render_prompt,
)
from pagoda.entrypoints.openai.images import ImagePrompts
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.request_group import RequestGroup, ServerState, SubRequest
from pagoda.entrypoints.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    FunctionCall,
    PerRequestMetrics,
    ToolCall,
    Usage,
    sse,
)
from pagoda.entrypoints.openai.serving_engine import (
    ClientGone,
    OpenAIServing,
    client_gone_response,
)
from pagoda.entrypoints.openai.thinking_budget import BudgetedGroup
from pagoda.entrypoints.openai.tool_parsers import (
    AUTO,
    DEFAULT_TOOL_PARSER,
    ToolCallStreamer,
    choose_tool_parser,
    get_tool_parser,
)
from pagoda.entrypoints.openai.tools import ToolPlan, prompt_inputs
from pagoda.hub.stores import NO_DEFAULTS, ModelDefaults
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.multimodal.prompts import ChatImages, has_image_parts
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.reasoning import ReasoningStreamer, get_reasoning_parser
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(c: CompletionOutput, num_calls: int) -> str:
    reason = c.finish_reason or "abort"
    return "tool_calls" if num_calls and reason == "stop" else reason


class ChatServing(OpenAIServing):
    def __init__(
        self,
        engine: EngineClient,
        state: ServerState,
        served_model_name: str,
        request_timeout: float | None,
        tool_call_parser: str = DEFAULT_TOOL_PARSER,
        reasoning_parser: str | None = None,
        *,
        model_defaults: ModelDefaults = NO_DEFAULTS,
        force_include_usage: bool = False,
        per_request_metrics: bool = False,
    ) -> None:
        super().__init__(engine, state, served_model_name, request_timeout, model_defaults,
                         force_include_usage=force_include_usage, per_request_metrics=per_request_metrics)
        self.harmony = is_harmony(self.tokenizer)
        if self.harmony:
            tool_call_parser, reasoning_parser = _harmony_parsers(tool_call_parser, reasoning_parser)
        if tool_call_parser == AUTO:
            tool_call_parser, why = choose_tool_parser(self.tokenizer.chat_template if self.tokenizer else None)
            logger.info("tool-call parser: %s (--tool-call-parser auto: %s)", tool_call_parser, why)
        self.tool_parser = get_tool_parser(tool_call_parser)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser)
        specials = self.tokenizer.all_special_ids if self.tokenizer is not None else frozenset()
        self._reasoning_tags_special = self.reasoning_parser is not None and any(
            self.tokenizer.token_to_id(tag) in specials for tag in self.reasoning_parser.tags())
        # Harmony's stop tokens that the model's own end-of-generation ids miss (a checkpoint without
        # its generation_config.json): each request stops at them too.
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        self._harmony_stops = [i for t in (RETURN, CALL) if self.harmony and (i := self.tokenizer.token_to_id(t))
                               is not None and i not in eos]  # fmt: skip
        self.images = ImagePrompts(engine)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               plan: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None,
               continue_final_message: bool = False) -> str:  # fmt: skip
        """The prompt text the chat template makes of these messages (and of the tools ``plan``
        puts in the prompt, and the client's ``template_kwargs``), with the model's default system
        prompt when they have none; 400 if the template refuses them. ``continue_final_message``:
        the text stops right after the last message's content, so that the model continues that
        message (vLLM's prefill of an assistant answer)."""
        return self._render(messages, add_generation_prompt, plan, template_kwargs, continue_final_message)[0]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None,
                continue_final_message: bool = False) -> tuple[str, ChatImages | None]:  # fmt: skip
        """``render``, and the images the messages held (None: a text-only model's messages)."""
        messages = self.model_defaults.with_system(messages)
        if self.harmony:
            return self._render_harmony(messages, add_generation_prompt, plan, template_kwargs,
                                        continue_final_message), None  # fmt: skip
        images = None
        if self.images.processor is not None or has_image_parts(messages):
            # A vision-language model's template reads content parts (images among them).
            images = self.images.take(messages)
            messages = images.messages
        messages, tools = prompt_inputs(self.tokenizer, messages, plan or ToolPlan("none"), self.tool_parser)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, **(template_kwargs or {}))  # fmt: skip
        except (ValueError, jinja2.TemplateError) as e:
            # ChatTemplateError (a ValueError) is the template's own raise_exception(), e.g. roles
            # that do not alternate; other template errors also come from what the messages hold.
            raise bad_request(f"The chat template could not render the messages: {e}", param="messages") from None
        return (open_final_message(text, messages[-1]) if continue_final_message else text), images

    def _render_harmony(self, messages: list[dict[str, Any]], add_generation_prompt: bool, plan: ToolPlan | None,
                        template_kwargs: dict[str, Any] | None, continue_final_message: bool) -> str:  # fmt: skip
        """The Harmony prompt. Of the template variables, those GPT-OSS's own template reads are
        honoured (``reasoning_effort``, ``model_identity``; ``builtin_tools`` is refused: the
        built-in tools' descriptions are not written here); others are unused, as by that template."""
        kwargs = template_kwargs or {}
        effort = kwargs.get("reasoning_effort", "medium")
        identity = kwargs.get("model_identity", DEFAULT_MODEL_IDENTITY)
        if effort not in EFFORTS:
            raise bad_request(f"Invalid reasoning effort {effort!r}: GPT-OSS reasons at {', '.join(EFFORTS)}.",
                              param="chat_template_kwargs", code="invalid_value")  # fmt: skip
        if not isinstance(identity, str):
            raise bad_request("'model_identity' must be a string.", param="chat_template_kwargs")
        if kwargs.get("builtin_tools"):
            raise unsupported("chat_template_kwargs", "'builtin_tools' is not supported: the descriptions of GPT-OSS's "
                                                      "built-in tools are not written into prompts here")  # fmt: skip
        tools = plan.tool_dicts() if plan is not None and plan.active else None
        try:
            text = render_prompt(messages, tools=tools, reasoning_effort=effort, model_identity=identity,
                                 add_generation_prompt=add_generation_prompt)  # fmt: skip
        except HarmonyRenderError as e:
            raise bad_request(f"The messages cannot be rendered in the Harmony format: {e}", param="messages") from None
        return open_final_message(text, messages[-1]) if continue_final_message else text

    def effort_kwargs(self, effort: str | None, param: str,
                      template_kwargs: dict[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """``template_kwargs`` with a request's reasoning effort (``param`` names its field): the
        Harmony system message's ``Reasoning:`` line (low, medium or high), or the chat template's
        own ``reasoning_effort`` variable; 400 for a model that has neither."""
        if effort is None:
            return template_kwargs
        if self.harmony:
            if effort not in EFFORTS:
                raise bad_request(f"Invalid value for '{param}': GPT-OSS reasons at {', '.join(EFFORTS)}, got "
                                  f"{effort!r}.", param=param, code="invalid_value")  # fmt: skip
        elif "reasoning_effort" not in ((self.tokenizer.chat_template if self.tokenizer else None) or ""):
            raise unsupported(param, "is not supported by this model: its chat template has no reasoning effort")
        kwargs = dict(template_kwargs or {})
        if kwargs.get("reasoning_effort", effort) != effort:
            raise bad_request(f"'{param}' and chat_template_kwargs' 'reasoning_effort' differ; set one of them.",
                              param=param)  # fmt: skip
        kwargs["reasoning_effort"] = effort
        return kwargs

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    plan: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> tuple[str, list[int]]:  # fmt: skip
        text, ids, images = self.encode_chat_images(messages, add_generation_prompt, plan, template_kwargs,
                                                    continue_final_message)
        if images:
            raise bad_request("Images are not supported on this route yet.", param="messages")
        return text, ids

    def encode_chat_images(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                           plan: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None,
                           continue_final_message: bool = False) -> tuple[str, list[int], list[ImageInput]]:  # fmt: skip
        """The prompt's text, token ids and images (each processed, its placeholder span located)."""
        text, images = self._render(messages, add_generation_prompt, plan, template_kwargs, continue_final_message)
        if images is not None and images.images:
            ids, inputs = self.images.expand(text, images)
            return text, ids, inputs
        # The template already wrote BOS and the role markers; adding special tokens would double BOS.
        return text, self.tokenizer.encode(text, add_special_tokens=False), []

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        lora = self.check_model(body.model)
        body.check_supported()
        plan = body.tool_plan()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await self.prepare_chat(body, plan, request_id, lora)
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        group: RequestGroup | BudgetedGroup = self.group(raw_request, [sub], body.priority, body.cache_salt)
        if body.thinking_token_budget is not None and self.reasoning_parser is not None:
            if body.use_beam_search:
                raise bad_request("'thinking_token_budget' cannot be combined with 'use_beam_search'.",
                                  param="thinking_token_budget")  # fmt: skip
            group = BudgetedGroup(self, raw_request, sub, body.thinking_token_budget, self.reasoning_parser,
                                  ("messages", max_param), body.priority, body.cache_salt)  # fmt: skip
        if body.stream:
            try:
                first = await self.start_stream(group)
            except ClientGone:
                return client_gone_response()
            return self.stream_response(group, self._events(body, plan, request_id, group, first))
        try:
            outputs = await self.run_to_end(group)
        except ClientGone:
            return client_gone_response()
        out = outputs[0]
        echo = body.echo_text()
        choices = [self.choice(body, plan, i, out.outputs[i] if out is not None and i < len(out.outputs) else None,
                               echo) for i in range(body.n)]  # fmt: skip
        response = ChatCompletionResponse(
            id=request_id, model=self.response_model(body.model), choices=choices, usage=self.usage([sub], outputs),
            prompt_token_ids=sub.prompt_token_ids if body.return_token_ids else None,
            metrics=self._metrics(body, outputs),
        )
        if body.prompt_logprobs is not None and out is not None and out.prompt_logprobs is not None:
            response.prompt_logprobs = self.logprobs.prompt(out.prompt_logprobs)
        return Response(response.model_dump_json(), media_type="application/json")

    def choice(self, body: ChatCompletionRequest, plan: ToolPlan, index: int, c: CompletionOutput | None,
               echo: str = "") -> ChatChoice:  # fmt: skip
        """Choice ``index`` of a whole (not streamed) reply: the message read from the output
        ``c`` (None: the engine gave none), after ``echo`` (``body.echo_text()``)."""
        message, finish_reason = self._message(plan, c)
        if echo:
            message.content = echo + (message.content or "")
        return ChatChoice(
            index=index, message=message, finish_reason=finish_reason,
            logprobs=self._logprobs(body, c, c.token_ids, c.logprobs) if c else None,
            token_ids=(list(c.token_ids) if c else []) if body.return_token_ids else None,
        )  # fmt: skip

    async def prepare_chat(self, body: ChatCompletionRequest, plan: ToolPlan, request_id: str,
                           lora: LoRARequest | None) -> SubRequest:  # fmt: skip
        """The engine request of one conversation (``body.messages``), rendered, tokenized,
        truncated as asked and checked by the engine (every 400 of the prompt comes from here)."""
        # Images are decoded and processed off the event loop.
        template_kwargs = self.effort_kwargs(body.reasoning_effort, "reasoning_effort", body.chat_template_kwargs)
        rendered, ids, images = await asyncio.to_thread(
            self.encode_chat_images, body.template_messages(), body.add_generation_prompt, plan,
            template_kwargs, body.continue_final_message)  # fmt: skip
        text: str | None = rendered
        kept = self.truncate(ids, body.truncate_prompt_tokens, body.truncation_side)
        if len(kept) < len(ids):
            ids, text = kept, None  # the kept tokens are the prompt now; no text of them to report
        structured, structured_param = body.structured_output()
        if plan.forced:
            structured, structured_param = plan.constraint(self.tool_parser), "tools"
        body.check_thinking_budget(self.reasoning_parser is not None, structured is not None)
        structured = self.with_reasoning(structured)

        def to_params(default_max_tokens: int) -> SamplingParams:
            return self.keep_markers(body.to_sampling_params(default_max_tokens, structured,
                                                             self.model_defaults.sampling),
                                     plan, explicit=body.skip_special_tokens is not None)  # fmt: skip

        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if body.use_beam_search and plan.forced:
            raise bad_request("'use_beam_search' cannot be combined with a forced tool call.", param="tool_choice")
        return self.prepare(request_id, text, ids, to_params, "messages", max_param, structured_param,
                            lora_request=lora, priority=body.priority,
                            beam=body.beam_search_params if body.use_beam_search else None,
                            logprobs_param="top_logprobs", mm_inputs=images)  # fmt: skip

    def _metrics(self, body: ChatCompletionRequest,
                 outputs: Sequence[RequestOutput | None]) -> PerRequestMetrics | None:  # fmt: skip
        # A thinking budget runs the request as two engine requests: the timings are not one stream's.
        return self.request_metrics(outputs) if body.thinking_token_budget is None else None

    def keep_markers(self, params: SamplingParams, plan: ToolPlan | None, explicit: bool = False) -> SamplingParams:
        """``params`` decoding special tokens into the text where a parser reads them: tool calls
        are parsed (Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, DeepSeek's and Kimi's
        call tokens are special), or the reasoning parser's tags are special tokens of this
        vocabulary (Magistral's ``[THINK]``); vLLM's parsers do the same. ``explicit``: the
        request set skip_special_tokens itself, which wins. On a Harmony model, the request also
        stops at Harmony's stop tokens that are not the model's end-of-generation ids."""
        if self._harmony_stops:
            stops = [*(params.stop_token_ids or []), *self._harmony_stops]
            params = dataclasses.replace(params, stop_token_ids=list(dict.fromkeys(stops)))
        if explicit or not params.skip_special_tokens:
            return params
        if (plan is not None and plan.active) or self._reasoning_tags_special:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def with_reasoning(self, constraint: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """With a reasoning parser, a constraint applies after the (free) reasoning section."""
        if constraint is None or self.reasoning_parser is None:
            return constraint
        return self.reasoning_parser.constrain(constraint)

    def split_reasoning(self, text: str, plan: ToolPlan | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished text; all content without a reasoning parser.
        ``plan``: the request's tools (Harmony's calls stay in the content for the tool parser
        only where it reads them)."""
        if self.reasoning_parser is None:
            return None, text
        split = self.reasoning_parser.for_tools(plan is not None and plan.active).extract(text)
        return split.reasoning, split.content

    def reasoning_streamer(self, plan: ToolPlan | None = None) -> ReasoningStreamer | None:
        """A streamer of the reasoning split for a request with ``plan`` (None without a parser)."""
        if self.reasoning_parser is None:
            return None
        return self.reasoning_parser.for_tools(plan is not None and plan.active).streamer()

    def _message(self, plan: ToolPlan, c: CompletionOutput | None) -> tuple[ChatMessageOut, str]:
        if c is None:
            return ChatMessageOut(content=""), "abort"
        reasoning, content = self.split_reasoning(c.text, plan)
        if not plan.active:
            return ChatMessageOut(content=content, reasoning_content=reasoning), c.finish_reason or "abort"
        if plan.forced and c.finish_reason == "length":
            # A forced call cut by max_tokens is still a call: as vLLM, its arguments are the
            # (unfinished) JSON text generated so far, and finish_reason stays "length".
            extracted = self.tool_parser.for_tools(plan.tool_dicts()).extract_cut(content or "")
        else:
            extracted = self.tool_parser.for_tools(plan.tool_dicts()).extract(
                content or "", truncated=c.finish_reason == "length")
        calls = [
            ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in extracted.calls
        ]
        message = ChatMessageOut(content=extracted.content, reasoning_content=reasoning, tool_calls=calls or None)
        return message, _finish_reason(c, len(calls))

    def _logprobs(
        self, body: ChatCompletionRequest, c: CompletionOutput, token_ids: list[int], logprobs: Any
    ) -> ChatLogprobs | None:
        if not body.logprobs or logprobs is None:
            return None
        return ChatLogprobs(content=self.logprobs.chat(token_ids, logprobs, body.top_logprobs or 0,
                                                       body.logprob_token_ids or (),
                                                       as_token_ids=bool(body.return_tokens_as_token_ids)))

    async def _events(
        self, body: ChatCompletionRequest, plan: ToolPlan, request_id: str, group: RequestGroup | BudgetedGroup,
        first: list[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:  # fmt: skip
        created = int(time.time())
        model = self.response_model(body.model)
        include_usage, continuous_usage = body.stream_usage(self.force_include_usage)
        streamers: dict[int, ToolCallStreamer] = (
            {i: self.tool_parser.for_tools(plan.tool_dicts()).streamer() for i in range(body.n)} if plan.active else {}
        )
        reasoners: dict[int, ReasoningStreamer] = (
            {i: self.reasoning_parser.for_tools(plan.active).streamer() for i in range(body.n)}
            if self.reasoning_parser else {}
        )
        emitted = [0] * body.n  # tokens of each choice streamed so far (continuous usage counts them)
        prompt_ids = group.subrequests[0].prompt_token_ids

        def chunk(index: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:  # fmt: skip
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                      token_ids=token_ids if body.return_token_ids else None)  # fmt: skip
            usage = None
            if continuous_usage:
                last = group.last[0]
                usage = Usage.of(len(prompt_ids), sum(emitted), last.num_cached_tokens if last is not None else 0)
            payload = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice], usage=usage,
                                          prompt_token_ids=prompt_token_ids)  # fmt: skip
            # As OpenAI: with include_usage, every chunk has "usage" (null until the last).
            return sse(payload, None if include_usage else {"usage"})

        def tool_pieces(c: CompletionOutput, text: str, streamer: ToolCallStreamer,
                        logprobs: ChatLogprobs | None) -> list[tuple[dict[str, Any], ChatLogprobs | None]]:  # fmt: skip
            delta = streamer.feed(text, final=c.just_finished)
            pieces: list[tuple[dict[str, Any], ChatLogprobs | None]] = []
            if delta.content or logprobs:
                pieces.append(({"content": delta.content}, logprobs))
            for call in delta.calls:
                if call.name is not None:
                    # As OpenAI: id, type and name first (arguments ""), then the arguments in pieces.
                    head = {"index": call.index, "id": new_call_id(), "type": "function",
                            "function": {"name": call.name, "arguments": ""}}  # fmt: skip
                    pieces.append(({"tool_calls": [head]}, None))
                if call.arguments:
                    piece = {"index": call.index, "function": {"arguments": call.arguments}}
                    pieces.append(({"tool_calls": [piece]}, None))
            return pieces

        def chunks(out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                if c.finished and not c.just_finished:
                    continue  # finished in an earlier update
                logprobs = self._logprobs(body, c, c.delta_token_ids, c.delta_logprobs) if c.delta_logprobs else None
                pieces: list[tuple[dict[str, Any], ChatLogprobs | None]] = []
                text = c.delta_text
                reasoner = reasoners.get(c.index)
                if reasoner is not None:
                    split = reasoner.feed(text, final=c.just_finished)
                    if split.reasoning:
                        # The logprobs ride on the first chunk of this step, whichever part it is.
                        pieces.append(({"reasoning_content": split.reasoning}, logprobs))
                        logprobs = None
                    text = split.content
                streamer = streamers.get(c.index)
                if streamer is not None:
                    pieces.extend(tool_pieces(c, text, streamer, logprobs))
                elif text or logprobs:
                    pieces.append(({"content": text}, logprobs))
                emitted[c.index] = len(c.token_ids)
                finish_reason = None
                if c.just_finished:
                    num_calls = streamer.num_calls if streamer is not None else 0
                    finish_reason = _finish_reason(c, num_calls)
                if not pieces and (finish_reason or (body.return_token_ids and c.delta_token_ids)):
                    # Nothing to show, but the end or the tokens still go out (an empty delta).
                    pieces = [({}, None)]
                for k, (delta, lp) in enumerate(pieces):
                    last = k == len(pieces) - 1
                    # As vLLM: the last delta carries the finish reason (no empty chunk just for it),
                    # and this update's token ids ride on its first chunk.
                    events.append(chunk(c.index, delta, lp, finish_reason if last else None,
                                        list(c.delta_token_ids) if k == 0 else []))  # fmt: skip
            return events

        echo = body.echo_text()
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""}, token_ids=[],
                        prompt_token_ids=prompt_ids if body.return_token_ids else None)  # fmt: skip
            if echo:
                yield chunk(i, {"content": echo}, token_ids=[])
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
                yield chunk(i, {}, finish_reason="abort", token_ids=[])
        if include_usage:
            usage = self.usage(group.subrequests, group.last)
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage,
                                          metrics=self._metrics(body, group.last)))  # fmt: skip


def _harmony_parsers(tool_call_parser: str, reasoning_parser: str | None) -> tuple[str, str]:
    """The parsers of a Harmony model: GPT-OSS's, whatever was asked for (another format's
    parser cannot read Harmony output); said in the log, with a warning where another was named."""
    for flag, asked, harmony in (("--tool-call-parser", tool_call_parser, "openai"),
                                 ("--reasoning-parser", reasoning_parser, "openai_gptoss")):
        if asked in (harmony, None, AUTO, DEFAULT_TOOL_PARSER):
            logger.info("GPT-OSS (the Harmony format): %s %s", flag, harmony)
        else:
            logger.warning("GPT-OSS (the Harmony format): %s %s, not %s, which cannot read Harmony output",
                           flag, harmony, asked)
    return "openai", "openai_gptoss"


def open_final_message(text: str, final: dict[str, Any]) -> str:
    """``text`` cut right after the final message's content, for continue_final_message: the
    template closed that message (an end-of-turn marker, maybe a newline), and the model is to
    continue it instead. The content is found from the end, where the final message is."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise bad_request("'continue_final_message' needs a final message with text content to continue.",
                          param="continue_final_message")  # fmt: skip
    # Templates often strip a message's content; the raw text is looked for first.
    for needle in (content, content.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise bad_request("'continue_final_message': the chat template does not write the final message's content "
                      "as given, so it cannot be continued.", param="continue_final_message")  # fmt: skip
