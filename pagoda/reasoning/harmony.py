"""OpenAI's Harmony format, in which GPT-OSS reads its conversations and writes its answers:
rendering chat messages into a prompt, and reading the messages out of what the model wrote.

A message is ``<|start|>{header}<|message|>{content}<|end|>``. The header is the author
(``system``, ``developer``, ``user``, ``assistant``, or a tool's name such as
``functions.get_weather``), then in any order a recipient (`` to=functions.get_weather``), a
channel (``<|channel|>analysis``) and a content type (`` json`` or `` <|constrain|>json``).
GPT-OSS writes on three channels: ``analysis`` (its reasoning), ``commentary`` (tool calls, and
preambles: text for the user before calls) and ``final`` (the answer). A message with a
recipient is a tool call; its content is the call's arguments. ``<|return|>`` (after the final
answer) and ``<|call|>`` (after a call) end a message and the generation: they are stop tokens,
so they are not in the decoded text of an output, and ``<|end|>`` separates the messages
within one. All seven markers are special tokens of GPT-OSS's vocabulary (o200k_harmony).

The prompt (``render_prompt``), as the Harmony specification and the model's chat template write
it: a system message (model identity, knowledge cutoff, current date, ``Reasoning: low|medium|
high``, the valid channels, and with function tools the note that calls go to ``commentary``),
then a developer message with the instructions (the leading system / developer messages of the
chat) and the function tools as a TypeScript-like ``namespace functions { ... }``, then the
conversation, then ``<|start|>assistant`` for the model to write in::

    <|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
    Knowledge cutoff: 2024-06
    Current date: 2025-06-28

    Reasoning: medium

    # Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
    <|start|>developer<|message|># Instructions

    Be brief.<|end|><|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant

(without the line breaks after ``<|end|>``). An assistant message becomes up to three kinds of
Harmony messages: its reasoning (``reasoning_content``, ``reasoning`` or ``thinking``) on
``analysis``, its content on ``final`` (or, beside tool calls, on ``commentary`` as a preamble),
and each call as ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>
{arguments}<|call|>``. A tool result is ``<|start|>functions.NAME to=assistant<|channel|>
commentary<|message|>{content}<|end|>``, the name found from its ``tool_call_id``. Reasoning is
dropped before the last final answer: earlier turns keep only their answers, while the reasoning
of the turn being continued (before its tool calls and their results) stays, as GPT-OSS expects.
(These are vLLM's choices too; the model's own chat template differs in two details that do not
matter to the model's reading: it JSON-quotes tool results and writes a call's content as
analysis.)

Reading an output (``parse``, ``HarmonyStreamParser``): the prompt ended with
``<|start|>assistant``, so the first message starts at its header; later ones with ``<|start|>``.
A header is read only when it is one (at most 512 characters on one line: an optional
``assistant`` role, channels, a recipient, one content type after them); a message whose header
is not one (plain text where a header should be, another author) is malformed and kept as the
text it is (``well_formed=False``), up to the next marker that ends a message. A header that the
text ends inside is left out (it was markup, cut short). Whitespace between messages is skipped.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends a message's content: its terminators, or the start of the next message (a malformed output).
_CONTENT_ENDS = (END, CALL, RETURN, START)
EFFORTS = ("low", "medium", "high")
DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
_CHANNELS_NOTE = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
_FUNCTIONS_NOTE = "Calls to these tools must go to the commentary channel: 'functions'."
# Recipients of the tools GPT-OSS was trained with (browser.search, python, container.exec, ...): a call
# named so, of no function tool of the request, goes back into the prompt as that tool's, not as a function.
_BUILTIN_NAMESPACES = ("browser.", "container.")
_MAX_HEADER = 512
_NOBODY = ("assistant", "all")   # recipients that address no tool (a stray "to=assistant" the model writes)


def is_harmony(tokenizer: Any) -> bool:
    """Whether the model speaks Harmony: its chat template writes ``<|channel|>``, or its
    vocabulary is GPT-OSS's (its Harmony markers are special tokens), whatever template it has."""
    if tokenizer is None:
        return False
    if CHANNEL in (tokenizer.chat_template or ""):
        return True
    ids = [tokenizer.token_to_id(marker) for marker in (START, MESSAGE, CHANNEL, CALL)]
    return all(i is not None and i in tokenizer.all_special_ids for i in ids)


