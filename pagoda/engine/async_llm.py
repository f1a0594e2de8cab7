"""AsyncLLM: the asyncio front end of the engine, used by the HTTP server.

(Interface first; the implementation is being written.)
"""

from __future__ import annotations

from typing import AsyncIterator

from pagoda.config import EngineConfig
from pagoda.engine.protocol import SchedulerStats
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine-core process died or stopped making progress."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (--max-num-queued-requests); retry later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AsyncLLM:
    config: EngineConfig
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True) -> "AsyncLLM":
        """Start the engine (an engine-core process when multiprocess)."""
        raise NotImplementedError

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (message names the problem) for a request the engine would reject."""
        raise NotImplementedError

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput after every engine step that changed the request.
        Each CompletionOutput carries cumulative text/token_ids plus this update's
        delta_text / delta_token_ids / delta_logprobs and just_finished. The last
        output has finished=True. Closing the iterator early (client gone)
        aborts the request and frees its KV blocks. Raises ValueError for an
        invalid request before the first yield, EngineOverloadedError when the
        queue is full, EngineDeadError if the engine dies."""
        raise NotImplementedError
        yield

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError

    @property
    def is_healthy(self) -> bool:
        """False once the engine process died or its loop stalled while busy."""
        raise NotImplementedError

    def latest_stats(self) -> SchedulerStats:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError
