"""POST /v1/score, /score (vLLM's) and /v1/rerank, /rerank, /v2/rerank (Jina's and Cohere's
shape) on an embedding model or a cross-encoder.

On an embedding model each text is embedded once (through /v1/embeddings' path: one engine
request a text, one group for back-pressure, timeout and disconnect), a pair's score the
cosine of their vectors. On a cross-encoder (a classifier with one label, task classify:
``*ForSequenceClassification``, or a causal LM with --classifier-from-token) each pair is one
prompt and its score the model's (pagoda/entrypoints/openai/serving_classify.py). A server
that generates answers these routes with a 400 saying so.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.embedding_protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest, check_truncation_side
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import _Strict
from pagoda.entrypoints.openai.serving_classify import ClassificationServing
from pagoda.entrypoints.openai.serving_embedding import EmbeddingServing
from pagoda.entrypoints.openai.serving_engine import client_gone_response


class ScoreRequest(_Strict):
    """vLLM's: ``text_1`` against each ``text_2`` (one and one, one and many, or pairs of
    equal lists)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None   # vLLM's: "right" keeps an input's first tokens
    _check_side = field_validator("truncation_side")(check_truncation_side)
    user: str | None = None   # accepted and ignored: it does not change the scores

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not first or not second:
            raise bad_request("text_1 and text_2 must not be empty", param="text_1" if not first else "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                              "as text_2", param="text_1")
        return list(zip(first, second))


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankRequest(_Strict):
    """Jina's / Cohere's: ``documents`` ranked against ``query``, the ``top_n`` best first."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS - 1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    _check_side = field_validator("truncation_side")(check_truncation_side)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


class ScoreServing:
    def __init__(self, embeddings: EmbeddingServing) -> None:
        self.embeddings = embeddings
        self.cross_encoder = ClassificationServing(embeddings)   # when the server classifies

    async def _vectors(self, texts: list[str], body: Any, raw_request: Request) -> tuple[list[list[float]], int] | None:
        """Each distinct text's vector (a text repeated is embedded once), by text."""
        if self.embeddings.engine.pooler_config is None:
            raise bad_request("This model does not score: the server generates text (task 'generate'). Start an "
                              "embedding model with --task embed (scores are the cosine of two embeddings), or a "
                              "cross-encoder (*ForSequenceClassification) with --task classify.", code="wrong_task")
        unique = list(dict.fromkeys(texts))
        if len(unique) > MAX_EMBEDDING_INPUTS:
            raise bad_request(f"at most {MAX_EMBEDDING_INPUTS} distinct texts a request, got {len(unique)}")
        request = EmbeddingRequest(input=unique, model=body.model, truncate_prompt_tokens=body.truncate_prompt_tokens,
                                   truncation_side=body.truncation_side)  # fmt: skip
        result = await self.embeddings.vectors(request, raw_request)
        if result is None:
            return None
        vectors, tokens = result
        by_text = dict(zip(unique, vectors))
        return [by_text[t] for t in texts], tokens

    async def score(self, body: ScoreRequest, raw_request: Request) -> Response:
        pairs = body.pairs()
        if self.cross_encoder.classifier is not None:
            got = await self.cross_encoder.pair_scores(pairs, body, raw_request, "text_2")
            if got is None:
                return client_gone_response()
            scores, tokens = got
        else:
            found = await self._vectors([t for pair in pairs for t in pair], body, raw_request)
            if found is None:
                return client_gone_response()
            vectors, tokens = found
            scores = [cosine(vectors[2 * i], vectors[2 * i + 1]) for i in range(len(pairs))]
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
        response = ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()),
                                 model=self.embeddings.response_model(body.model), data=data,
                                 usage=Usage(prompt_tokens=tokens, total_tokens=tokens))
        return Response(response.model_dump_json(), media_type="application/json")

    async def rerank(self, body: RerankRequest, raw_request: Request) -> Response:
        if self.cross_encoder.classifier is not None:
            pairs = [(body.query, document) for document in body.documents]
            got = await self.cross_encoder.pair_scores(pairs, body, raw_request, "documents")
            if got is None:
                return client_gone_response()
            scores, tokens = got
        else:
            found = await self._vectors([body.query, *body.documents], body, raw_request)
            if found is None:
                return client_gone_response()
            vectors, tokens = found
            scores = [cosine(vectors[0], v) for v in vectors[1:]]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
                   for i in order]  # fmt: skip
        response = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.embeddings.response_model(body.model),
                                  usage=RerankUsage(total_tokens=tokens), results=results)
        return Response(response.model_dump_json(exclude_none=True), media_type="application/json")