# ====================================================================== the prompt
class HarmonyRenderError(ValueError):
    """Messages the Harmony format cannot hold (the message says which and why)."""


@dataclass
class _Prompted:
    """One Harmony message of a prompt; ``source``: the chat message it comes from."""

    author: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    source: int = -1
    reasoning: bool = False

    def render(self) -> str:
        header = self.author
        if self.recipient:
            header += f" to={self.recipient}"
        if self.channel:
            header += CHANNEL + self.channel
        if self.content_type:
            header += f" {self.content_type}"
        end = CALL if self.author == "assistant" and self.recipient else END
        return f"{START}{header}{MESSAGE}{self.content}{end}"


def render_prompt(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                  reasoning_effort: str = "medium", instructions: str | None = None,
                  model_identity: str = DEFAULT_MODEL_IDENTITY, today: str | None = None,
                  add_generation_prompt: bool = True) -> str:  # fmt: skip
    """The prompt for OpenAI chat ``messages`` (system, developer, user, assistant and tool
    messages) and function ``tools`` (OpenAI tool objects); ``instructions`` go before those of
    the leading system messages. ``today``: the current date (YYYY-MM-DD; None: today's).
    ``add_generation_prompt``: end with ``<|start|>assistant`` (else the last assistant message,
    reasoning included, is the end). HarmonyRenderError for what cannot be rendered."""
    if reasoning_effort not in EFFORTS:
        raise HarmonyRenderError(f"reasoning effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}")
    functions = [t.get("function") or {} for t in tools or []]
    names = {f.get("name") for f in functions}
    lead, turns = _conversation(messages, names)
    # The message a prompt without a generation prompt ends on is continued: its reasoning stays.
    continued = len(messages) - 1 if not add_generation_prompt and messages and \
        messages[-1].get("role") == "assistant" else None  # fmt: skip
    finals = [i for i, t in enumerate(turns) if t.channel == "final" and t.source != continued]
    if finals:
        turns = [t for i, t in enumerate(turns) if not (t.reasoning and i < finals[-1])]
    system = (f"{model_identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\n"
              f"Current date: {today or datetime.date.today().isoformat()}\n\n"
              f"Reasoning: {reasoning_effort}\n\n{_CHANNELS_NOTE}")  # fmt: skip
    if functions:
        system += "\n" + _FUNCTIONS_NOTE
    parts = [_Prompted("system", system).render()]
    sections = [s for s in ([instructions] if instructions else []) + lead if s]
    developer = ["# Instructions", "\n\n".join(sections)] if sections else []
    if functions:
        developer.append("# Tools\n\n" + render_functions(functions))
    if developer:
        parts.append(_Prompted("developer", "\n\n".join(developer)).render())
    parts += [t.render() for t in turns]
    if add_generation_prompt:
        parts.append(START + "assistant")
    return "".join(parts)


