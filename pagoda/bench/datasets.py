"""Workloads for `pagoda bench serve`: random, prefix, multiturn and JSONL prompts.

Every dataset yields conversations; single-shot datasets yield conversations of one turn.
Prompts are text (not token ids), so that any OpenAI-compatible server can take them, and
their lengths are exact under the client's tokenizer: the random text is built from token
ids, decoded, re-encoded and trimmed until the round trip is stable. A server with the
same tokenizer counts the same (plus any BOS token it adds).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

DATASETS = ("random", "random-mm", "prefix", "multiturn", "jsonl")

_WORD_START = re.compile(r"^ [A-Za-z]+$")   # a token that opens a new word: " word"
_ENDS_IN_LETTER = re.compile(r"[A-Za-z]$")


class TokenizerLike(Protocol):
    vocab_size: int
    all_special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Turn:
    prompt: str | None                  # the completion prompt, or this turn's user message
    output_len: int
    prompt_len: int = 0                 # tokens of `prompt` under the client's tokenizer
    messages: list[dict[str, Any]] | None = None   # a whole chat given by a JSONL line


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """[mean * (1 - r), mean * (1 + r)], at least 1 token."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    return max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))


class TextSampler:
    """Random text of an exact token count, from a pool of plain ASCII tokens (no specials,
    no byte fragments), so that decode -> encode gives back the same number of tokens."""

    def __init__(self, tokenizer: TokenizerLike, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        special = set(tokenizer.all_special_ids)
        self.pool: list[int] = []
        self.word_starts: list[int] = []
        for i in range(tokenizer.vocab_size):
            if i in special:
                continue
            s = tokenizer.decode([i])
            if s and s.isascii() and s.isprintable() and s.strip():
                self.pool.append(i)
                if _WORD_START.match(s):
                    self.word_starts.append(i)
        if len(self.pool) < 100 or not self.word_starts:
            raise ValueError("the tokenizer has too few plain-text tokens to build random prompts")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, n_tokens: int, word_start: bool = False) -> tuple[str, list[int]]:
        """Text that encodes to exactly ``n_tokens`` tokens (retrying fresh draws if a round
        trip will not settle). ``word_start``: it opens with a " word" token, so that it
        can follow other text without merging into its last token."""
        for _ in range(20):
            ids = self.rng.choices(self.pool, k=n_tokens)
            if word_start:
                ids[0] = self.rng.choice(self.word_starts)
            # Decoding can merge neighbours into fewer tokens (or split them): trim or top up.
            for _ in range(8):
                text = self.tok.decode(ids)
                again = self.encode(text)
                if again == ids:
                    return text, ids
                ids = again[:n_tokens] + self.rng.choices(self.pool, k=max(0, n_tokens - len(again)))
        raise RuntimeError(f"could not build a stable {n_tokens}-token text")


def random_dataset(sampler: TextSampler, num: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0) -> list[Conversation]:
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    convs = []
    for _ in range(num):
        n = sampler.rng.randint(in_lo, in_hi)
        text, ids = sampler.text(n)
        convs.append(Conversation([Turn(text, sampler.rng.randint(out_lo, out_hi), len(ids))]))
    return convs


def random_mm_dataset(sampler: TextSampler, num: int, input_len: int, output_len: int, image_size: tuple[int, int],
                      images_per_request: int = 1, range_ratio: float = 0.0) -> list[Conversation]:
    """Chat requests of ``images_per_request`` images of random pixels (``image_size``: width,
    height; PNG data URLs, a new image each, so no encoder cache helps) before random text of
    ``input_len`` tokens (``prompt_len`` counts the text only: the server's usage counts the
    image tokens)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    width, height = image_size
    rng = np.random.default_rng(sampler.rng.randrange(2**32))
    convs = []
    for conv in random_dataset(sampler, num, input_len, output_len, range_ratio):
        turn = conv.turns[0]
        parts: list[dict[str, Any]] = []
        for _ in range(images_per_request):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
        parts.append({"type": "text", "text": turn.prompt})
        turn.messages = [{"role": "user", "content": parts}]
        convs.append(conv)
    return convs


def prefix_dataset(sampler: TextSampler, num: int, prefix_len: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0) -> list[Conversation]:
    """One shared prefix of exactly ``prefix_len`` tokens, then a unique suffix of ~input_len.

    The prompt's tokens are exactly prefix tokens + suffix tokens: the prefix ends in a
    letter and every suffix starts with a " word" token, and each pair is checked."""
    for _ in range(20):
        prefix, prefix_ids = sampler.text(prefix_len)
        if _ENDS_IN_LETTER.search(prefix):
            break
    else:
        raise RuntimeError("could not build a prefix ending in a letter")
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    convs = []
    while len(convs) < num:
        suffix, suffix_ids = sampler.text(sampler.rng.randint(in_lo, in_hi), word_start=True)
        if sampler.encode(prefix + suffix) != prefix_ids + suffix_ids:
            continue   # the two merged at the seam: draw another suffix
        convs.append(Conversation([Turn(prefix + suffix, sampler.rng.randint(out_lo, out_hi),
                                        prefix_len + len(suffix_ids))]))
    return convs


def multiturn_dataset(sampler: TextSampler, num: int, num_turns: int, input_len: int, output_len: int,
                      range_ratio: float = 0.0) -> list[Conversation]:
    """``num`` conversations of ``num_turns`` user turns; each turn's request carries the whole
    history so far (earlier user turns and the server's own replies), so prompts grow."""
    if num_turns < 1:
        raise ValueError("a conversation needs at least one turn")
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    convs = []
    for _ in range(num):
        turns = []
        for _ in range(num_turns):
            text, ids = sampler.text(sampler.rng.randint(in_lo, in_hi))
            turns.append(Turn(text, sampler.rng.randint(out_lo, out_hi), len(ids)))
        convs.append(Conversation(turns))
    return convs


def jsonl_dataset(path: str, num: int | None, output_len: int,
                  tokenizer: TokenizerLike | None = None) -> list[Conversation]:
    """One request per line: {"prompt": "..."} or {"messages": [...]}, with an optional
    "output_len" (or "max_tokens"); the first ``num`` lines (all when None)."""
    convs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
                raise ValueError(f"{path}:{lineno}: expected an object with exactly one of 'prompt', 'messages'")
            out = int(item.get("output_len", item.get("max_tokens", output_len)))
            if "prompt" in item:
                prompt = str(item["prompt"])
                n = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer else 0
                convs.append(Conversation([Turn(prompt, out, n)]))
            else:
                convs.append(Conversation([Turn(None, out, 0, messages=list(item["messages"]))]))
            if num is not None and len(convs) >= num:
                break
    if not convs:
        raise ValueError(f"{path}: no requests")
    return convs


def completion_history(history: list[tuple[str, str]], user: str) -> str:
    """The /v1/completions prompt for a multi-turn conversation: earlier turns as plain
    text, then the new user turn, ending where the assistant's reply should begin."""
    parts = [f"User: {u}\nAssistant:{a}\n" for u, a in history]
    parts.append(f"User: {user}\nAssistant:")
    return "".join(parts)


def chat_history(history: list[tuple[str, str]], user: str) -> list[dict[str, str]]:
    messages = []
    for u, a in history:
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": user})
    return messages
