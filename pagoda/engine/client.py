"""EngineClient: what the HTTP server needs of an engine, and the errors it raises.

Three classes implement it: AsyncLLM (one engine core behind ZMQ), DataParallelLLM
(several AsyncLLM replicas behind a prefix router) and the tests' FakeEngine (a
scripted core behind the real front end). The server (pagoda/entrypoints/openai)
depends on this protocol alone. ``EngineClientBase`` holds what the implementations
share: the request check (pagoda/validation.py) and ``generate``, which checks a
request once and then streams it through the implementation's ``_generate``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagoda.validation import RequestLimits, validate_pooling_request, validate_request

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.core.outputs import SchedulerStats
    from pagoda.lora.request import LoRARequest
    from pagoda.multimodal.inputs import ImageInput
    from pagoda.metrics.stats import EngineMetrics
    from pagoda.outputs import EmbeddingRequestOutput, RequestOutput
    from pagoda.pooling import PoolerConfig, PoolingParams
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
    from pagoda.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerateCall:
    """One validated request, as ``generate`` hands it to an implementation's ``_generate``.
    With ``pooling_params`` it is an embedding request (``sampling_params``: a placeholder,
    pagoda/pooling.py), whose stream yields one EmbeddingRequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    mm_inputs: Sequence[ImageInput] = ()    # its images, processed (pagoda/multimodal)
    background: bool = False                # yields to every other request (a batch's lines)
    # The HTTP request's W3C trace context (traceparent, tracestate), for its span (pagoda/metrics/tracing.py).
    trace_headers: Mapping[str, str] | None = None


class EngineDeadError(RuntimeError):
    """The engine-core process died or stopped making progress."""


class KVTransferError(RuntimeError):
    """A request's KV blocks did not arrive from its prefill instance (prefill-decode
    disaggregation, pagoda/kv_transfer): the request ended; another instance pair may serve it."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (--max-num-queued-requests); retry later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LoRANotFoundError(ValueError):
    """No adapter of that name is loaded."""


class LoRAExistsError(ValueError):
    """An adapter of that name is loaded already."""


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the HTTP server sees it. Implementations subclass it (through
    EngineClientBase) and define every member; tests/unit/test_engine_client.py checks
    the three of them against it, signatures included."""

    config: EngineConfig                        # scheduling policy, LoRA on or off, limits
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    lora_requests: Mapping[str, LoRARequest]    # the loaded adapters by name (each is a model)
    pooler_config: PoolerConfig | None          # an embedding engine's pooling; None: it generates
    # What /metrics and the dashboard read (pagoda/metrics/prometheus.py MetricsSource):
    metrics: EngineMetrics | None               # the front end's recorder, None when not recording
    replicas: Sequence[EngineClient]            # data-parallel replicas, empty for one engine
    lora_token_counts: Mapping[str, list[int]]  # adapter -> [prompt tokens, generated tokens]

    # ---- requests --------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                         lora_request: LoRARequest | None = None) -> None:  # fmt: skip
        """Raise InvalidRequestError (pagoda/validation.py; GrammarError for a structured
        output constraint that does not compile) for a request the engine would not take."""
        ...

    def validate_pooling_request(self, prompt_token_ids: list[int], pooling_params: PoolingParams,
                                 priority: int = 0, lora_request: LoRARequest | None = None) -> None:  # fmt: skip
        """``validate_request`` for an embedding request (InvalidRequestError; WrongTaskError
        on an engine that generates)."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Validate, run, and yield the request's outputs until the finished one. Closing or
        cancelling the iterator early aborts the request."""
        ...

    def run_request(self, call: GenerateCall) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """``generate`` for a request ``validate_request`` (``validate_pooling_request``) has
        accepted already (the HTTP server checks each prompt before admitting the request, and
        does not check twice)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    # ---- LoRA adapters ---------------------------------------------------------------
    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Load an adapter under ``lora_name``: ValueError if LoRA is off, LoRAExistsError,
        LoRAAdapterError for a bad adapter."""
        ...

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter: LoRANotFoundError, LoRAInUseError while requests use it."""
        ...

    # ---- health and stats ------------------------------------------------------------
    @property
    def is_healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is down (None while it serves)."""
        ...

    @property
    def degraded_reason(self) -> str | None:
        """Why the engine serves at reduced capacity (some data-parallel replicas down), else None."""
        ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def latest_stats(self) -> SchedulerStats: ...

    async def check_integrity(self, timeout: float = 10.0) -> dict[str, Any]:
        """Debug: the core checks its block pool, KV cache manager and scheduler between
        two steps. {"ok": bool, "error": str | None, "engine_pid": ...}."""
        ...

    def ensure_background_tasks(self) -> None:
        """Start reading the engine's messages on the running loop (a request does it anyway;
        /metrics and the dashboard call it to show the engine's state before any request)."""
        ...

    async def shutdown(self) -> None: ...


class EngineClientBase(EngineClient):
    """What the implementations share: the request check and ``generate`` around ``_generate``."""

    _grammar_validator = None

    def request_limits(self) -> RequestLimits:
        """Read at each check: a test may change the fake engine's limits between requests."""
        config = self.config
        return RequestLimits(self.max_model_len, self.vocab_size, config.scheduling_policy, config.enable_lora,
                             max_logprobs=config.max_logprobs, pooler=self.pooler_config,
                             logits_processors=tuple(config.logits_processors or ()))

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                         lora_request: LoRARequest | None = None) -> None:  # fmt: skip
        validate_request(prompt_token_ids, params, self.request_limits(), priority, lora_request,
                         validate_grammar=self._validate_grammar)  # fmt: skip

    def validate_pooling_request(self, prompt_token_ids: list[int], pooling_params: PoolingParams,
                                 priority: int = 0, lora_request: LoRARequest | None = None) -> None:  # fmt: skip
        validate_pooling_request(prompt_token_ids, pooling_params, self.request_limits(), priority, lora_request)

    def _validate_grammar(self, structured: StructuredOutputsParams) -> None:
        """Compile a constraint in this process (cached), so that a bad schema is a 400 before
        the request reaches the engine."""
        if self._grammar_validator is None:
            from pagoda.structured_output.backend import LLGuidanceBackend
            from pagoda.structured_output.manager import StructuredOutputManager

            tok, vocab_size = self.tokenizer, self.vocab_size
            self._grammar_validator = StructuredOutputManager(
                lambda: LLGuidanceBackend(tok.backend.to_str(), vocab_size, tok.eos_token_ids))
        self._grammar_validator.validate(structured)

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, sampling_params, priority, lora_request)
        async with contextlib.aclosing(self.run_request(GenerateCall(
                request_id, prompt, prompt_token_ids, sampling_params, priority, cache_salt, tenant,
                lora_request, mm_inputs=mm_inputs))) as stream:  # fmt: skip
            async for out in stream:
                yield out

    async def run_request(self, call: GenerateCall) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        stream = self._generate(call)
        # Closed with this iterator, so that an early close aborts the request at once.
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    def _generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Run a validated request (an async generator in the implementations)."""
        raise NotImplementedError

    @property
    def degraded_reason(self) -> str | None:
        return None
