"""Which requests an engine takes: one check, one message per problem.

``validate_request`` is the whole check. The API process runs it before a request
leaves for the engine core (``EngineClient.validate_request``: AsyncLLM, the
data-parallel client; the HTTP server calls it first to answer 400 before admitting the
request), and the offline ``LLM`` runs it before its engine sees a request.

``admission_check`` is the part the core re-runs, in ``Scheduler.add_request``, for a
request that reached it without a front end (a benchmark, a test, a script driving
``EngineCore``): what would break the scheduler's or the model's invariants. It costs
a min() and a max() over the prompt.

Integers are bounded to 64 bits where SamplingParams is built (``_check_int`` in
pagoda/sampling_params.py), not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pagoda.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS

if TYPE_CHECKING:
    from pagoda.lora.request import LoRARequest
    from pagoda.pooling import PoolerConfig, PoolingParams
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "InvalidRequestError",
    "RequestLimits",
    "WrongTaskError",
    "admission_check",
    "check_extra_args",
    "check_logprobs",
    "check_priority",
    "validate_pooling_request",
    "validate_request",
]


class InvalidRequestError(ValueError):
    """A request the engine does not take. ``param``: the request field at fault, in the
    engine's words ("prompt", "max_tokens", "priority"), None where no single field is;
    ``code``: a machine-readable kind (the HTTP server passes both on in its 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class WrongTaskError(InvalidRequestError):
    """A generation request to an embedding engine, or an embedding request to a generating one."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "wrong_task")


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the engine's facts and the settings that bound a request."""

    max_model_len: int
    vocab_size: int | None = None       # None: token ids are not checked (a scheduler with no model)
    scheduling_policy: str = "fcfs"
    enable_lora: bool = False
    max_logprobs: int = MAX_LOGPROBS    # --max-logprobs; -1: up to the whole vocabulary
    pooler: PoolerConfig | None = None  # an embedding engine's pooling (None: the engine generates)
    logits_processors: tuple[str, ...] = ()   # --logits-processors: the classes' names


def check_priority(priority: object, policy: str) -> None:
    """A request's priority: a signed 64-bit integer, non-zero only under a policy that uses it."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority", "invalid_value")
    if not INT64_MIN <= priority <= INT64_MAX:
        raise InvalidRequestError(
            f"priority must be between {INT64_MIN} and {INT64_MAX} (a signed 64-bit integer), got {priority}",
            "priority", "invalid_value",
        )  # fmt: skip
    if priority != 0 and policy == "fcfs":
        raise InvalidRequestError(
            f"priority={priority} is not allowed with the fcfs scheduling policy; "
            "start the engine with --scheduling-policy priority (or fair)",
            "priority", "invalid_value",
        )  # fmt: skip


def _check_token_ids(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    # min() and max() first: a scan in C; the list of offenders only when there are some.
    if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        # vLLM's words ("Token id N is out of vocabulary"), naming up to five offenders.
        which = f"Token id {bad[0]} is" if len(bad) == 1 else f"Token ids {bad[:5]} are"
        raise InvalidRequestError(f"{which} out of vocabulary (vocabulary size {vocab_size}).")
    try:
        params.validate_for_vocab(vocab_size)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int | None) -> None:
    """logprobs and prompt_logprobs within --max-logprobs (-1 asks for the whole vocabulary,
    which counts as vocab_size; a bound of -1 allows it)."""
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is None or max_logprobs == -1:
            continue
        if asked == -1 and (vocab_size is None or vocab_size > max_logprobs):
            raise InvalidRequestError(
                f"{name}=-1 asks for the whole vocabulary ({vocab_size} tokens), more than this server's "
                f"limit of {max_logprobs} (--max-logprobs; -1 allows it)", name, "invalid_value",
            )  # fmt: skip
        if asked > max_logprobs:
            raise InvalidRequestError(
                f"{name} must be at most {max_logprobs} (this server's --max-logprobs), got {asked}",
                name, "invalid_value",
            )  # fmt: skip


def check_extra_args(params: SamplingParams, logits_processors: tuple[str, ...]) -> None:
    """``extra_args`` (``vllm_xargs`` on the OpenAI routes) are arguments for the logits
    processors: refused where the engine loads none, else checked by each one's
    ``validate_params`` (its ValueError is the request's)."""
    if not logits_processors:
        if params.extra_args:
            raise InvalidRequestError(
                "extra_args (vllm_xargs) are arguments for logits processors, and this engine loads none "
                "(start it with --logits-processors)", "extra_args", "invalid_value",
            )  # fmt: skip
        return
    from pagoda.sample.logits_processor import load_processor_class

    for name in logits_processors:
        try:
            load_processor_class(name).validate_params(params)
        except ValueError as e:
            raise InvalidRequestError(f"extra_args (vllm_xargs): {e}", "extra_args", "invalid_value") from None


def _check_prompt_length(num_prompt_tokens: int, max_model_len: int, pooling: bool = False) -> None:
    if pooling:
        # An embedding generates nothing: the whole context is the prompt's.
        if num_prompt_tokens > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length (max_model_len) is {max_model_len} tokens, but the input "
                f"has {num_prompt_tokens} tokens. Please reduce the input (or set truncate_prompt_tokens).",
                "prompt", "context_length_exceeded",
            )  # fmt: skip
        return
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length (max_model_len) is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens (at least one token must be left for the completion).",
            "prompt", "context_length_exceeded",
        )  # fmt: skip


