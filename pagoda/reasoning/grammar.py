"""Any structured output constraint as one Lark expression, so that a reasoning parser can put
its free-text reasoning section in front of it (llguidance's Lark dialect: ``%json`` and
``%lark`` embed a schema or a whole grammar, ``[lazy]`` ends a rule at its first possible end).
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import _JSON_LAYOUT

# Free text: any characters, newlines included.
ANY_TEXT = r"/(.|\n)*/"
# What the model may write between ``</think>`` and the answer.
WHITESPACE = r"/[ \t\r\n]*/"


def _with_layout(schema: Any) -> Any:
    """The JSON layout the backend uses for a plain schema, unless the schema sets its own."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {**_JSON_LAYOUT, **(schema.get("x-guidance") or {})}}


def regex_literal(regex: str) -> str:
    """``regex`` as a Lark ``/.../`` literal: unescaped slashes and raw newlines escaped.

    E.g. ``a/b\\/c`` -> ``/a\\/b\\/c/`` (the already escaped slash is left as it is)."""
    out: list[str] = []
    escaped = False
    for ch in regex:
        if escaped:
            out.append(ch)
            escaped = False
        elif ch == "\\":
            out.append(ch)
            escaped = True
        elif ch == "/":
            out.append("\\/")
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append(ch)
    return "/" + "".join(out) + "/"


def as_lark_expression(params: StructuredOutputsParams) -> str:
    """The right-hand side of a Lark rule that admits exactly what ``params`` admits."""
    if params.json is not None:
        return "%json " + json.dumps(_with_layout(json.loads(str(params.json))))
    if params.json_object:
        return "%json " + json.dumps(_with_layout({"type": "object"}))
    if params.regex is not None:
        return regex_literal(params.regex)
    if params.choice is not None:
        return " | ".join(json.dumps(c) for c in params.choice)
    return "%lark {\n" + str(params.grammar) + "\n}"