def _conversation(messages: Sequence[Mapping[str, Any]], function_names: set[Any]) -> tuple[list[str], list[_Prompted]]:
    """(the instructions of the leading system / developer messages, the Harmony messages of the rest)."""
    lead: list[str] = []
    turns: list[_Prompted] = []
    call_names: dict[str, str] = {}   # tool_call_id -> the function it called
    last_call: str | None = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            text = _text(m.get("content"), i)
            if not turns:
                lead.append(text)
            else:   # a system message in the middle of the conversation: a developer message of its own there
                turns.append(_Prompted("developer", f"# Instructions\n\n{text}", source=i))
        elif role == "user":
            turns.append(_Prompted("user", _text(m.get("content"), i), source=i))
        elif role == "assistant":
            reasoning = next((m[k] for k in ("reasoning_content", "reasoning", "thinking") if m.get(k)), None)
            if reasoning is not None:
                turns.append(_Prompted("assistant", _text(reasoning, i), "analysis", source=i, reasoning=True))
            content = _text(m.get("content"), i)
            calls = m.get("tool_calls") or []
            if content:
                turns.append(_Prompted("assistant", content, "commentary" if calls else "final", source=i))
            for call in calls:
                name, arguments = _call(call, i)
                if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                    call_names[call["id"]] = name
                last_call = name
                recipient, channel, content_type = _call_header(name, function_names)
                turns.append(_Prompted("assistant", arguments, channel, recipient, content_type, source=i))
        elif role == "tool":
            name = call_names.get(m.get("tool_call_id")) or m.get("name") or last_call
            if not isinstance(name, str):
                raise HarmonyRenderError(f"messages[{i}]: a tool message must follow an assistant message "
                                         "with the tool_calls it answers")  # fmt: skip
            author, channel, _ = _call_header(name, function_names)
            turns.append(_Prompted(author or name, _text(m.get("content"), i), channel, "assistant", source=i))
        else:
            raise HarmonyRenderError(f"messages[{i}]: role {role!r} has no place in the Harmony format "
                                     "(system, developer, user, assistant and tool do)")  # fmt: skip
    return lead, turns


def _call_header(name: str, function_names: set[Any]) -> tuple[str, str, str]:
    """(recipient, channel, content type) of a call: a function's, or a built-in tool's (on analysis)."""
    if name not in function_names and (name == "python" or name.startswith(_BUILTIN_NAMESPACES)):
        return name, "analysis", "code" if name == "python" else "json"
    return f"functions.{name}", "commentary", "json"


