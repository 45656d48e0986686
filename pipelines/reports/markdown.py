"""Markdown tables for the run and study reports: one cell format (None as "—", floats to four
significant digits) and numeric columns right-aligned."""

from __future__ import annotations

import math
from typing import Any

MISSING = "—"
"""A cell without a value."""


def _format_float(x: float) -> str:
    """Four significant digits, fixed notation between 1e-3 and 1e6, no trailing zeros."""
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    magnitude = abs(x)
    if not 1e-3 <= magnitude < 1e6:
        return f"{x:.4g}"
    text = f"{x:.{max(0, 3 - math.floor(math.log10(magnitude)))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _format_cell(cell: Any) -> str:
    if cell is None:
        return MISSING
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if isinstance(cell, int):
        return str(cell)
    if isinstance(cell, float):
        return _format_float(cell)
    return str(cell).replace("|", r"\|").replace("\n", " ")


def _is_numeric(text: str) -> bool:
    try:
        float(text.rstrip("%"))
    except ValueError:
        return text == MISSING
    return True


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured markdown table; numeric columns are right-aligned.

    Cells: None -> "—", ints as they are, floats to four significant digits without trailing
    zeros (0.41234 -> "0.4123", 12.0 -> "12", 3e-05 -> "3e-05"), strings as given (a "|" is
    escaped). Pass a string to fix a column's precision yourself, e.g. f"{100 * acc:.1f}".

    >>> print(markdown_table(["objective", "gain"], [["grpo", 0.5], ["sft", None]]))
    | objective | gain |
    | --- | ---: |
    | grpo | 0.5 |
    | sft | — |
    """
    header_cells = [_format_cell(h) for h in headers]
    body = []
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: row {i} has {len(row)} cells, expected {len(headers)} ({headers})")
        body.append([_format_cell(cell) for cell in row])
    numeric = [bool(body) and all(_is_numeric(row[j]) for row in body) and any(row[j] != MISSING for row in body)
               for j in range(len(headers))]
    lines = ["| " + " | ".join(header_cells) + " |",
             "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)
