"""Reasoning parsers: the split of a finished text, the same split from a stream cut at every
offset, and the grammar that lets a constrained request think first."""

from __future__ import annotations

import pytest

from pagoda.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    count_reasoning_tokens,
    get_reasoning_parser,
)
from pagoda.reasoning.grammar import regex_literal
from pagoda.sampling_params import StructuredOutputsParams

R1 = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")

# (text, deepseek_r1's (reasoning, content), qwen3's (reasoning, content))
CASES = [
    ("<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4."), ("Let me see.", "\n\nIt is 4.")),
    ("Let me see.</think>It is 4.", ("Let me see.", "It is 4."), (None, "Let me see.</think>It is 4.")),
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),
    ("<think>still thinking", ("still thinking", None), ("still thinking", None)),
    ("<think></think>Answer", (None, "Answer"), (None, "Answer")),
    ("Hi <think>hm</think> there", ("Hi <think>hm", " there"), ("hm", "Hi  there")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("a < b <th and </thi", ("a < b <th and </thi", None), (None, "a < b <th and </thi")),
    ("", (None, None), (None, None)),
]


# (text, deepseek_r1's (in_reasoning, reasoning_end), qwen3's)
SECTIONS = [
    ("<think>Let me see.</think>\n\nIt is 4.", (False, 26), (False, 26)),
    ("Let me see.</think>It is 4.", (False, 19), (False, None)),
    ("It is 4.", (True, None), (False, None)),
    ("<think>still thinking", (True, None), (True, None)),
    ("Hi <think>hm</think> there", (False, 20), (False, 20)),
    ("</think><think>a</think>", (False, 8), (False, 24)),
    ("", (True, None), (False, None)),
]


@pytest.mark.parametrize("text,r1,qwen3", SECTIONS)
def test_where_the_reasoning_ends(text: str, r1: tuple[bool, int | None], qwen3: tuple[bool, int | None]) -> None:
    for parser, (open_, end) in ((R1, r1), (QWEN3, qwen3)):
        assert (parser.in_reasoning(text), parser.reasoning_end(text)) == (open_, end), parser.name
        if end is not None:
            assert text[:end].endswith("</think>")
            assert parser.extract(text[:end]).reasoning == parser.extract(text).reasoning


@pytest.mark.parametrize(("pieces", "r1", "qwen3"), [
    (["<think>", "Let", " me", " see.", "</", "think", ">", "It", " is", " 4."], 7, 7),
    (["<think>", "still", " thinking"], 3, 3),
    (["It", " is", " 4."], 3, 0),
    (["Fine", ".</think>", "Yes"], 2, 0),
    ([], 0, 0),
])  # fmt: skip
def test_count_reasoning_tokens(pieces: list[str], r1: int, qwen3: int) -> None:
    # Token i decodes to pieces[i]: the count is the shortest prefix holding the closed section.
    ids = list(range(len(pieces)))

    def decode(token_ids: list[int]) -> str:
        return "".join(pieces[i] for i in token_ids)

    assert count_reasoning_tokens(R1, ids, decode) == r1
    assert count_reasoning_tokens(QWEN3, ids, decode) == qwen3


def test_registry_and_unknown_name() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("text,r1,qwen3", CASES)
def test_extract(text: str, r1: tuple[str | None, str | None], qwen3: tuple[str | None, str | None]) -> None:
    for parser, expected in ((R1, r1), (QWEN3, qwen3)):
        split = parser.extract(text)
        assert (split.reasoning, split.content) == expected, parser.name


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    streamer = parser.streamer()
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        delta = streamer.feed(piece, final=i == len(pieces) - 1)
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=lambda p: p.name)
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_stream_split_at_every_offset_matches_extract(parser: ReasoningParser, text: str) -> None:
    split = parser.extract(text)
    expected = (split.reasoning or "", split.content or "")
    # One cut anywhere, two cuts anywhere, and one character at a time.
    for i in range(len(text) + 1):
        assert _streamed(parser, [text[:i], text[i:]]) == expected, i
        for j in range(i, len(text) + 1):
            assert _streamed(parser, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _streamed(parser, list(text) + [""]) == expected


def test_stream_never_sends_a_partial_tag() -> None:
    streamer = QWEN3.streamer()
    assert streamer.feed("Hi <th").content == "Hi "  # "<th" may be the start of <think>
    step = streamer.feed("ink>deep")
    assert (step.reasoning, step.content) == ("deep", "")
    step = streamer.feed(" </thi")
    assert step.reasoning == " "
    step = streamer.feed("nk>done")
    assert (step.reasoning, step.content) == ("", "done")


def test_regex_literal_escapes_slashes_once() -> None:
    assert regex_literal("a/b") == r"/a\/b/"
    assert regex_literal(r"a\/b") == r"/a\/b/"
    assert regex_literal("a\\\\/b") == "/a\\\\\\/b/"


# ---------------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def backend():
    from pagoda.structured_output.backend import LLGuidanceBackend
    from tests.e2e.fake_engine import load_tokenizer

    tok = load_tokenizer()
    return tok, LLGuidanceBackend(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)


def _accepts(backend, params: StructuredOutputsParams, text: str) -> bool:
    tok, be = backend
    matcher = be.matcher(be.compile(params))
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher._m.is_accepting()


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.mark.parametrize("constraint,good,bad", [
    (StructuredOutputsParams(json=SCHEMA), '{"n": 4}', '{"n": "4"}'),
    (StructuredOutputsParams(json_object=True), '{"a": [1]}', "[1]"),
    (StructuredOutputsParams(regex=r"\d+/\d+"), "3/4", "3-4"),
    (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
    (StructuredOutputsParams(grammar='start: "a" b "}"\nb: "x" | "y"'), "ay}", "az}"),
])
def test_constrain_lets_the_model_think_first(backend, constraint, good, bad) -> None:
    r1 = R1.constrain(constraint)
    assert _accepts(backend, r1, f"<think>What {{ </ think > is it?</think>\n\n{good}")
    assert _accepts(backend, r1, f"hmm, {bad}?</think>{good}")  # the template opened <think>
    assert not _accepts(backend, r1, f"<think>hmm</think>{bad}")
    assert not _accepts(backend, r1, good)  # deepseek_r1 always reasons first
    qwen3 = QWEN3.constrain(constraint)
    assert _accepts(backend, qwen3, f"<think>hmm</think>\n{good}")
    assert _accepts(backend, qwen3, good)  # thinking switched off
    assert not _accepts(backend, qwen3, f"hmm</think>{good}")
    assert not _accepts(backend, qwen3, f"<think>hmm</think>{bad}")
