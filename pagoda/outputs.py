"""What generate() and chat() return, shaped like vLLM's so scripts port over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None             # 1 = most likely; None if not among the top alternatives
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob, holding the sampled
# token and the requested top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position: None for the first (nothing precedes it), then the
# prompt token's Logprob and the requested top alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None    # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # What changed in the latest update (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None
    just_finished: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a one-sequence request (n = 1, no best_of) went through the engine, vLLM's
    ``RequestOutput.metrics``: time.monotonic() values (the front end's arrival, the engine's
    first scheduling and the steps that produced its first and last tokens; 0.0: not yet, or
    not known) and the tokens generated. Set on a finished request's last output."""

    arrival_time: float
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None   # when SamplingParams.prompt_logprobs is set
    metrics: RequestMetrics | None = None           # a finished one-sequence request's timings


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine request that computes choice ``index`` (``CompletionOutput.index``) of a
    request with ``n`` choices: each runs in the engine core as its own child request."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape: ``out.outputs.embedding``), and
    what an embedding request's stream yields: one output, finished, or an aborted one
    (``finish_reason == "abort"``) with an empty embedding."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    finish_reason: str = "stop"
    num_cached_tokens: int = 0