def _call(call: Any, index: int) -> tuple[str, str]:
    """An OpenAI tool call's (name, arguments text): arguments are written as the client sent them
    (the JSON text the model wrote, typically), an object as its JSON."""
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise HarmonyRenderError(f"messages[{index}]: each tool call needs a function name")
    arguments = function.get("arguments")  # type: ignore[union-attr]
    if arguments is None or arguments == "":
        return name, "{}"
    return name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _text(content: Any, index: int) -> str:
    """A message's text: a string, or its text parts joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise HarmonyRenderError(f"messages[{index}]: GPT-OSS reads text only, not {kind!r} content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise HarmonyRenderError(f"messages[{index}]: content must be text")


# ---------------------------------------------------------------------- function tools
def render_functions(functions: Sequence[Mapping[str, Any]]) -> str:
    """The ``## functions`` section: each function as a TypeScript type, its description (one
    comment line per line) above it; ``() => any`` for a function without parameters."""
    out = "## functions\n\nnamespace functions {\n\n"
    for f in functions:
        description = f.get("description")
        if isinstance(description, str):
            out += "".join(f"// {line}\n" for line in description.splitlines())
        parameters = f.get("parameters")
        if isinstance(parameters, Mapping) and parameters.get("properties"):
            out += f"type {f.get('name')} = (_: {_ts(parameters, '')}) => any;\n\n"
        else:
            out += f"type {f.get('name')} = () => any;\n\n"
    return out + "} // namespace functions"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_enum(schema: Mapping[str, Any]) -> bool:
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum)


def _default(schema: Mapping[str, Any], quote_enum: bool = False) -> str | None:
    """``default: ...`` for a schema with a default: a string quoted (unless it is one of an
    enum's values, which are quoted in the type already), anything else as compact JSON."""
    if "default" not in schema:
        return None
    value = schema["default"]
    if isinstance(value, str):
        return f'default: "{value}"' if quote_enum or not _is_enum(schema) else f"default: {value}"
    return f"default: {_json(value)}"


def _nullable(schema: Mapping[str, Any], rendered: str) -> str:
    return f"{rendered} | null" if schema.get("nullable") is True and "null" not in rendered else rendered


def _ts(schema: Any, indent: str) -> str:
    """A JSON schema as the TypeScript-like type the Harmony renderer writes (OpenAI's
    reference renderer's rules: objects as ``{ key?: type, }`` with descriptions, titles and
    examples as comments above each key and defaults after it, ``oneOf`` as ``| a | b``
    alternatives, enums as unions of string literals, integers as ``number``)."""
    if not isinstance(schema, Mapping):
        return "any"
    variants = schema.get("oneOf")
    if isinstance(variants, list):
        out = ""
        for variant in variants:
            variant = variant if isinstance(variant, Mapping) else {}
            out += f"\n{indent} | " + _nullable(variant, _ts(variant, indent + "   "))
            notes = [variant["description"]] if isinstance(variant.get("description"), str) else []
            notes += [d] if (d := _default(variant, quote_enum=True)) else []
            out += f" // {' '.join(notes)}" if notes else ""
        return out
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        return " | ".join(names) if names else "any"
    if kind == "object":
        return _ts_object(schema, indent)
    if kind == "string":
        values = [v for v in schema.get("enum") or [] if isinstance(v, str)] if _is_enum(schema) else []
        return " | ".join(f'"{v}"' for v in values) if values else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{_ts(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _ts_object(schema: Mapping[str, Any], indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    properties = schema.get("properties")
    required = set(schema.get("required") or [])
    for key, prop in (properties.items() if isinstance(properties, Mapping) else ()):
        prop = prop if isinstance(prop, Mapping) else {}
        optional = "" if key in required else "?"
        if isinstance(prop.get("title"), str):
            out += f"{indent}// {prop['title']}\n{indent}//\n"
        variants = prop.get("oneOf")
        description = prop.get("description") if isinstance(prop.get("description"), str) else None
        if description is not None and not isinstance(variants, list):
            out += f"{indent}// {description}\n"
        examples = prop.get("examples")
        if isinstance(examples, list) and examples:
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
        if isinstance(variants, list):
            out += _ts_alternatives(key + optional, prop, variants, description, indent)
            continue
        out += f"{indent}{key}{optional}: {_nullable(prop, _ts(prop, indent + '    '))},"
        out += f" // {d}" if (d := _default(prop)) else ""
        out += "\n"
    return out + f"{indent}}}"


def _ts_alternatives(key: str, prop: Mapping[str, Any], variants: list[Any], description: str | None,
                     indent: str) -> str:  # fmt: skip
    """A property whose schema is a ``oneOf``: its description and default above it (the
    description left to the first alternative when that one has the same), one line per
    alternative with its own description and default."""
    first = variants[0] if variants and isinstance(variants[0], Mapping) else {}
    above = description is not None and first.get("description") != description
    out = f"{indent}// {description}\n" if above else ""
    out += f"{indent}// {d}\n" if (d := _default(prop)) else ""
    out += f"{indent}{key}:\n"
    for i, variant in enumerate(variants):
        variant = variant if isinstance(variant, Mapping) else {}
        out += f"{indent} | " + _nullable(variant, _ts(variant, indent + "   "))
        own = variant.get("description")
        notes = [own] if isinstance(own, str) and not (i == 0 and above) and own != description else []
        notes += [d] if (d := _default(variant)) else []
        out += (f" // {' '.join(notes)}" if notes else "") + "\n"
    return out + f"{indent},\n"


# ====================================================================== reading an output
@dataclass(frozen=True)
class HarmonyHeader:
    channel: str | None = None
    recipient: str | None = None       # a tool (functions.NAME, python, browser.search...): the message is a call
    content_type: str | None = None    # "json" (from " json" or " <|constrain|>json"), "code"...


@dataclass
class HarmonyMessage:
    """A message of an output. ``well_formed=False``: no header could be read, and ``content``
    is the text as written. ``complete``: ended by a marker, or the last message of an output
    that ended at a stop token (not cut short)."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    content: str
    complete: bool = True
    well_formed: bool = True
    closed: bool = field(default=False, compare=False)   # ended by a marker (<|end|>, or the next <|start|>)
    end: int = field(default=0, compare=False)           # where it ends in the text, its terminator included

    @property
    def is_call(self) -> bool:
        return self.well_formed and self.recipient is not None

    @property
    def is_reasoning(self) -> bool:
        return self.well_formed and self.recipient is None and self.channel == "analysis"


def _header_items(header: str) -> list[tuple[str, str, bool]] | None:
    """A header's items, each (kind, value, ended): ``channel`` and ``constrain`` (the name after
    the marker), ``word`` (space-separated text). None: a character no header has."""
    items: list[tuple[str, str, bool]] = []
    i, n = 0, len(header)
    while i < n:
        if header[i] == " ":
            i += 1
            continue
        kind = "word"
        for marker, name in ((CHANNEL, "channel"), (CONSTRAIN, "constrain")):
            if header.startswith(marker, i):
                kind, i = name, i + len(marker)
                break
        else:
            if header.startswith("<|", i) or header[i] in "\r\n\t":
                return None
        j = i
        while j < n and header[j] not in " \r\n\t" and not header.startswith("<|", j):
            j += 1
        items.append((kind, header[i:j], j < n))
        i = j
    return items


def _read_header(header: str, partial: bool = False) -> HarmonyHeader | None:
    """The header ``header`` is (None: not one). ``partial``: whether it is the beginning of one
    (what is read so far is then returned, or None when no continuation could make it one)."""
    items = _header_items(header) if len(header) <= _MAX_HEADER else None
    if items is None:
        return None
    channel = recipient = content_type = None
    anchored = False   # a channel or recipient came: a bare word is the content type
    for k, (kind, value, ended) in enumerate(items):
        growing = partial and k == len(items) - 1 and not ended   # the last item, which may grow
        if kind == "channel" or kind == "constrain":
            if not value and not growing:
                return None
            if kind == "channel":
                channel, anchored = value, True
            elif content_type is not None:
                return None
            else:
                content_type = value
        elif value.startswith("to="):
            if len(value) == 3 and not growing:
                return None
            recipient, anchored = value[3:], True
        elif growing and ("to=".startswith(value) or (k == 0 and "assistant".startswith(value))):
            pass
        elif k == 0 and value == "assistant":
            pass
        elif anchored and content_type is None and all(c.isalnum() or c in "_.+-/" for c in value):
            content_type = value
        else:
            return None
    return HarmonyHeader(channel, None if recipient in _NOBODY else recipient, content_type)


def find_first(text: str, markers: tuple[str, ...], start: int) -> tuple[int, str]:
    """Where the first of ``markers`` occurs in ``text`` at or after ``start`` (-1: none), and which."""
    found = [(at, m) for m in markers if (at := text.find(m, start)) >= 0]
    return min(found) if found else (-1, "")


def partial_marker(text: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of a marker: it may
    become one with the next piece. E.g. "so <|en" -> 4."""
    for k in range(min(len(CONSTRAIN) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(len(m) > k and m.startswith(tail) for m in MARKERS):
            return k
    return 0


def _scan(text: str, pos: int = 0) -> list[HarmonyMessage]:
    """The messages of ``text[pos:]`` (which starts where a message may start). The last one may
    be open (``closed`` False); a header the text ends inside, or whitespace it ends on, is not
    reported. Everything reported here stays as it is when the text grows, but for the open
    message's content, which grows (the stream parser relies on it)."""
    messages: list[HarmonyMessage] = []
    n = len(text)
    while pos < n:
        i = pos
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i == n:
            break
        head = i + len(START) if text.startswith(START, i) else i
        at, marker = find_first(text, (MESSAGE, *_CONTENT_ENDS), head)
        header_text = text[head:at if at >= 0 else n]
        header = _read_header(header_text) if marker == MESSAGE else None
        if header is None and at < 0 and _read_header(header_text, partial=True) is not None:
            break   # a header still being written
        if header is not None:
            body = at + len(MESSAGE)
        else:   # not a header: the message is the text as written, from where it starts
            body = head
        stop, marker = find_first(text, _CONTENT_ENDS, body)
        content = text[(body if header is not None else pos):stop if stop >= 0 else n]
        closed = stop >= 0
        end = n if not closed else stop if marker == START else stop + len(marker)
        h = header or HarmonyHeader()
        messages.append(HarmonyMessage(h.channel, h.recipient, h.content_type, content, closed, header is not None,
                                       closed, end))  # fmt: skip
        pos = end
    return messages


def parse(text: str, cut: bool = False) -> list[HarmonyMessage]:
    """The messages of a finished output. ``cut``: it was cut short (max_tokens), so a last
    message that no marker ended is incomplete; otherwise it ended at a stop token (complete)."""
    messages = _scan(text)
    if messages and not messages[-1].closed:
        messages[-1].complete = not cut
    return messages


@dataclass(frozen=True)
class MessageDelta:
    """What one step of a stream adds to message ``index``: its header comes on its first delta
    (``opened``), then its content in pieces; ``closed`` on the delta that ends it."""

    index: int
    text: str = ""
    opened: HarmonyMessage | None = None   # the message as it starts (its header; content "")
    closed: bool = False


class HarmonyStreamParser:
    """Follows an output as it grows: ``feed`` returns what each piece adds, which put together
    (``collect``) is ``parse`` of the whole text, however the text was cut into pieces. What may
    still turn into a marker (``<|en``) is held back until the next piece tells."""

    def __init__(self) -> None:
        self._text = ""
        self._resume = 0            # where the first message not yet closed starts
        self._closed = 0            # how many messages are closed (and sent whole)
        self._sent: list[int] = []  # characters of content sent, per message not yet closed

    def feed(self, delta: str, final: bool = False) -> list[MessageDelta]:
        self._text += delta
        stable = self._text if final else self._text[:len(self._text) - partial_marker(self._text)]
        out: list[MessageDelta] = []
        messages = _scan(stable, self._resume)
        for k, message in enumerate(messages):
            index = self._closed + k
            if k == len(self._sent):
                opened = HarmonyMessage(message.channel, message.recipient, message.content_type, "",
                                        well_formed=message.well_formed)  # fmt: skip
                out.append(MessageDelta(index, message.content, opened, message.closed))
                self._sent.append(len(message.content))
            else:
                new = message.content[self._sent[k]:]
                if new or message.closed:
                    out.append(MessageDelta(index, new, None, message.closed))
                self._sent[k] = len(message.content)
        # Only the last message may be open: the closed ones are done, the next scan starts after them.
        done = sum(1 for m in messages if m.closed)
        if done:
            self._closed += done
            self._resume = messages[done - 1].end
            del self._sent[:done]
        return out


def collect(deltas: Sequence[MessageDelta], cut: bool = False) -> list[HarmonyMessage]:
    """The messages ``deltas`` add up to (``cut``: as in ``parse``)."""
    messages: list[HarmonyMessage] = []
    for d in deltas:
        if d.opened is not None:
            messages.append(HarmonyMessage(d.opened.channel, d.opened.recipient, d.opened.content_type, "",
                                           well_formed=d.opened.well_formed))  # fmt: skip
        m = messages[d.index]
        m.content += d.text
        m.closed = m.closed or d.closed
    for m in messages:
        m.complete = m.closed or (m is messages[-1] and not cut)
    return messages


def message_header(header: HarmonyHeader | HarmonyMessage) -> str:
    """An assistant message's header as GPT-OSS writes it after ``<|start|>assistant``:
    ``<|channel|>commentary to=functions.f <|constrain|>json``."""
    out = CHANNEL + header.channel if header.channel else ""
    if header.recipient:
        out += f" to={header.recipient}"
    if header.content_type:
        out += f" {CONSTRAIN}{header.content_type}"
    return out


def read_header(header: str) -> HarmonyHeader | None:
    """A complete header (what comes between ``<|start|>`` and ``<|message|>``), or None."""
    return _read_header(header)


def call_name(recipient: str) -> str:
    """The name a call to ``recipient`` is returned under: a function's own name
    (``functions.get_weather`` -> ``get_weather``), a built-in tool's recipient as it is."""
    return recipient.removeprefix("functions.") or recipient
