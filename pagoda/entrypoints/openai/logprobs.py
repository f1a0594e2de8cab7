"""Engine logprobs -> OpenAI's two logprobs shapes (chat and legacy completions)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

from tokenizers import decoders

from pagoda.entrypoints.openai.responses import (
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsOut,
    TokenLogprob,
    TopLogprob,
)
from pagoda.outputs import Logprob, SampleLogprobs
from pagoda.tokenizer import Tokenizer

# JSON has no -inf; OpenAI reports impossible tokens as -9999.0, and so do we.
_MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _clamp(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN to the floor


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (character -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _label(token_id: int, text: str, as_token_id: bool) -> str:
    return f"token_id:{token_id}" if as_token_id else text


class LogprobFormatter:
    """Decodes token ids for logprobs output, caching per token id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int, entry: Logprob | None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's exact bytes. Decoded text cannot give them for a token that is only part of a
        UTF-8 character (its text is U+FFFD), which is exactly why OpenAI sends `bytes`."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        raw = self.tokenizer.id_to_token(token_id) or ""
        table = _byte_level_decoder()
        match = _BYTE_TOKEN.fullmatch(raw)
        if self._byte_level and raw and all(ch in table for ch in raw):
            value = [table[ch] for ch in raw]
        elif match:  # SentencePiece byte-fallback token
            value = [int(match.group(1), 16)]
        else:
            value = list(text.encode("utf-8"))
        self._bytes[token_id] = value
        return value

    @staticmethod
    def _top(position: dict[int, Logprob], top_n: int, tracked: Sequence[int] = ()) -> list[tuple[int, Logprob]]:
        """The top_n alternatives by rank (top_n -1: every one the engine sent, the whole
        vocabulary), then the tracked logprob_token_ids that are not among them."""
        if top_n == -1:
            top_n = len(position)
        ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_n]
        ranked.sort(key=lambda item: item[1].rank or 0)
        seen = {tid for tid, _ in ranked}
        ranked.extend((tid, position[tid]) for tid in tracked if tid in position and tid not in seen)
        return ranked

    def prompt(self, prompt_logprobs: Sequence[dict[int, Logprob] | None]) -> PromptLogprobsOut:
        """vLLM's prompt_logprobs: per position None (the first) or token id -> entry."""
        return [
            None if position is None else {
                str(tid): PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=self.text(tid, lp))
                for tid, lp in position.items()
            }
            for position in prompt_logprobs
        ]  # fmt: skip

    def chat(self, token_ids: Sequence[int], logprobs: SampleLogprobs, top_n: int,
             tracked: Sequence[int] = (), as_token_ids: bool = False) -> list[TokenLogprob]:  # fmt: skip
        """Chat shape: one entry per sampled token, with its top_n alternatives (and the
        request's logprob_token_ids after them). ``as_token_ids`` (vLLM's
        return_tokens_as_token_ids): each token written ``token_id:N``, for tokens whose text is
        not a whole character; ``bytes`` stays the token's own bytes."""
        out = []
        for token_id, position in zip(token_ids, logprobs, strict=False):  # a short side is not an error
            sampled = position.get(token_id)
            text = self.text(token_id, sampled)
            top = []
            for tid, lp in self._top(position, top_n, tracked):
                alt_text = self.text(tid, lp)
                alt = TopLogprob(token=_label(tid, alt_text, as_token_ids), logprob=_clamp(lp.logprob),
                                 bytes=self.token_bytes(tid, alt_text))  # fmt: skip
                top.append(alt)
            out.append(
                TokenLogprob(
                    token=_label(token_id, text, as_token_ids),
                    logprob=_clamp(sampled.logprob if sampled is not None else -math.inf),
                    bytes=self.token_bytes(token_id, text),
                    top_logprobs=top,
                )
            )
        return out

    def completion(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None], top_n: int, text_offset: int,
        tracked: Sequence[int] = (), result: CompletionLogprobs | None = None, as_token_ids: bool = False,
    ) -> tuple[CompletionLogprobs, int]:
        """Legacy shape; top_logprobs holds the top_n alternatives plus the sampled token, as OpenAI
        documents ("up to logprobs+1 elements"), then any tracked logprob_token_ids. A position
        of None (an echoed prompt's first token) has null logprobs. Appends to ``result`` when
        given (echo: the prompt's tokens, then the completion's). ``as_token_ids``: tokens
        written ``token_id:N`` (offsets still count the text's characters). Returns the text
        offset after the last token."""
        result = result if result is not None else CompletionLogprobs()
        for token_id, position in zip(token_ids, logprobs, strict=False):  # a short side is not an error
            if position is None:
                text = self.text(token_id, None)
                result.tokens.append(_label(token_id, text, as_token_ids))
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                result.text_offset.append(text_offset)
                text_offset += len(text)
                continue
            sampled = position.get(token_id)
            text = self.text(token_id, sampled)
            result.tokens.append(_label(token_id, text, as_token_ids))
            result.token_logprobs.append(_clamp(sampled.logprob if sampled is not None else -math.inf))
            top: dict[str, float] = {}
            for tid, lp in self._top(position, top_n, tracked):
                top.setdefault(_label(tid, self.text(tid, lp), as_token_ids), _clamp(lp.logprob))
            if sampled is not None:
                top.setdefault(_label(token_id, text, as_token_ids), _clamp(sampled.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result, text_offset
