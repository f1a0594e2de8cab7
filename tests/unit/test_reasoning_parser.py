"""Reasoning parsers: the split of a finished text, the same split from a stream cut at every
offset, and the grammar that lets a constrained request think first. The cases are written in
``<think>`` tags and run for every parser, its own tags put in."""

from __future__ import annotations

import pytest

from pagoda.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningSplit,
    count_reasoning_tokens,
    get_reasoning_parser,
)
from pagoda.reasoning.grammar import regex_literal
from pagoda.sampling_params import StructuredOutputsParams

R1 = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")

# The parsers that read as deepseek_r1 does (the template opened the reasoning) and as qwen3 does
# (the model opens it), by their tags. An answer wrapper changes nothing where the content does
# not open with it, as in CASES and SECTIONS.
OPENED = ["deepseek_r1", "glm47", "minimax_m2", "ernie45"]
EXPLICIT = ["qwen3", "glm45", "mistral", "seed_oss", "hunyuan_a13b", "granite"]
SPLITTING = OPENED + EXPLICIT   # (minimax_m2_append_think splits nothing: its own test)


def tags(parser: ReasoningParser) -> tuple[str, str]:
    return parser.start_tags[0], parser.end_tags[0]  # type: ignore[attr-defined]


def translate(parser: ReasoningParser, text: str | None) -> str | None:
    """``text`` written in ``parser``'s tags instead of <think> and </think>."""
    start, end = tags(parser)
    return None if text is None else text.replace("</think>", "\0").replace("<think>", start).replace("\0", end)


def as_written(name: str, text: str, r1: tuple, qwen3: tuple) -> tuple[ReasoningParser, str, tuple]:
    parser = get_reasoning_parser(name)
    expected = r1 if name in OPENED else qwen3
    return parser, translate(parser, text), tuple(translate(parser, x) if isinstance(x, str) else x for x in expected)

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


@pytest.mark.parametrize("name", SPLITTING)
@pytest.mark.parametrize("text,r1,qwen3", SECTIONS)
def test_where_the_reasoning_ends(name: str, text: str, r1: tuple[bool, int | None],
                                  qwen3: tuple[bool, int | None]) -> None:  # fmt: skip
    parser = get_reasoning_parser(name)
    open_, end = r1 if name in OPENED else qwen3
    written = translate(parser, text)
    if end is not None:   # the same place, in this parser's tags
        end = len(translate(parser, text[:end]))
    assert (parser.in_reasoning(written), parser.reasoning_end(written)) == (open_, end)
    if end is not None:
        assert written[:end].endswith(tags(parser)[1])
        assert parser.extract(written[:end]).reasoning == parser.extract(written).reasoning


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

    for name in ("deepseek_r1", "glm47", "minimax_m2", "minimax_m2_append_think", "ernie45"):
        assert count_reasoning_tokens(get_reasoning_parser(name), ids, decode) == r1, name
    for name in ("qwen3", "glm45", "hunyuan_a13b"):
        assert count_reasoning_tokens(get_reasoning_parser(name), ids, decode) == qwen3, name


def test_registry_and_unknown_name() -> None:
    # (openai_gptoss, Harmony's: tests/unit/test_harmony.py)
    assert set(REASONING_PARSERS) == {*SPLITTING, "minimax_m2_append_think", "openai_gptoss"}
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("name", SPLITTING)
@pytest.mark.parametrize("text,r1,qwen3", CASES)
def test_extract(name: str, text: str, r1: tuple[str | None, str | None], qwen3: tuple[str | None, str | None]) -> None:
    parser, written, expected = as_written(name, text, r1, qwen3)
    split = parser.extract(written)
    assert (split.reasoning, split.content) == expected


# (parser, text, (reasoning, content)): the answer wrappers, Granite's other spelling, a stray tag.
WRAPPED = [
    ("ernie45", "Hm.\n</think>\n\n<response>\nIt is 4.\n</response>\n", ("Hm.\n", "It is 4.")),
    ("ernie45", "Hm.</think>\nIt is 4.\n", ("Hm.", "\nIt is 4.\n")),   # the answer bare
    ("ernie45", "Hm.</think><response>It is 4.", ("Hm.", "It is 4.")),    # cut short inside the answer
    ("ernie45", "Hm.</think>See <response>x</response>", ("Hm.", "See <response>x</response>")),
    ("hunyuan_a13b", "<think>\nHm.\n</think>\n<answer>\nIt is 4.\n</answer>", ("\nHm.\n", "It is 4.")),
    ("hunyuan_a13b", "<think>\n\n</think>\n<answer>\n\n</answer>", ("\n\n", None)),
    ("hunyuan_a13b", "<answer>4</answer> and </answer>", (None, "4</answer> and")),
    ("granite", "Here's my thought process:\nHm.\n\nHere's my response:\nIt is 4.", ("\nHm.\n\n", "\nIt is 4.")),
    ("granite", "Here is my thought process: a\nHere's my response: b", (" a\n", " b")),
    ("mistral", "[THINK]Hm.[/THINK]It is 4.", ("Hm.", "It is 4.")),
    ("mistral", "<think>Hm.</think>It is 4.", (None, "<think>Hm.</think>It is 4.")),   # not Magistral's tags
    ("seed_oss", "<seed:think>Hm.</seed:think>\nIt is 4.", ("Hm.", "\nIt is 4.")),
    ("glm45", "\n<think>Hm.</think>\nIt is 4.", ("Hm.", "\n\nIt is 4.")),
]


