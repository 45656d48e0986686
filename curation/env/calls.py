"""Tool calls in an assistant message's text.

Two formats, both inside `<tool_call>...</tool_call>` blocks (one or more per message):

- Hermes / Qwen: one call per block, `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>`
- SmolLM2: a list of calls in one block, `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`.

`arguments` may be an object or a JSON string holding one ("parameters" is read when
"arguments" is absent; neither means no arguments). The text is the model's and untrusted:
`parse_tool_calls` never raises, a block it cannot read becomes a `CallParseError` in its
place among the calls, so the environment can answer it with an error message.

    >>> parse_tool_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1})]
    >>> content_without_calls('Let me add. <tool_call>{"name": "add"}</tool_call>')
    'Let me add.'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_UNCLOSED = re.compile(re.escape(OPEN) + r"(?!.*" + re.escape(CLOSE) + r")(.*)\Z", re.DOTALL)
_SHOWN_CHARS = 200  # of a block's text kept in a parse error


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallParseError:
    """A `<tool_call>` block (or one entry of a list block) that is not a call: `error` says
    why in one line, `text` is the start of what the model wrote."""

    error: str
    text: str


def parse_tool_calls(text: str) -> list[ToolCall | CallParseError]:
    """Every call of `text`'s `<tool_call>` blocks, in order; a block or list entry that is not
    a call becomes a CallParseError in its place. A `<tool_call>` left open at the end is an
    error too. Never raises on a string."""
    found: list[ToolCall | CallParseError] = []
    for body in _blocks(text):
        if body is None:
            found.append(CallParseError("<tool_call> without </tool_call>", _shown(text[text.rfind(OPEN):])))
            continue
        try:
            value = json.loads(body)
        except (ValueError, RecursionError) as exc:
            found.append(CallParseError(f"invalid JSON: {_one_line(exc)}", _shown(body)))
            continue
        entries = value if isinstance(value, list) else [value]
        if not entries:
            found.append(CallParseError("an empty list of calls", _shown(body)))
        for entry in entries:
            found.append(_call(entry, body))
    return found


def content_without_calls(text: str) -> str:
    """`text` with its `<tool_call>` blocks (and a block left open at the end) removed, stripped."""
    kept = _BLOCK.sub("", text)
    kept = _UNCLOSED.sub("", kept)
    return kept.strip()


def _blocks(text: str) -> list[str | None]:
    """The bodies of the closed blocks, then None for a block left open at the end."""
    bodies: list[str | None] = [m.group(1) for m in _BLOCK.finditer(text)]
    if _UNCLOSED.search(_BLOCK.sub("", text)):
        bodies.append(None)
    return bodies


def _call(entry: Any, body: str) -> ToolCall | CallParseError:
    """A call from one parsed JSON entry, or why it is none."""
    if not isinstance(entry, dict):
        return CallParseError(f"a call must be a JSON object, got {_json_kind(entry)}", _shown(body))
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        return CallParseError('a call needs a "name" string', _shown(body))
    arguments = entry.get("arguments", entry.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return CallParseError(f"arguments of {name!r} are not valid JSON: {_one_line(exc)}", _shown(body))
    if not isinstance(arguments, dict):
        return CallParseError(f"arguments of {name!r} must be a JSON object, got {_json_kind(arguments)}",
                              _shown(body))
    return ToolCall(name=name.strip(), arguments=arguments)


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _one_line(exc: BaseException) -> str:
    return str(exc).replace("\n", " ")[:200]


def _shown(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."
