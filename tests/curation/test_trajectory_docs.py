"""docs/trajectories.md: its queries over the trajectories run as written on a hand-made
multi-turn run (tests/curation/test_trajectory_curation.py's) and give its numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.curation.test_trajectory_curation import ROWS, run  # noqa: F401  (the module's run fixture)

DOC = Path(__file__).resolve().parents[2] / "docs" / "trajectories.md"
MARKER = "<!-- trajectories-query -->"


def queries() -> list[str]:
    text = DOC.read_text()
    blocks = [re.match(r"\s*```python\n(.*?)```", part, re.S) for part in text.split(MARKER)[1:]]
    assert len(blocks) == 2 and all(blocks), f"{DOC}: expected two ```python blocks after {MARKER}"
    return [block[1] for block in blocks]


def run_block(code: str, run_dir: Path) -> dict:
    names: dict = {}
    exec(compile(code.replace("runs/my-run", str(run_dir)), str(DOC), "exec"), names)  # noqa: S102
    return names


def test_the_polars_queries_give_the_runs_numbers(run):  # noqa: F811
    names = run_block(queries()[0], run)
    row = names["per_round"].to_dicts()
    assert row == [{"round": 0, "tool_use_rate": pytest.approx(4 / 8), "tool_error_rate": pytest.approx(1 / 8),
                    "mean_turns": pytest.approx(sum(r["num_turns"] for r in ROWS) / 8),
                    "mean_model_tokens": pytest.approx(sum(sum(r["response_mask"]) for r in ROWS) / 8)}]
    assert names["stop_reasons"].rows() == [("done", 8)]


def test_the_duckdb_queries_give_the_runs_numbers(run):  # noqa: F811
    names = run_block(queries()[1], run)
    by_turns = {turns: (n, model, tool) for turns, n, _, model, tool in names["by_turns"]}
    assert by_turns == {1: (4, 3.0, 0.0), 2: (3, 6.0, 2.0), 3: (1, 9.0, 4.0)}
    assert dict(names["messages_by_role"]) == {"assistant": 13, "tool": 5}
