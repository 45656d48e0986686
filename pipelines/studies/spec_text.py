"""Edits of a spec's TOML text that keep the user's comments and layout: one `[section] key`
set to a new value, and a comment block above a section header.

A spec is edited as text, never re-dumped (`pipelines.spec.dump_toml` would drop every comment).
Each edit is checked by parsing the result: the document must equal the original with only
that key changed, or the edit is refused with one line saying what to set by hand.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


def format_float(value: float) -> str:
    """A float as the shortest TOML text that reads back as the same float: exponent form below
    0.01 (2e-4, 6.67e-5), Python's shortest repr otherwise (0.5, 1.0)."""
    if value == 0 or abs(value) >= 1e-2:
        return repr(float(value))
    for digits in range(17):
        mantissa, exponent = f"{value:.{digits}e}".split("e")
        if float(f"{mantissa}e{exponent}") == value:
            return f"{mantissa}e{int(exponent)}"
    return repr(float(value))


def _section_lines(lines: list[str], section: str) -> tuple[int, int] | None:
    """(header index, end index) of `[section]` in `lines`: the lines after its header up to the
    next header; None when the text has no such header."""
    start = next((i for i, line in enumerate(lines) if (m := _HEADER.match(line)) and m.group(1) == section
                  and not line.lstrip().startswith("[[")), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if _HEADER.match(lines[i])), len(lines))
    return start, end


def set_key(text: str, section: str, key: str, value: float, where: str) -> str:
    """`text` (a TOML document) with `[section] key` set to `value`: the value of its line
    replaced in place (the comment after it kept in its column where the new value fits), or a
    `key = value` line added under the header, or a new `[section]` at the end. `where` names the
    document in the error of an edit that would change anything else."""
    lines = text.splitlines(keepends=True)
    value_text = format_float(value)
    found = _section_lines(lines, section)
    if found is None:
        edited = text + ("" if not text or text.endswith("\n") else "\n") + f"\n[{section}]\n{key} = {value_text}\n"
    else:
        start, end = found
        pattern = re.compile(rf"^(\s*{re.escape(key)}\s*=\s*)([^\s#]+)([ \t]*)(.*?)(\r?\n)?$")
        index = next((i for i in range(start + 1, end) if pattern.match(lines[i])), None)
        if index is None:
            lines.insert(start + 1, f"{key} = {value_text}\n")
        else:
            lead, old, gap, rest, newline = pattern.match(lines[index]).groups()
            gap = " " * max(1, len(old) + len(gap) - len(value_text)) if rest else ""
            lines[index] = f"{lead}{value_text}{gap}{rest}{newline or ''}"
        edited = "".join(lines)
    _check_only_key_changed(text, edited, section, key, value, where)
    return edited


def _check_only_key_changed(before: str, after: str, section: str, key: str, value: Any, where: str) -> None:
    expected = tomllib.loads(before)
    expected.setdefault(section, {})[key] = value
    try:
        changed = tomllib.loads(after)
    except tomllib.TOMLDecodeError:
        changed = None
    if changed != expected:
        raise ValueError(f"{where}: cannot set {section}.{key} in its text (set as a dotted key or an inline "
                         f"table?); set {section}.{key} = {format_float(value)} there by hand")


def put_comment_block(text: str, section: str, comment: list[str], prefix: str) -> str:
    """`text` with `comment` (lines, each written as `prefix` + line) directly above the
    `[section]` header, in place of an earlier block of `prefix` lines there (a spec tuned again
    carries one block). The section must exist."""
    lines = text.splitlines(keepends=True)
    found = _section_lines(lines, section)
    if found is None:
        raise ValueError(f"no [{section}] header to put the comment above")
    start = found[0]
    first = start
    while first > 0 and lines[first - 1].startswith(prefix.rstrip()):
        first -= 1
    block = [f"{prefix}{line}".rstrip() + "\n" for line in comment]
    return "".join(lines[:first] + block + lines[start:])
