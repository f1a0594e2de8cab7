"""Ollama's Go chat templates translated to Jinja (pagoda/hub/ollama_template.py), and the
choice between a GGUF's own template and an Ollama model's (tokenizer.with_chat_template)."""

from __future__ import annotations

import logging

import pytest

from pagoda.hub.gguf_file import GGUFFile
from pagoda.hub.ollama_template import OllamaTemplateError, translate_ollama_template
from pagoda.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    _compile_template,
    with_chat_template,
)
from tests.fake_stores import CHATML_LEGACY_TEMPLATE, CHATML_MESSAGES_TEMPLATE

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! {{ not a template }}"}, {"role": "user", "content": "2+2?\n"}],
]  # fmt: skip


def render(template: str, messages: list[dict]) -> str:
    return _compile_template(template).render(messages=messages, add_generation_prompt=True)


@pytest.fixture(scope="module")
def gguf_metadata(default_model_path):
    return GGUFFile(default_model_path).metadata


@pytest.mark.parametrize("go_template", [CHATML_MESSAGES_TEMPLATE, CHATML_LEGACY_TEMPLATE],
                         ids=["messages", "legacy"])  # fmt: skip
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "two-turns"])
def test_chatml_renders_as_the_gguf_template(gguf_metadata, go_template, conversation):
    """The bundled GGUF's own Jinja template is ChatML: a typical Ollama ChatML template,
    translated, must give the model the very same prompt."""
    gguf_template = gguf_metadata["tokenizer.chat_template"]
    assert render(translate_ollama_template(go_template), conversation) == render(gguf_template, conversation)


def test_legacy_last_turn_is_cut_after_the_response():
    # Ollama leaves the final assistant turn open: nothing after {{ .Response }} is rendered for it.
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert render(translate_ollama_template(CHATML_LEGACY_TEMPLATE), conversation) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel")
    with pytest.raises(ChatTemplateError, match="no place for tool messages"):
        render(translate_ollama_template(CHATML_LEGACY_TEMPLATE), [{"role": "tool", "content": "42"}])


@pytest.mark.parametrize("source,expected", [
    # Go trims every white space character, newlines too, on the marked side only.
    ("a \n {{- .System -}} \n b|{{ .System }} c", "aSYSb|SYS c"),
    ("{{ with .System }}[{{ . }}]{{ else }}none{{ end }}", "[SYS]"),
    ('{{ if eq .System "x" "SYS" }}one of{{ end }}', "one of"),
    ("{{ range .Messages }}{{ .Role }}:{{ .Content }};{{ else }}empty{{ end }}", "system:SYS;user:U;"),
    ("{{ range $m := .Messages }}{{ $m.Role }}{{ end }}/{{ index .Messages 1 | len }}", None),
    ("{{/* a comment */}}{{ len .Messages }}{{ if gt (len .Messages) 1 }}>1{{ end }}", "2>1"),
    ('{{ $x := "v" }}{{ if and $x (not .Response) }}{{ $x }}{{ end }}{{ `raw` }}', "vraw"),
    ("{{ range $i, $_ := .Messages }}{{ $i }}{{ $.System }}{{ end }}", "0SYS1SYS"),
])  # fmt: skip
def test_constructs(source, expected):
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "U"}]
    if expected is None:
        with pytest.raises(OllamaTemplateError, match="pipes"):
            translate_ollama_template(source)
        return
    assert render(translate_ollama_template(source), messages) == expected


@pytest.mark.parametrize("source,named", [
    ("{{ if .Tools }}tools{{ end }}", ".Tools"),
    ("{{ range .Messages }}{{ .ToolCalls }}{{ end }}", ".ToolCalls"),
    ("{{ json .System }}", "'json'"),
    ('{{ template "x" }}', "template"),
    ("{{ range .Messages }}{{ break }}{{ end }}", "break"),
    ("{{ $x := 1 }}{{ $x = 2 }}", "reassigning"),
    ("{{ if .System }}open", "without {{ end }}"),
    ("{{ .System", "unclosed action"),
])  # fmt: skip
def test_unsupported_constructs_are_named(source, named):
    with pytest.raises(OllamaTemplateError, match=named.replace("{", r"\{").replace(".", r"\.")):
        translate_ollama_template(source)


def test_template_choice(gguf_metadata, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.tokenizer")
    conversation = CONVERSATIONS[1]
    # A GGUF without a template of its own: the Ollama template, translated.
    bare = Tokenizer.from_gguf_metadata({k: v for k, v in gguf_metadata.items() if k != "tokenizer.chat_template"})
    assert bare.chat_template is None
    with_chat_template(bare, None, CHATML_MESSAGES_TEMPLATE)
    assert bare.apply_chat_template(conversation) == render(gguf_metadata["tokenizer.chat_template"], conversation)
    assert "the Ollama template layer, translated" in caplog.text
    # A GGUF with its own: kept (and said so), even when the Ollama one cannot be translated.
    own = Tokenizer.from_gguf_metadata(gguf_metadata)
    assert with_chat_template(own, None, "{{ .Tools }}").chat_template == gguf_metadata["tokenizer.chat_template"]
    assert any(r.levelno == logging.WARNING and ".Tools" in r.getMessage() for r in caplog.records)
    # Neither: a clear error naming the construct.
    bare.chat_template = None
    with pytest.raises(OllamaTemplateError, match=r"no chat template of its own.*\.Tools.*--chat-template"):
        with_chat_template(bare, None, "{{ .Tools }}")
    # --chat-template wins over both.
    assert with_chat_template(own, "{{ 'x' }}", CHATML_MESSAGES_TEMPLATE).chat_template == "{{ 'x' }}"
