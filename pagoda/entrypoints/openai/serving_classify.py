"""POST /classify (vLLM's) on a classifier, and the cross-encoder scores /score and /rerank read.

A classifying engine (task classify, pagoda/pooling.py) returns each prompt's raw logits, one
per label; the activation is the route's, from the checkpoint's config (ClassifierConfig):
/classify gives each label's probability (softmax over the labels, or sigmoid for one, as
vLLM and transformers' problem types say) and the likeliest label; a cross-encoder's score of
a (query, document) pair is its one logit through the cross-encoder's activation
(sentence-transformers' CrossEncoder: the checkpoint's configured one, else sigmoid).

A pair is one prompt, made by the tokenizer's pair template as ``tokenizer(query, document)``
makes it (BERT: [CLS] query [SEP] document [SEP], the document's tokens of type 1; a
decoder's template joins the two). Each input runs as its own engine request, all of them one
group (EmbeddingServing.pooled: back-pressure, timeout, disconnect).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.embedding_protocol import MAX_EMBEDDING_INPUTS, InputField
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import _is_token_list, _Strict
from pagoda.entrypoints.openai.serving_embedding import EmbeddingServing
from pagoda.entrypoints.openai.serving_engine import client_gone_response
from pagoda.pooling import ClassifierConfig, PoolingParams, activate


class ClassifyRequest(_Strict):
    """vLLM's: texts (or token ids) to classify, one engine request each."""

    model: str | None = None
    input: InputField
    truncate_prompt_tokens: int | None = None
    user: str | None = None   # accepted and ignored: it does not change the probabilities

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or _is_token_list(self.input):
            return [self.input]
        return list(self.input)


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage


class ClassificationServing:
    def __init__(self, serving: EmbeddingServing) -> None:
        self.serving = serving   # the pooling requests' path (EmbeddingServing.pooled)

    @property
    def classifier(self) -> ClassifierConfig | None:
        pooler = self.serving.engine.pooler_config
        return None if pooler is None else pooler.classifier

    def _require_classifier(self, route: str) -> ClassifierConfig:
        classifier = self.classifier
        if classifier is None:
            task = "generates text (task 'generate')" if self.serving.engine.pooler_config is None else \
                "embeds (task 'embed')"
            raise bad_request(f"{route} needs a classifier (task 'classify': a *ForSequenceClassification "
                              f"checkpoint, or a causal LM with --classifier-from-token); this server {task}.",
                              code="wrong_task")
        return classifier

    async def classify(self, body: ClassifyRequest, raw_request: Request) -> Response:
        classifier = self._require_classifier("/classify")
        if body.truncate_prompt_tokens is not None and classifier.token_types:
            raise bad_request("truncate_prompt_tokens keeps a prompt's last tokens, which would drop an encoder's "
                              "first ([CLS]) token: it is not supported on this model", param="truncate_prompt_tokens")
        lora = self.serving.check_model(body.model)
        params = PoolingParams(task="classify")
        request_id = f"classify-{uuid.uuid4().hex}"
        inputs = body.inputs()
        subrequests = [self.serving.prepare_input(request_id, i, len(inputs), item, params,
                                                  body.truncate_prompt_tokens, lora)
                       for i, item in enumerate(inputs)]  # fmt: skip
        result = await self.serving.pooled(subrequests, raw_request)
        if result is None:
            return client_gone_response()
        all_logits, tokens = result
        data = []
        for i, logits in enumerate(all_logits):
            probs = activate(logits, classifier.classify_activation)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=classifier.labels[best], probs=probs,
                                           num_classes=classifier.num_labels))
        response = ClassificationResponse(id=request_id, created=int(time.time()),
                                          model=self.serving.response_model(body.model), data=data,
                                          usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))
        return Response(response.model_dump_json(), media_type="application/json")

    async def pair_scores(self, pairs: list[tuple[str, str]], body: Any, raw_request: Request,
                          where: str) -> tuple[list[float], int] | None:  # fmt: skip
        """Each (query, document) pair's cross-encoder score and the pairs' tokens (None: the
        client left); ``where`` names a pair in a 400 ("text_2" -> "text_2[3]")."""
        classifier = self._require_classifier("/score and /rerank")
        if classifier.num_labels != 1:
            raise bad_request(f"a cross-encoder's score is one logit; this classifier has {classifier.num_labels} "
                              f"labels ({', '.join(classifier.labels)}): use /classify for their probabilities",
                              code="wrong_task")
        if len(pairs) > MAX_EMBEDDING_INPUTS:
            raise bad_request(f"at most {MAX_EMBEDDING_INPUTS} pairs a request, got {len(pairs)}", param=where)
        if body.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens is not supported for a cross-encoder's pairs (keeping a "
                              "pair's last tokens would drop its query)", param="truncate_prompt_tokens")
        lora = self.serving.check_model(body.model)
        request_id = f"score-{uuid.uuid4().hex}"
        subrequests = []
        for i, (query, document) in enumerate(pairs):
            ids, pair_start = self.serving.tokenizer.encode_pair(query, document)
            params = PoolingParams(task="classify", pair_start=pair_start if classifier.token_types else None)
            sub_id = request_id if len(pairs) == 1 else f"{request_id}-{i}"
            subrequests.append(self.serving.checked(sub_id, None, ids, params, lora, f"{where}[{i}]", where))
        result = await self.serving.pooled(subrequests, raw_request)
        if result is None:
            return None
        all_logits, tokens = result
        return [activate(logits, classifier.score_activation)[0] for logits in all_logits], tokens
