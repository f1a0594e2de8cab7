"""POST /v1/embeddings: each input runs as its own engine request (prefill only, pooled).
(/classify and the cross-encoders' /score and /rerank run their inputs through ``pooled`` too.)

A thin translation onto what the other routes use: the engine's check of each input
(``validate_pooling_request``: task, length, width), one RequestGroup for all inputs
(admission, back-pressure, timeout, and a disconnect that aborts every one of them), and
the engine's stream (``run_request``), which yields one EmbeddingRequestOutput per input.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    encode_base64,
)
from pagoda.entrypoints.openai.errors import bad_request, internal_error
from pagoda.entrypoints.openai.request_group import SubRequest
from pagoda.entrypoints.openai.serving_engine import (
    ClientGone,
    OpenAIServing,
    client_gone_response,
)
from pagoda.lora.request import LoRARequest
from pagoda.outputs import EmbeddingRequestOutput
from pagoda.pooling import PoolingParams, placeholder_sampling_params, truncate_prompt
from pagoda.validation import InvalidRequestError


class EmbeddingServing(OpenAIServing):
    async def create(self, body: EmbeddingRequest, raw_request: Request) -> Response:
        result = await self.vectors(body, raw_request)
        if result is None:
            return client_gone_response()
        vectors, num_tokens = result
        data = [EmbeddingData(index=i, embedding=encode_base64(v) if body.encoding_format == "base64" else v)
                for i, v in enumerate(vectors)]  # fmt: skip
        response = EmbeddingResponse(data=data, model=self.response_model(body.model),
                                     usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return Response(response.model_dump_json(), media_type="application/json")

    async def vectors(self, body: EmbeddingRequest, raw_request: Request) -> tuple[list[list[float]], int] | None:
        """The inputs' vectors, in order, and their number of tokens (None: the client left).
        Ollama's /api/embed and /api/embeddings run through here too."""
        if self.engine.pooler_config is None:
            raise bad_request("This model does not serve embeddings: the server generates text (task 'generate'). "
                              "Start it with --task embed for /v1/embeddings.", code="wrong_task")
        if self.engine.pooler_config.classifier is not None:
            raise bad_request("This model does not serve embeddings: it is a classifier (task 'classify': "
                              "/classify, /score, /rerank). Start an embedding model with --task embed for "
                              "/v1/embeddings.", code="wrong_task")
        lora = self.check_model(body.model)
        try:
            params = PoolingParams(dimensions=body.dimensions)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions", code="invalid_value") from None
        request_id = f"embd-{uuid.uuid4().hex}"
        inputs = body.inputs()
        subrequests = [self.prepare_input(request_id, i, len(inputs), item, params, body.truncate_prompt_tokens, lora,
                                          body.truncation_side) for i, item in enumerate(inputs)]  # fmt: skip
        return await self.pooled(subrequests, raw_request)

    async def pooled(self, subrequests: list[SubRequest], raw_request: Request) -> tuple[list[list[float]], int] | None:
        """Run pooling requests as one group: each one's output (a vector, or a classifier's
        logits) in order, and their number of tokens (None: the client left)."""
        group = self.group(raw_request, subrequests)
        try:
            outputs = await self.run_to_end(group)
        except ClientGone:
            return None
        vectors = []
        for out in outputs:
            if not isinstance(out, EmbeddingRequestOutput) or out.finish_reason != "stop":
                raise internal_error()  # the engine ended the request without a vector
            vectors.append(out.outputs.embedding)
        return vectors, sum(len(s.prompt_token_ids) for s in subrequests)

    def prepare_input(self, request_id: str, index: int, count: int, item: str | list[int], params: PoolingParams,
                      truncate_prompt_tokens: int | None, lora: LoRARequest | None,
                      truncation_side: str | None = None) -> SubRequest:  # fmt: skip
        """One input's engine request (a text tokenized alone, or token ids), checked by the
        engine; 400 naming the input otherwise. ``truncation_side`` "right": a truncation keeps
        the first tokens rather than the last."""
        text = item if isinstance(item, str) else None
        ids = self.tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        try:
            kept = truncate_prompt(ids, truncate_prompt_tokens, self.engine.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), param="truncate_prompt_tokens", code="invalid_value") from None
        ids = ids[:len(kept)] if truncation_side == "right" else kept
        where = "input" if count == 1 else f"input[{index}]"
        return self.checked(request_id if count == 1 else f"{request_id}-{index}", text, ids, params, lora,
                            where, "input")

    def checked(self, sub_id: str, text: str | None, ids: list[int], params: PoolingParams,
                lora: LoRARequest | None, where: str, param: str) -> SubRequest:  # fmt: skip
        """A pooling engine request the engine accepts; else a 400 whose message names the
        input (``where``, e.g. "input[2]") and whose param is ``param`` for a prompt's fault."""
        try:
            self.engine.validate_pooling_request(ids, params, 0, lora)
        except InvalidRequestError as e:
            named = param if e.param == "prompt" else e.param
            message = f"{where}: {e}" if named == param and where != param else str(e)
            raise bad_request(message, param=named, code=e.code) from None
        return SubRequest(sub_id, text, ids, placeholder_sampling_params(), lora, pooling_params=params)