@pytest.mark.parametrize("name,text,expected", WRAPPED)
def test_extract_family_formats(name: str, text: str, expected: tuple[str | None, str | None]) -> None:
    split = get_reasoning_parser(name).extract(text)
    assert (split.reasoning, split.content) == expected
    _check_every_offset(get_reasoning_parser(name), text)


def test_append_think_returns_everything_as_content() -> None:
    parser = get_reasoning_parser("minimax_m2_append_think")
    text = "Let me see.\n</think>\n\nIt is 4."
    assert parser.extract(text) == ReasoningSplit(reasoning=None, content="<think>" + text)
    for i in range(len(text) + 1):
        assert _streamed(parser, ["", text[:i], text[i:]]) == ("", "<think>" + text)
    # What the budget and the token count read is still where the reasoning ends.
    assert parser.in_reasoning("Let me") and parser.reasoning_end(text) == len("Let me see.\n</think>")


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    streamer = parser.streamer()
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        delta = streamer.feed(piece, final=i == len(pieces) - 1)
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


@pytest.mark.parametrize("name", SPLITTING)
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_stream_split_at_every_offset_matches_extract(name: str, text: str) -> None:
    parser = get_reasoning_parser(name)
    _check_every_offset(parser, translate(parser, text))


def _check_every_offset(parser: ReasoningParser, text: str) -> None:
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


@pytest.mark.parametrize("name", SPLITTING)
def test_stream_holds_back_a_partial_tag(name: str) -> None:
    parser = get_reasoning_parser(name)
    start, end = tags(parser)
    streamer = parser.streamer()
    if name in OPENED:
        assert streamer.feed("hm," + end[:-1]).reasoning == "hm,"   # the end tag may be coming
        assert streamer.feed(end[-1] + "4").content == "4"
        return
    assert streamer.feed("Hi," + start[:-1]).content == "Hi,"   # the start tag may be coming
    step = streamer.feed(start[-1:] + "deep." + end[:3])
    assert (step.reasoning, step.content) == ("deep.", "")
    step = streamer.feed(end[3:] + "done")
    assert (step.reasoning, step.content) == ("", "done")


@pytest.mark.parametrize("name,opening,closing", [("ernie45", "<response>", "</response>"),
                                                  ("hunyuan_a13b", "<answer>", "</answer>")])
def test_stream_holds_back_what_the_answer_wrapper_may_take(name: str, opening: str, closing: str) -> None:
    streamer = get_reasoning_parser(name).streamer()
    thinking = "" if name == "ernie45" else "<think>"
    assert streamer.feed(f"{thinking}hm</think>\n{opening[:4]}").reasoning == "hm"
    assert streamer.feed(opening[4:] + "\n").content == ""   # the wrapper and its whitespace go
    assert streamer.feed("It is 4.\n" + closing[:3]).content == "It is 4."
    assert streamer.feed(closing[3:] + "\n").content == ""
    assert streamer.feed("", final=True).content == ""   # the wrapper closed at the end: gone
    streamer = get_reasoning_parser(name).streamer()
    streamer.feed(f"{thinking}hm</think>{opening}It is 4.\n{closing}")
    assert streamer.feed(" more", final=True).content == f"\n{closing} more"   # not at the end: kept


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


@pytest.mark.parametrize("name", SPLITTING)
def test_each_parsers_grammar_and_budget_close_its_own_tags(backend, name: str) -> None:
    parser = get_reasoning_parser(name)
    start, end = tags(parser)
    constraint = StructuredOutputsParams(json=SCHEMA)
    good, bad = '{"n": 4}', '{"n": "4"}'
    grammar = parser.constrain(constraint)
    thought = f"{start}What is {{ it?{end}\n\n"
    assert _accepts(backend, grammar, thought + good)
    assert not _accepts(backend, grammar, thought + bad)
    if name in OPENED:
        assert _accepts(backend, grammar, f"hmm{end}{good}")
        assert not _accepts(backend, grammar, good)
    else:
        assert _accepts(backend, grammar, good)
        assert not _accepts(backend, grammar, f"hmm{end}{good}")
    if parser.answer_tags:  # type: ignore[attr-defined]
        opening, closing = parser.answer_tags  # type: ignore[attr-defined]
        wrapped = f"{thought}{opening}\n{good}\n{closing}"
        assert _accepts(backend, grammar, wrapped)
        assert parser.extract(wrapped).content == good
    # A thinking budget spent: the reasoning so far, then end_of_reasoning, reads as closed, and the
    # grammar goes on to the answer after it.
    cut = ("" if name in OPENED else start) + "Let me think about"
    assert parser.in_reasoning(cut)
    closed = cut + parser.end_of_reasoning
    assert not parser.in_reasoning(closed) and parser.reasoning_end(closed) is not None
    assert parser.extract(closed + good).content.strip() == good
    assert parser.extract(closed + good).reasoning.strip() == "Let me think about"
    answer = closed + good
    wrapper = parser.answer_tags  # type: ignore[attr-defined]
    if wrapper and wrapper[0] in parser.end_of_reasoning:   # (Hunyuan's opens its wrapper: the model closes it)
        answer += "\n" + wrapper[1]
    assert _accepts(backend, grammar, answer)
