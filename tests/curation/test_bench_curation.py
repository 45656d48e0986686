"""bench/curation.py: its pandas baselines compute what the stages compute, so its ratios compare like with like."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "curation.py"


def test_pandas_baselines_give_the_stages_output(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))  # as when the bench runs as a script: its helpers import
    spec = importlib.util.spec_from_file_location("bench_curation", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    summary = bench.same_output(rows=1600, seed=3)  # raises AssertionError naming the table and column
    assert summary.startswith("same output on a 1,600-row input")
