"""Ollama's chat templates (Go text/template) translated to the Jinja templates pagoda renders.

An Ollama model's ``application/vnd.ollama.image.template`` layer is a Go template that
Ollama executes with the conversation. pagoda renders chat prompts with Jinja (the
templates GGUF files and HF folders carry), so a model whose GGUF has no Jinja template
of its own gets this translation of the Ollama one. What is supported, as Ollama runs it:

- text, and ``{{- ... -}}`` trimming (all white space, newlines included, on that side);
  comments ``{{/* ... */}}``;
- the fields ``.System``, ``.Prompt``, ``.Response``, ``.Messages`` and, on a message,
  ``.Role`` and ``.Content``; ``$`` (the root) and ``$.Field``; ``.`` for the current value;
- ``{{ if }}`` / ``{{ else if }}`` / ``{{ else }}`` / ``{{ end }}``, ``{{ with }}`` (with
  ``else``), ``{{ range PIPE }}``, ``{{ range $m := PIPE }}`` and
  ``{{ range $i, $m := PIPE }}`` (with ``else``), ``{{ $x := PIPE }}``;
- the functions ``eq`` (one value against one or more), ``ne``, ``lt``, ``le``, ``gt``,
  ``ge``, ``and``, ``or``, ``not``, ``len``, ``slice``, ``index``; parentheses; string,
  raw-string, number and ``true``/``false`` literals. So the usual idiom for the last
  message, ``{{ $last := eq (len (slice $.Messages $i)) 1 }}``, works.

Two ways of running, as Ollama decides by whether the template mentions ``.Messages``:

- with ``.Messages``: rendered once; ``.Messages`` is the conversation (system messages
  included), ``.System`` every system message's text joined by a blank line.
- without (the older ``.System`` / ``.Prompt`` / ``.Response`` templates): rendered once
  per turn, each turn a system text, a user prompt and the assistant's reply; for the
  last turn the output stops right after ``{{ .Response }}`` (Ollama cuts the template
  there), which leaves the assistant's turn open for the model. Messages of one role in a
  row are joined by a blank line; a tool message is an error (such templates have no place
  for it).

Not supported, each an ``OllamaTemplateError`` naming the construct: any other field
(``.Tools``, ``.ToolCalls``, ``.Suffix``, ``.Think``, ...), any other function (``json``,
``printf``, ``currentDate``, ...), pipes ``|``, ``define`` / ``template`` / ``block``,
``break`` / ``continue``, reassigning a variable with ``=``, ``else with``, field access on
a parenthesised expression. Ollama templates open the assistant's turn themselves, so
``add_generation_prompt`` does not change what they render.

The output holds no raw text at all (every piece of text is a string expression), so
Jinja's ``trim_blocks`` / ``lstrip_blocks``, which pagoda's environment turns on for HF
templates, cannot change a translated template's white space: Go's trimming is applied
here, once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = ["OllamaTemplateError", "translate_ollama_template"]


class OllamaTemplateError(ValueError):
    """The Ollama template uses something this translation does not support (named in the message)."""


# ---------------------------------------------------------------------- splitting text and actions
@dataclass
class _Action:
    body: str          # between the delimiters and trim markers
    position: int      # offset in the source, for messages


def _action_end(source: str, start: int) -> int:
    """The offset of the ``}}`` closing the action whose body starts at ``start`` (strings
    and comments may hold ``}}``)."""
    i = start
    while i < len(source):
        c = source[i]
        if source.startswith("/*", i):
            end = source.find("*/", i + 2)
            if end < 0:
                break
            i = end + 2
        elif c == '"':
            i += 1
            while i < len(source) and source[i] != '"':
                i += 2 if source[i] == "\\" else 1
            i += 1
        elif c == "`":
            end = source.find("`", i + 1)
            if end < 0:
                break
            i = end + 1
        elif source.startswith("}}", i):
            return i
        else:
            i += 1
    raise OllamaTemplateError(f"unclosed action at offset {start}")


def _split(source: str) -> list[str | _Action]:
    """Text pieces and actions, with Go's ``{{-`` / ``-}}`` trimming applied to the text.

    E.g. ``"a \\n{{- .X }} b"`` -> ``["a", Action(".X"), " b"]``.
    """
    parts: list[str | _Action] = []
    trim_next = False
    i = 0
    while True:
        open_at = source.find("{{", i)
        text = source[i:] if open_at < 0 else source[i:open_at]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if open_at < 0:
            parts.append(text)
            return parts
        start = open_at + 2
        if re.match(r"-[ \t\r\n]", source[start:start + 2]):
            text = text.rstrip(" \t\r\n")
            start += 2
        parts.append(text)
        end = _action_end(source, start)
        body = source[start:end]
        trim_next = bool(re.search(r"[ \t\r\n]-$", body))
        if trim_next:
            body = body[:-2]
        parts.append(_Action(body.strip(), open_at))
        i = end + 2


# ---------------------------------------------------------------------- tokens of one action
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<pipe>\|)
  | (?P<comma>,)
  | (?P<variable>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
""", re.VERBOSE)


