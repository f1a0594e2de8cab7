"""Per-request sampling settings, with vLLM's (and OpenAI's) names and defaults.

``SamplingParams`` is a plain mutable dataclass whose ``__post_init__``
validates every field and normalises a few of them (``stop`` and
``stop_token_ids`` become lists, ``top_k=-1`` becomes ``0``, numbers become
``float``/``int``, containers are copied). Because normalisation is idempotent,
``dataclasses.replace(params, temperature=0.0)`` re-validates and works as
expected; ``clone()`` is exactly that with no changes.

Every error is a ``ValueError`` whose message starts with the field name, so
an API layer can turn it into a 400 response as is.
"""

from __future__ import annotations

import json

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from pagoda.config.kv_transfer import KVTransferParams

# The default bound on the top alternatives a request may ask logprobs for (the engine's
# --max-logprobs; checked in pagoda/validation.py, since the operator may change it).
MAX_LOGPROBS = 20
# Tokens whose logprobs a request may track at every step (logprob_token_ids).
MAX_LOGPROB_TOKEN_IDS = 1024
# Bounds on per-request lists, so one request cannot make every step slow.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 256
MAX_EXTRA_ARGS = 64
MAX_EXTRA_ARG_CHARS = 16384

# Below this temperature sampling is greedy: dividing logits by something this
# small only amplifies noise, and temperature 0 would divide by zero.
_GREEDY_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    # Random with a user seed: the runner must give the request its own
    # generator seeded with ``seed``.
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but ``n=True`` is a caller bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


# Every integer that reaches the engine fits a signed 64-bit field (the engine link's
# msgspec encoding and torch's generator seeds take no more): a larger one is the client's
# error, named with its bound, not an overflow while the request is being sent.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must be between {INT64_MIN} and {INT64_MAX} (a signed 64-bit integer), got {value}")
    return value


