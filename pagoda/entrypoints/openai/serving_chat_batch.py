"""POST /v1/chat/completions/batch (vLLM's route): several conversations in one request.

Each conversation becomes the engine request /v1/chat/completions would make of it, with the
request's other fields (the same template, truncation, structured output and engine checks:
``ChatServing.prepare_chat``), and all of them run as one group: admitted, aborted on a
disconnect and timed out together. The answer is one chat completion whose choice i is
conversation i's reply, read as chat reads a reply (reasoning split, ``echo``, logprobs), with
the usage summed over the conversations. What the route refuses (``stream``, ``n`` > 1, tools,
beam search...) is ``BatchChatCompletionRequest.check_supported``'s business.

    {"messages": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]}
    -> {"object": "chat.completion", "choices": [{"index": 0, ...}, {"index": 1, ...}], "usage": ...}
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import BatchChatCompletionRequest
from pagoda.entrypoints.openai.responses import ChatCompletionResponse
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_engine import ClientGone, client_gone_response


async def create_batch(chat: ChatServing, body: BatchChatCompletionRequest, raw_request: Request) -> Response:
    lora = chat.check_model(body.model)
    body.check_supported()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    conversations = [body.conversation(i) for i in range(len(body.messages))]
    # No tools here, so one plan serves every conversation (it also checks the structured output).
    plan = conversations[0].tool_plan()
    subrequests = []
    for i, conversation in enumerate(conversations):
        try:
            # Engine request ids as /v1/completions names a request's prompts: <id>-<i>.
            subrequests.append(await chat.prepare_chat(conversation, plan, f"{request_id}-{i}", lora))
        except APIError as e:
            if len(conversations) > 1:
                e.message = f"Conversation {i} (messages[{i}]): {e.message}"
            raise
    group = chat.group(raw_request, subrequests, body.priority, body.cache_salt)
    try:
        outputs = await chat.run_to_end(group)
    except ClientGone:
        return client_gone_response()
    choices = []
    for i, (conversation, sub, out) in enumerate(zip(conversations, subrequests, outputs, strict=True)):
        choice = chat.choice(conversation, plan, i, out.outputs[0] if out is not None and out.outputs else None,
                             conversation.echo_text())  # fmt: skip
        if body.return_token_ids:
            choice.prompt_token_ids = sub.prompt_token_ids
        if body.prompt_logprobs is not None and out is not None and out.prompt_logprobs is not None:
            choice.prompt_logprobs = chat.logprobs.prompt(out.prompt_logprobs)
        choices.append(choice)
    # No per-request metrics: the timings are several streams', as vLLM, which reports none here.
    response = ChatCompletionResponse(id=request_id, model=chat.response_model(body.model), choices=choices,
                                      usage=chat.usage(subrequests, outputs))  # fmt: skip
    return Response(response.model_dump_json(), media_type="application/json")