@dataclass
class _Token:
    kind: str
    text: str


def _tokens(body: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(body):
        m = _TOKEN.match(body, i)
        if m is None:
            raise OllamaTemplateError(f"cannot read {body[i:]!r} in the action {{{{ {body} }}}}")
        kind = m.lastgroup or ""
        if kind == "field" and tokens and tokens[-1].kind == "close" and i == m.start() and body[i - 1] == ")":
            raise OllamaTemplateError(f"field access on a parenthesised expression in {{{{ {body} }}}}")
        if kind != "space":
            tokens.append(_Token(kind, m.group()))
        i = m.end()
    return tokens


# ---------------------------------------------------------------------- values and scopes
# What a value is, so that fields on it can be translated: the root (.System, .Messages,
# ...), the list of messages, one message (.Role, .Content), or anything else.
ROOT, MESSAGES, MESSAGE, VALUE = "root", "messages", "message", "value"

_ROOT_FIELDS = {"System": ("System", VALUE), "Prompt": ("Prompt", VALUE), "Response": ("Response", VALUE),
                "Messages": ("messages", MESSAGES)}
_MESSAGE_FIELDS = {"Role": "role", "Content": "content"}
_COMPARISONS = {"ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_UNSUPPORTED_KEYWORDS = ("define", "template", "block", "break", "continue")


@dataclass(frozen=True)
class _Value:
    expr: str   # a Jinja expression
    kind: str


@dataclass
class _Block:
    keyword: str                         # if | with | range
    outer_dot: _Value
    variables: dict[str, _Value] = field(default_factory=dict)


class _Translator:
    def __init__(self, legacy: bool) -> None:
        self.legacy = legacy
        self.out: list[str] = []
        self.blocks: list[_Block] = []
        self.dot = _Value("", ROOT)
        self.globals: dict[str, _Value] = {"$": _Value("", ROOT)}
        self.counter = 0
        # Legacy mode: after the first {{ .Response }}, the last turn's output stops.
        self.cut = False
        self.response_seen = False

    # ---- names ---------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"_{prefix}{self.counter}"

    def variable(self, name: str) -> _Value:
        for block in reversed(self.blocks):
            if name in block.variables:
                return block.variables[name]
        if name in self.globals:
            return self.globals[name]
        raise OllamaTemplateError(f"undefined variable {name}")

    def declare(self, name: str, value: _Value) -> None:
        (self.blocks[-1].variables if self.blocks else self.globals)[name] = value

    # ---- expressions ---------------------------------------------------------------
    def fields(self, base: _Value, names: list[str]) -> _Value:
        value = base
        for name in names:
            if value.kind == ROOT and name in _ROOT_FIELDS:
                expr, kind = _ROOT_FIELDS[name]
                if name == "Response":
                    self.response_seen = True
                value = _Value(expr, kind)
            elif value.kind == MESSAGE and name in _MESSAGE_FIELDS:
                value = _Value(f"{value.expr}.{_MESSAGE_FIELDS[name]}", VALUE)
            else:
                raise OllamaTemplateError(f"the field .{name} is not supported (pagoda translates .System, "
                                          f".Prompt, .Response, .Messages, .Role and .Content)")
        if value.kind == ROOT:
            raise OllamaTemplateError("the root value itself ('.' or '$' outside a range) cannot be printed or tested")
        return value

    def operand(self, tokens: list[_Token]) -> _Value:
        tok = tokens.pop(0)
        if tok.kind == "open":
            value = self.pipeline(tokens)
            if not tokens or tokens.pop(0).kind != "close":
                raise OllamaTemplateError("unbalanced parentheses")
            return _Value(f"({value.expr})", value.kind)
        if tok.kind == "string":
            try:
                text = json.loads(tok.text)
            except json.JSONDecodeError:
                raise OllamaTemplateError(f"unsupported escape in the string {tok.text}") from None
            return _Value(json.dumps(text, ensure_ascii=False), VALUE)
        if tok.kind == "raw":
            return _Value(json.dumps(tok.text[1:-1], ensure_ascii=False), VALUE)
        if tok.kind == "number":
            return _Value(tok.text, VALUE)
        if tok.kind == "field":
            if tok.text == ".":
                if self.dot.kind == ROOT:
                    raise OllamaTemplateError("'.' at the root cannot be printed or tested")
                return self.dot
            return self.fields(self.dot, tok.text[1:].split("."))
        if tok.kind == "variable":
            name, *names = tok.text.split(".")
            return self.fields(self.variable(name), names) if names else self.variable(name)
        if tok.kind == "name" and tok.text in ("true", "false"):
            return _Value(tok.text, VALUE)
        if tok.kind == "name":
            raise OllamaTemplateError(f"the function {tok.text!r} is not supported here (a call inside another "
                                      f"needs parentheses; supported: eq, ne, lt, le, gt, ge, and, or, not, len, "
                                      f"slice, index)")
        raise OllamaTemplateError(f"unexpected {tok.text!r}")

    def command(self, tokens: list[_Token]) -> _Value:
        if tokens and tokens[0].kind == "name" and tokens[0].text not in ("true", "false"):
            name = tokens.pop(0).text
            args: list[_Value] = []
            while tokens and tokens[0].kind not in ("close", "pipe"):
                args.append(self.operand(tokens))
            return self.call(name, args)
        value = self.operand(tokens)
        if tokens and tokens[0].kind not in ("close", "pipe"):
            raise OllamaTemplateError(f"unexpected {tokens[0].text!r} after a value")
        return value

    def pipeline(self, tokens: list[_Token]) -> _Value:
        value = self.command(tokens)
        if tokens and tokens[0].kind == "pipe":
            raise OllamaTemplateError("pipes ('|') are not supported")
        return value

    @staticmethod
    def call(name: str, args: list[_Value]) -> _Value:
        def need(low: int, high: int | None = None) -> None:
            if len(args) < low or (high is not None and len(args) > high):
                raise OllamaTemplateError(f"wrong number of arguments to {name}: {len(args)}")

        e = [a.expr for a in args]
        if name == "eq":
            need(2)
            return _Value("(" + " or ".join(f"{e[0]} == {other}" for other in e[1:]) + ")", VALUE)
        if name in _COMPARISONS:
            need(2, 2)
            return _Value(f"({e[0]} {_COMPARISONS[name]} {e[1]})", VALUE)
        if name in ("and", "or"):
            need(1)
            return _Value("(" + f" {name} ".join(e) + ")", VALUE)
        if name == "not":
            need(1, 1)
            return _Value(f"(not {e[0]})", VALUE)
        if name == "len":
            need(1, 1)
            return _Value(f"({e[0]} | length)", VALUE)
        if name == "slice":
            need(1, 3)
            bounds = ":".join(e[1:]) if len(e) == 3 else (f"{e[1]}:" if len(e) == 2 else ":")
            return _Value(f"{e[0]}[{bounds}]", args[0].kind)
        if name == "index":
            need(2, 2)
            return _Value(f"{e[0]}[{e[1]}]", MESSAGE if args[0].kind == MESSAGES else VALUE)
        raise OllamaTemplateError(f"the function {name!r} is not supported (supported: eq, ne, lt, le, gt, ge, "
                                  f"and, or, not, len, slice, index)")

    def expression(self, tokens: list[_Token], body: str) -> _Value:
        value = self.pipeline(tokens)
        if tokens:
            raise OllamaTemplateError(f"unexpected {tokens[0].text!r} in {{{{ {body} }}}}")
        return value

    # ---- output --------------------------------------------------------------------
    def emit_output(self, expr: str) -> None:
        # In legacy mode everything after the first {{ .Response }} is left out of the last turn.
        text = "{{ " + expr + " }}"
        self.out.append("{% if not _final %}" + text + "{% endif %}" if self.cut else text)

    def text(self, text: str) -> None:
        if text:
            self.emit_output(json.dumps(text, ensure_ascii=False))

    # ---- actions -------------------------------------------------------------------
    def action(self, action: _Action) -> None:
        body = action.body
        if body.startswith("/*"):
            if not body.endswith("*/"):
                raise OllamaTemplateError(f"a comment must fill its action: {{{{ {body} }}}}")
            return
        tokens = _tokens(body)
        if not tokens:
            raise OllamaTemplateError(f"empty action at offset {action.position}")
        head = tokens[0]
        if head.kind == "name" and head.text in _UNSUPPORTED_KEYWORDS:
            raise OllamaTemplateError(f"{{{{ {head.text} }}}} is not supported")
        if head.kind == "name" and head.text in ("if", "with", "range", "else", "end"):
            getattr(self, f"on_{head.text}")(tokens[1:], body)
            return
        if head.kind == "variable" and len(tokens) > 1 and tokens[1].kind in ("declare", "assign"):
            if tokens[1].kind == "assign":
                raise OllamaTemplateError(f"reassigning a variable ({head.text} = ...) is not supported")
            value = self.expression(tokens[2:], body)
            name = self.fresh("v")
            self.out.append(f"{{% set {name} = {value.expr} %}}")
            self.declare(head.text, _Value(name, value.kind))
            return
        self.response_seen = False
        value = self.expression(tokens, body)
        self.emit_output(value.expr)
        if self.legacy and self.response_seen:
            self.cut = True

    def open_block(self, keyword: str) -> _Block:
        block = _Block(keyword, self.dot)
        self.blocks.append(block)
        return block

    def on_if(self, tokens: list[_Token], body: str) -> None:
        value = self.expression(tokens, body)
        self.open_block("if")
        self.out.append(f"{{% if {value.expr} %}}")

    def on_with(self, tokens: list[_Token], body: str) -> None:
        declared = None
        if len(tokens) > 1 and tokens[0].kind == "variable" and tokens[1].kind == "declare":
            declared, tokens = tokens[0].text, tokens[2:]
        value = self.expression(tokens, body)
        self.open_block("with")
        name = self.fresh("w")
        self.out.append(f"{{% set {name} = {value.expr} %}}{{% if {name} %}}")
        self.dot = _Value(name, value.kind)
        if declared:
            self.declare(declared, self.dot)

    def on_range(self, tokens: list[_Token], body: str) -> None:
        names: list[str] = []
        if any(t.kind == "declare" for t in tokens):
            while tokens[0].kind != "declare":
                tok = tokens.pop(0)
                if tok.kind == "variable" and "." not in tok.text:
                    names.append(tok.text)
                elif tok.kind != "comma":
                    raise OllamaTemplateError(f"unexpected {tok.text!r} in {{{{ {body} }}}}")
            tokens.pop(0)
            if not 1 <= len(names) <= 2:
                raise OllamaTemplateError(f"a range declares one or two variables: {{{{ {body} }}}}")
        value = self.expression(tokens, body)
        element = _Value(self.fresh("e"), MESSAGE if value.kind == MESSAGES else VALUE)
        block = self.open_block("range")
        self.out.append(f"{{% for {element.expr} in {value.expr} %}}")
        if len(names) == 2:
            index = self.fresh("i")
            self.out.append(f"{{% set {index} = loop.index0 %}}")
            block.variables[names[0]] = _Value(index, VALUE)
        if names:
            block.variables[names[-1]] = element
        self.dot = element

    def on_else(self, tokens: list[_Token], body: str) -> None:
        if not self.blocks:
            raise OllamaTemplateError("{{ else }} outside if, with or range")
        block = self.blocks[-1]
        block.variables.clear()
        self.dot = block.outer_dot
        if not tokens:
            self.out.append("{% else %}")
            return
        if tokens[0].kind == "name" and tokens[0].text == "if" and block.keyword == "if":
            value = self.expression(tokens[1:], body)
            self.out.append(f"{{% elif {value.expr} %}}")
            return
        raise OllamaTemplateError(f"{{{{ {body} }}}} is not supported (only else and else if in an if)")

    def on_end(self, tokens: list[_Token], body: str) -> None:
        if tokens:
            raise OllamaTemplateError(f"unexpected {tokens[0].text!r} in {{{{ {body} }}}}")
        if not self.blocks:
            raise OllamaTemplateError("{{ end }} without if, with or range")
        block = self.blocks.pop()
        self.dot = block.outer_dot
        self.out.append("{% endfor %}" if block.keyword == "range" else "{% endif %}")

    def translate(self, source: str) -> str:
        for part in _split(source):
            if isinstance(part, str):
                self.text(part)
            else:
                self.action(part)
        if self.blocks:
            raise OllamaTemplateError(f"{{{{ {self.blocks[-1].keyword} }}}} without {{{{ end }}}}")
        return "".join(self.out)


# ---------------------------------------------------------------------- the two ways of running
_MESSAGES_PREAMBLE = (
    '{% set System = messages | selectattr("role", "equalto", "system") | map(attribute="content") '
    '| join("\\n\\n") %}{% set Prompt = "" %}{% set Response = "" %}{% set _final = false %}'
)

# Turns: a system text, a user prompt, the assistant's reply; _turn renders one.
_LEGACY_LOOP = (
    '{% set _t = namespace(system="", prompt="", response="") %}'
    "{% for _m in messages %}"
    '{% set _text = _m.content if _m.content is string else "" %}'
    '{% if _m.role == "system" %}'
    "{% if _t.prompt or _t.response %}{{ _turn(_t.system, _t.prompt, _t.response, false) }}"
    '{% set _t.system = "" %}{% set _t.prompt = "" %}{% set _t.response = "" %}{% endif %}'
    '{% set _t.system = _t.system ~ "\\n\\n" ~ _text if _t.system else _text %}'
    '{% elif _m.role == "user" %}'
    "{% if _t.response %}{{ _turn(_t.system, _t.prompt, _t.response, false) }}"
    '{% set _t.system = "" %}{% set _t.prompt = "" %}{% set _t.response = "" %}{% endif %}'
    '{% set _t.prompt = _t.prompt ~ "\\n\\n" ~ _text if _t.prompt else _text %}'
    '{% elif _m.role == "assistant" %}'
    '{% set _t.response = _t.response ~ "\\n\\n" ~ _text if _t.response else _text %}'
    "{% else %}"
    '{{ raise_exception("this model\'s Ollama template has no place for " ~ _m.role ~ " messages") }}'
    "{% endif %}"
    "{% endfor %}"
    "{{ _turn(_t.system, _t.prompt, _t.response, true) }}"
)


def uses_messages(source: str) -> bool:
    """Whether Ollama runs this template once over .Messages (else once per turn)."""
    return re.search(r"\.Messages\b", source) is not None


def translate_ollama_template(source: str) -> str:
    """The Jinja template rendering what Ollama's Go template ``source`` renders for a
    conversation (see the module docstring); OllamaTemplateError for what it cannot."""
    if uses_messages(source):
        return _MESSAGES_PREAMBLE + _Translator(legacy=False).translate(source)
    body = _Translator(legacy=True).translate(source)
    return "{% macro _turn(System, Prompt, Response, _final) %}" + body + "{% endmacro %}" + _LEGACY_LOOP