def _check_float(name: str, value: Any) -> float:
    """A finite real number, returned as float (ints such as ``temperature=0`` are fine)."""
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar. Exactly one form is set.

    - json: a JSON schema (a dict, or its JSON text); stored as canonical text.
    - json_object: any JSON object.
    - regex: a regular expression the whole output must match.
    - choice: the output is exactly one of these strings.
    - grammar: a context-free grammar in Lark syntax (llguidance's EBNF dialect).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # Key order kept: a schema's property order is the order generated.
            self.json = json.dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {self.json!r}")
        self.json_object = _check_bool("structured_outputs.json_object", self.json_object)
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {self.regex!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs.grammar must be a string, got {self.grammar!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        forms = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(forms) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar"
            )

    @property
    def key(self) -> tuple[str, str]:
        """A hashable description, for grammar caches."""
        if self.json is not None:
            return ("json", str(self.json))
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        return ("grammar", str(self.grammar))


@dataclass
class SamplingParams:
    """How to pick the tokens of one request; see the module docstring."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (normalised to 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives; 0 = only the sampled token; -1 = the whole vocabulary
    # vLLM's extensions: the top alternatives at every prompt position (its first is None;
    # -1 = the whole vocabulary), and tokens whose logprobs every generated position
    # reports whatever their rank (they need ``logprobs``; it defaults to 0 with them).
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    # Sample best_of sequences, return the n with the highest cumulative logprob (vLLM V0's
    # and OpenAI's completions). None = n.
    best_of: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Prefill-decode disaggregation (pagoda/config/kv_transfer.py): this request's part in a
    # KV transfer between a prefill and a decode instance; a dict of its fields is accepted.
    kv_transfer_params: KVTransferParams | None = None
    # vLLM's: sample only among these tokens; never generate these words (each as the
    # tokenizer writes it at the start of a text and after a space: its last token is banned
    # whenever the output ends with the tokens before it). ``bad_words_token_ids`` holds
    # them as token ids, set from the tokenizer when the request is added (or given directly).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: arguments for the engine's logits processors (pagoda/sample/logits_processor.py;
    # ``vllm_xargs`` on the OpenAI routes): str keys, str / int / float / bool values.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        self._validate_sampling()
        self._validate_penalties()
        self._validate_logit_bias()
        self._validate_stops()
        self._validate_lengths()

        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        self._validate_logprobs()
        self._validate_best_of()
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        self._validate_kv_transfer()
        self._validate_word_lists()
        self._validate_extra_args()

    def _validate_extra_args(self) -> None:
        if self.extra_args is None:
            return
        if not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be an object of names to values, got {self.extra_args!r}")
        if len(self.extra_args) > MAX_EXTRA_ARGS:
            raise ValueError(f"extra_args may hold at most {MAX_EXTRA_ARGS} entries, got {len(self.extra_args)}")
        args: dict[str, Any] = {}
        for key, value in self.extra_args.items():
            if not isinstance(key, str) or not key or len(key) > MAX_EXTRA_ARG_CHARS:
                raise ValueError(f"extra_args keys must be non-empty strings of at most {MAX_EXTRA_ARG_CHARS} "
                                 f"characters, got {key!r:.100}")
            # (Every message starts with the field's name: the HTTP layer names it in its 400.)
            if _is_int(value) and not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"extra_args integers must fit a signed 64-bit integer, got {value} for {key!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"extra_args numbers must be finite, got {value} for {key!r}")
            if isinstance(value, str) and len(value) > MAX_EXTRA_ARG_CHARS:
                raise ValueError(f"extra_args strings may be at most {MAX_EXTRA_ARG_CHARS} characters, got "
                                 f"{len(value)} for {key!r}")
            if not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"extra_args values must be strings, numbers or booleans, got {value!r} for {key!r}")
            args[key] = value
        self.extra_args = args   # a copy: a clone never shares the caller's dict

    def _validate_word_lists(self) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            ids = [_check_int("allowed_token_ids", t) for t in self.allowed_token_ids]
            if any(t < 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be token ids (ints >= 0), got {ids}")
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) or len(self.bad_words) > MAX_BAD_WORDS or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings")
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            seqs = []
            for seq in self.bad_words_token_ids:
                if not isinstance(seq, (list, tuple)) or not seq:
                    raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
                seqs.append([_check_int("bad_words_token_ids", t) for t in seq])
            self.bad_words_token_ids = seqs

    def update_from_tokenizer(self, encode) -> None:
        """``bad_words`` as token ids (``encode``: text -> ids, no special tokens): each word
        as written at the start of a text and, where that tokenizes apart, after a space."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(encode(text))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = (self.bad_words_token_ids or []) + seqs

    def _validate_logprobs(self) -> None:
        """Counts >= -1 (-1: the whole vocabulary). Their upper bound is the engine's
        --max-logprobs, checked by pagoda/validation.py."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _check_int(name, value)
                if value < -1:
                    raise ValueError(f"{name} must be -1 (the whole vocabulary) or >= 0, got {value}")
                setattr(self, name, value)
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"logprob_token_ids must be a list of token ids, got {ids!r}")
        if not ids or len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids must hold 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, got {len(ids)}")
        for token_id in ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logprob_token_ids must be token ids (ints >= 0), got {token_id!r}")
        self.logprob_token_ids = list(dict.fromkeys(int(t) for t in ids))
        if self.logprobs is None:
            self.logprobs = 0  # the tracked tokens ride on the sampled token's logprobs

    def _validate_best_of(self) -> None:
        if self.best_of is None:
            return
        self.best_of = _check_int("best_of", self.best_of)
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.best_of > self.n and self.temperature < _GREEDY_EPS:
            raise ValueError(
                f"best_of must equal n when sampling greedily (temperature 0): "
                f"its {self.best_of} samples would all be the same, got best_of={self.best_of}"
            )

    def _validate_kv_transfer(self) -> None:
        kv = self.kv_transfer_params = KVTransferParams.parse(self.kv_transfer_params)
        if kv is None:
            return
        if self.n != 1 or self.best_of is not None:
            raise ValueError("kv_transfer_params needs n=1 and no best_of: one sequence's KV blocks are transferred")
        if kv.do_remote_prefill and self.prompt_logprobs is not None:
            raise ValueError("kv_transfer_params (do_remote_prefill) cannot be combined with prompt_logprobs: the "
                             "prompt was computed on the prefill instance")

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for this request: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    def _validate_sampling(self) -> None:
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0  # one spelling of "disabled" keeps the sampler simple
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
            )
        bias: dict[int, float] = {}
        for token_id, value in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}")
            value = _check_float("logit_bias", value)
            if not -100 <= value <= 100:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {value} for token {token_id}"
                )
            bias[int(token_id)] = value
        # A copy, so a clone never shares (and never mutates) the caller's dict.
        self.logit_bias = bias

    def _validate_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple, set, frozenset)):
            ids = list(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        for token_id in ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {token_id!r}")
        self.stop_token_ids = ids

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """An independent copy (containers are copied by ``__post_init__``)."""
        return dataclasses.replace(self)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce (call once the model is known)."""
        bad = [token_id for token_id in self.logit_bias or {} if token_id >= vocab_size]
        if bad:
            # vLLM's words, naming every offender.
            raise ValueError(f"logit_bias token id(s) {bad} contain out-of-vocab token ids (vocab size {vocab_size})")
        for token_id in self.stop_token_ids or []:
            if token_id >= vocab_size:
                raise ValueError(
                    f"stop_token_ids token id {token_id} is out of range for vocab size {vocab_size}"
                )
        for token_id in self.logprob_token_ids or []:
            if token_id >= vocab_size:
                raise ValueError(
                    f"logprob_token_ids token id {token_id} is out of range for vocab size {vocab_size}"
                )
        for name in ("allowed_token_ids", "bad_words_token_ids"):
            values = getattr(self, name) or []
            flat = [t for seq in values for t in seq] if name == "bad_words_token_ids" else values
            bad = [t for t in flat if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token id(s) {bad[:5]} are out of range for vocab size {vocab_size}")
