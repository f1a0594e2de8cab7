"""Incremental detokenization and stop-string matching for one output sequence.

Re-decoding all output ids at every step costs O(length) per step (O(n^2) per
sequence); ``tokenizers.decoders.DecodeStream`` keeps only a short window of
ids and decodes that, which is about a microsecond per token whatever the
length.  This module wraps it with the bookkeeping an engine needs: stop
strings matched across token boundaries, text truncation at the match, and
streaming deltas that never show a client a partial stop string that would
later be removed.

Text definition
---------------
``output_text`` is the text the output ids add after the prompt::

    decode(prompt_ids + output_ids)[len(decode(prompt_ids)):]

computed with only the last few prompt ids as left context (that is all the
decoders need).  For byte-level BPE (GPT-2 style, SmolLM2, Llama 3, Qwen) this
is exactly ``tokenizer.decode(output_ids)``.  For SentencePiece-style decoders
(Metaspace / ``Strip``) it differs from decoding the output ids alone only in
that the first output token keeps its leading space, as it would in a decode
of the whole conversation.  If the prompt ends in the middle of a multi-byte
character (a prompt cut mid-character) the incomplete tail is left out of the
context, so the output then decodes as if it stood alone.

Until the sequence finishes, text whose last character is incomplete (a
UTF-8 sequence split over tokens, still waiting for its remaining bytes) is
held back by the decode stream.  ``output_text`` includes such a pending tail
in its provisional form (with U+FFFD, as ``tokenizer.decode`` would give), so
it always equals the definition above; ``get_delta(finished=False)`` never
returns it, because it may still change.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer"]

# How many trailing prompt ids are given to the decode stream as left context.
# Decoders only look at a token's neighbours (a leading-space strip applies to
# the first token of the decoded run; byte-level needs only a clean character
# boundary), so a handful is enough; more would only slow the first step.
_PROMPT_CONTEXT_TOKENS = 8

# Same idea for working out the text the stream is still holding back (see
# ``_settle``): a few ids before the pending ones are enough context.
_SETTLE_CONTEXT_TOKENS = 8

# ``_ids`` is trimmed once the ids before the pending ones exceed this many.
_ID_HISTORY_TRIM = 512

_REPLACEMENT_CHAR = "\ufffd"


class _StopMatch(NamedTuple):
    start: int  # index of the match in the searched region
    stop: str


class _Settled(NamedTuple):
    """How the held-back tail changes the stable text if the sequence ends now."""

    drop: int  # characters to remove from the end of the stable text
    append: str  # text to add after that
    stop: str | None  # stop string matched in the tail, if any


_NOTHING_PENDING = _Settled(0, "", None)


class IncrementalDetokenizer:
    """Turns the token ids generated for one sequence into text, step by step.

    ``update`` feeds new ids and reports a stop-string match; ``get_delta``
    returns the text a streaming client has not yet been sent; ``output_text``
    is the whole text so far.  After a stop string matched, or after
    ``get_delta(finished=True)``, the sequence is over and ``update`` raises.
    """

    num_output_tokens: int

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # An empty stop string would match before any text; it is meaningless,
        # so it is ignored rather than stopping every request at once.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output
        max_stop_len = max((len(s) for s in self._stops), default=0)
        # A new match can start at most this many characters before new text.
        self._lookback = max(max_stop_len - 1, 0)
        # Every proper prefix of a stop string: a suffix of the text that is
        # one of these could grow into a match, so streaming holds it back.
        self._stop_prefixes: frozenset[str] = frozenset(
            s[:k] for s in self._stops for k in range(1, len(s))
        )

        context = self._clean_context(prompt_token_ids)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # Recent ids (prompt context, then output ids; older ones are trimmed).
        # Needed only to rebuild the held-back tail (``_settle``).
        self._ids: list[int] = list(context)
        # Index in ``_ids`` of the first id whose text the stream still holds.
        # Equal to len(_ids) when nothing is held.
        self._pending_start = len(self._ids)

        # Stable text as chunks (joined lazily) so that a step costs O(new
        # text), not O(all text) as repeated string concatenation would.
        self._chunks: list[str] = []
        self._num_chars = 0
        self._joined: str | None = ""  # cache of "".join(_chunks)
        self._sent_chars = 0  # characters of stable text returned by get_delta

        self._matched_stop: str | None = None
        self._finalized = False  # get_delta(finished=True) was called
        self._settle_cache: tuple[int, _Settled] | None = None
        self.num_output_tokens = 0

    # ------------------------------------------------------------------ setup

    def _clean_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last few prompt ids, minus any trailing incomplete character.

        The decode stream assumes its context decodes to a prefix of what the
        context plus new ids decode to.  That fails if the context ends in an
        incomplete UTF-8 sequence (its U+FFFD is replaced once more bytes
        arrive), so such trailing ids are dropped from the context.
        """
        context = [int(i) for i in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()
        return context

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    # --------------------------------------------------------------- feeding

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Feed newly generated ids; return the stop string that matched, if any.

        On a match the text is cut just before the stop string (just after it
        with ``include_stop_str_in_output``); the sequence is then over and a
        further call raises ``RuntimeError``.
        """
        if self._matched_stop is not None:
            raise RuntimeError(
                f"update() called after stop string {self._matched_stop!r} ended the sequence"
            )
        if self._finalized:
            raise RuntimeError("update() called after get_delta(finished=True)")

        pieces: list[str] = []
        for token_id in new_token_ids:
            tid = int(token_id)
            self._ids.append(tid)
            # One id per step (not the whole list): a list step emits only if
            # the text after the *last* id is complete, which could hold back
            # text that a stop string needs to be seen now.
            try:
                piece = self._stream.step(self._tokenizer, tid)
            except Exception:  # tokenizers raises a bare Exception here
                self._restart_stream(pieces)
                continue
            if piece is not None:
                pieces.append(piece)
                self._pending_start = len(self._ids)
        self.num_output_tokens += len(new_token_ids)
        self._settle_cache = None
        if self._pending_start > _ID_HISTORY_TRIM:
            # Only a few ids before the pending ones are ever read again, so
            # drop the rest (amortised O(1)) instead of keeping every id of a
            # long output alive for each running sequence.
            cut = self._pending_start - _SETTLE_CONTEXT_TOKENS
            del self._ids[:cut]
            self._pending_start -= cut
        if not pieces:
            return None
        new_text = pieces[0] if len(pieces) == 1 else "".join(pieces)

        if self._stops:
            tail = self._suffix(self._lookback)
            region = tail + new_text
            match = self._find_stop(region)
            if match is not None:
                self._apply_stop(tail, region, match)
                return match.stop
        self._append(new_text)
        return None

    def _restart_stream(self, pieces: list[str]) -> None:
        """Recover from the stream's "invalid prefix" error.

        The stream requires the text decoded so far to stay a prefix of the
        text once more ids are added.  Byte-level decoding always keeps that,
        but a byte-fallback decoder does not for invalid byte runs: it turns a
        whole run of byte tokens that is not valid UTF-8 into U+FFFDs, so
        garbage bytes can retroactively change a character already emitted.
        Emitted text cannot be taken back, so the ids not yet emitted are
        decoded afresh, without left context.  Only garbage byte sequences
        get here; the result then differs from a full decode only in how
        many U+FFFDs stand for the garbage (and possibly a leading space).
        """
        first = self._pending_start
        pending = self._ids[first:]
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        for index, tid in enumerate(pending, start=first + 1):
            try:
                piece = self._stream.step(self._tokenizer, tid)
            except Exception:
                # Same problem inside the pending ids: start once more from
                # this id alone; with an empty prefix the step cannot fail.
                self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
                piece = self._stream.step(self._tokenizer, tid)
            if piece is not None:
                pieces.append(piece)
                self._pending_start = index

    def _find_stop(self, region: str) -> _StopMatch | None:
        """The stop match in ``region`` that completes first.

        "First" means the smallest end index: that is the match a character-
        by-character stream would have seen first, so the result does not
        depend on how ids were grouped into updates.  Between matches that end
        at the same place the longer (earlier-starting) one wins, so that the
        cut is the earliest one.  Matches lying wholly in the look-back tail
        cannot occur: they would have been found by an earlier update.
        """
        best: _StopMatch | None = None
        best_end = 0
        for s in self._stops:
            i = region.find(s)
            if i < 0:
                continue
            end = i + len(s)
            if best is None or end < best_end or (end == best_end and i < best.start):
                best, best_end = _StopMatch(i, s), end
        return best

    def _cut(self, tail: str, region: str, match: _StopMatch) -> tuple[int, str]:
        """(chars to drop from stable text, text to append) for a match in
        ``region`` = ``tail`` + new text, where ``tail`` ends the stable text."""
        keep = match.start + len(match.stop) if self._include_stop else match.start
        if keep >= len(tail):
            return 0, region[len(tail) : keep]
        # The cut falls inside text already stored (never inside text already
        # sent: get_delta holds back suffixes that may begin a stop string).
        return len(tail) - keep, ""

    def _apply_stop(self, tail: str, region: str, match: _StopMatch) -> None:
        drop, append = self._cut(tail, region, match)
        if drop:
            self._truncate(drop)
        if append:
            self._append(append)
        self._matched_stop = match.stop
        # Whatever the stream still holds comes after the stop string.
        self._pending_start = len(self._ids)

    # ------------------------------------------------------ stable text store

    def _append(self, text: str) -> None:
        self._chunks.append(text)
        self._num_chars += len(text)
        self._joined = None

    def _truncate(self, n: int) -> None:
        """Remove the last ``n`` characters of the stable text."""
        n = min(n, self._num_chars)
        self._num_chars -= n
        self._joined = None
        while n:
            last = self._chunks[-1]
            if len(last) <= n:
                self._chunks.pop()
                n -= len(last)
            else:
                self._chunks[-1] = last[:-n]
                n = 0
        self._sent_chars = min(self._sent_chars, self._num_chars)

    def _suffix(self, n: int) -> str:
        """The last ``n`` characters of the stable text, touching only the
        chunks that hold them."""
        if n <= 0:
            return ""
        if self._joined is not None:
            return self._joined[-n:]
        parts: list[str] = []
        have = 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            have += len(chunk)
            if have >= n:
                break
        text = "".join(reversed(parts))
        return text[-n:] if len(text) > n else text

    def _stable_text(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._chunks)
            # Keep one chunk so later suffix lookups and joins stay cheap.
            self._chunks = [self._joined] if self._joined else []
        return self._joined

    # -------------------------------------------------------- held-back tail

    def _settle(self) -> _Settled:
        """What the stream's held-back tail adds if the sequence ends now.

        The stream holds text while its last character is incomplete (and
        also a genuine trailing U+FFFD, which it cannot tell apart).  A full
        decode would show it with replacement characters, so the final text
        includes it, checked for stop strings like any other new text.  The
        tail is only a few tokens, and the result is cached until the next
        update, so this is cheap.
        """
        if self._matched_stop is not None or self._pending_start >= len(self._ids):
            return _NOTHING_PENDING
        cached = self._settle_cache
        if cached is not None and cached[0] == self.num_output_tokens:
            return cached[1]

        start = self._pending_start
        context = self._ids[max(0, start - _SETTLE_CONTEXT_TOKENS) : start]
        pending = self._ids[start:]
        with_pending = self._decode(context + pending)
        context_text = self._decode(context)
        if with_pending.startswith(context_text):
            held = with_pending[len(context_text) :]
        else:  # should not happen (context ends cleanly); decode alone then
            held = self._decode(pending)

        result = _Settled(0, held, None)
        if held and self._stops:
            tail = self._suffix(self._lookback)
            region = tail + held
            match = self._find_stop(region)
            if match is not None:
                drop, append = self._cut(tail, region, match)
                result = _Settled(drop, append, match.stop)
        self._settle_cache = (self.num_output_tokens, result)
        return result

    # ---------------------------------------------------------------- output

    @property
    def output_text(self) -> str:
        """The whole output text so far, after stop-string truncation.

        Includes, provisionally, a tail whose last character is still
        incomplete (see the module docstring), so that at any point it equals
        a full decode of the ids fed so far.
        """
        text = self._stable_text()
        settled = self._settle()
        if settled is _NOTHING_PENDING:
            return text
        if settled.drop:
            text = text[: len(text) - settled.drop]
        return text + settled.append

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, or None.

        A match inside the held-back tail (only possible once the tail is
        final) is reported here but not by ``update``, which cannot know yet
        whether the tail will change.
        """
        if self._matched_stop is not None:
            return self._matched_stop
        return self._settle().stop

    def get_delta(self, finished: bool) -> str:
        """The text not yet returned by an earlier call.

        While not finished, a suffix that could be the start of a stop string
        is held back (at most len(longest stop) - 1 characters), as is any
        tail whose last character is still incomplete, so a client never sees
        text that is later removed or changed.  When finished (or once a stop
        string matched, which makes the text final), everything left is
        returned; after ``finished=True`` further updates raise.
        """
        if self._finalized:
            return ""
        unsent = self._suffix(self._num_chars - self._sent_chars)

        if finished:
            settled = self._settle()
            if settled.drop:
                # Cannot reach into sent text (it was held back), but clamp
                # anyway rather than return a wrong delta.
                unsent = unsent[: max(0, len(unsent) - settled.drop)]
            self._finalized = True
            self._sent_chars = self._num_chars
            return unsent + settled.append

        if self._matched_stop is not None or not self._stop_prefixes or not unsent:
            self._sent_chars = self._num_chars
            return unsent

        hold = 0
        for k in range(min(self._lookback, len(unsent)), 0, -1):
            if unsent[-k:] in self._stop_prefixes:
                hold = k
                break
        self._sent_chars = self._num_chars - hold
        return unsent[: len(unsent) - hold] if hold else unsent