def _check_lora(lora_request: LoRARequest | None, enable_lora: bool) -> None:
    if lora_request is not None and not enable_lora:
        raise InvalidRequestError(
            f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled: the engine runs "
            "without LoRA (start it with enable_lora=True / --enable-lora)"
        )


def admission_check(
    prompt_token_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    priority: object = 0,
    lora_request: LoRARequest | None = None,
    pooling: bool = False,
) -> None:
    """The core's re-check (see the module's docstring): token ids inside the vocabulary
    (when ``limits`` knows it), room for one generated token (``pooling``, an embedding
    request: room for the prompt), the priority, LoRA."""
    if limits.vocab_size is not None:
        _check_token_ids(prompt_token_ids, params, limits.vocab_size)
    _check_prompt_length(len(prompt_token_ids), limits.max_model_len, pooling)
    check_priority(priority, limits.scheduling_policy)
    _check_lora(lora_request, limits.enable_lora)


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    priority: object = 0,
    lora_request: LoRARequest | None = None,
    *,
    validate_grammar: Callable[[StructuredOutputsParams], None] | None = None,
) -> None:
    """Raise InvalidRequestError for a request the engine would not take (GrammarError,
    from ``validate_grammar``, for a structured output constraint that does not compile).

    In order: an empty prompt; token ids outside the vocabulary (the prompt's, logit_bias's,
    stop_token_ids'); a prompt that leaves no room to generate; prompt plus max_tokens
    beyond the context length; the priority; a LoRA adapter with LoRA off; extra_args
    (``check_extra_args``); then the grammar, the one costly check, last."""
    if limits.pooler is not None and limits.pooler.classifier is not None:
        raise WrongTaskError("This model is a classifier (task 'classify'), not a text generator; use /classify, "
                             "/score or /rerank.")
    if limits.pooler is not None:
        raise WrongTaskError("This model serves embeddings (task 'embed'), not text generation; use "
                             "/v1/embeddings (LLM.embed), or start the engine with --task generate on a "
                             "model with an LM head.")
    if not prompt_token_ids:
        raise InvalidRequestError("The decoder prompt cannot be empty")  # vLLM's message
    admission_check(prompt_token_ids, params, limits, priority, lora_request)
    check_logprobs(params, limits.max_logprobs, limits.vocab_size)
    check_extra_args(params, limits.logits_processors)
    n, max_tokens, max_len = len(prompt_token_ids), params.max_tokens, limits.max_model_len
    if max_tokens is not None and n + max_tokens > max_len:
        raise InvalidRequestError(
            f"This model's maximum context length (max_model_len) is {max_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). Please reduce the "
            "prompt or the completion's maximum length.",
            "max_tokens", "context_length_exceeded",
        )  # fmt: skip
    if params.structured_outputs is not None and validate_grammar is not None:
        validate_grammar(params.structured_outputs)


def validate_pooling_request(
    prompt_token_ids: list[int],
    pooling_params: PoolingParams,
    limits: RequestLimits,
    priority: object = 0,
    lora_request: LoRARequest | None = None,
) -> None:
    """``validate_request`` for an embedding request: an embedding engine; a non-empty input
    whose token ids are in the vocabulary and that fits the context (all of it: nothing is
    generated); a width the model offers; the priority; LoRA."""
    from pagoda.pooling import placeholder_sampling_params

    if limits.pooler is None:
        raise WrongTaskError("This model generates text (task 'generate'); it does not serve embeddings. Start "
                             "the engine with --task embed for /v1/embeddings (LLM.embed).")
    if pooling_params.task != limits.pooler.task:
        wants = "an embedding" if pooling_params.task == "embed" else "a classification"
        serves = "serves embeddings (task 'embed')" if limits.pooler.task == "embed" else \
            "is a classifier (task 'classify': /classify, /score, /rerank)"
        raise WrongTaskError(f"This request wants {wants}, but this model {serves}.")
    if not prompt_token_ids:
        raise InvalidRequestError("the input is empty", "prompt", "invalid_value")
    try:
        limits.pooler.check_dimensions(pooling_params.dimensions)
    except ValueError as e:
        raise InvalidRequestError(str(e), "dimensions", "invalid_value") from None
    try:
        limits.pooler.check_pair(pooling_params.pair_start, len(prompt_token_ids))
    except ValueError as e:
        raise InvalidRequestError(str(e), "pair_start", "invalid_value") from None
    admission_check(prompt_token_ids, placeholder_sampling_params(), limits, priority, lora_request, pooling=True)
