"""`groupforge inspect RUN`: what a run holds — rows per table and round, manifests, examples."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
from rich.console import Console
from rich.table import Table

from curation.schema import SCHEMAS
from curation.store import RunStore

_SHOWN_COLUMNS = {
    "prompts": ["prompt_id", "prompt", "reference"],
    "samples": ["round", "prompt_id", "sample_idx", "response", "finish_reason", "policy_version"],
    "scores": ["round", "prompt_id", "sample_idx", "reward"],
    "groups": ["round", "prompt_id", "sample_idx", "reward", "advantage", "group_kept"],
    "rejects": ["round", "prompt_id", "sample_idx", "stage", "reason", "detail"],
    "pairs": ["round", "prompt_id", "chosen_idx", "rejected_idx", "margin", "soft_label"],
}


def table_counts(run: str | Path) -> dict[str, dict[int | None, int]]:
    """{table: {round: rows}} for every table folder that holds Parquet files (prompts: {None: rows})."""
    store = RunStore(run)
    counts: dict[str, dict[int | None, int]] = {}
    for name in SCHEMAS:
        if not any(store.table_dir(name).rglob("*.parquet")):
            continue
        rows = store.read(name)
        if name == "prompts":
            counts[name] = {None: rows.num_rows}
            continue
        per_round = duckdb.sql("SELECT round, count(*) FROM rows GROUP BY round ORDER BY round").fetchall()
        counts[name] = {int(r): int(n) for r, n in per_round}
    return counts


def inspect_run(run: Path, rows: int, console: Console) -> None:
    store = RunStore(run)
    counts = table_counts(run)
    if not counts:
        console.print(f"{run}: no tables yet")
        return
    rounds = sorted({r for per in counts.values() for r in per if r is not None})
    overview = Table(title=f"{run}: rows per table and round")
    overview.add_column("table")
    for r in rounds:
        overview.add_column(f"round {r}", justify="right")
    overview.add_column("all", justify="right")
    for name, per in counts.items():
        cells = [str(per.get(r, "")) if name != "prompts" else "" for r in rounds]
        overview.add_row(name, *cells, str(sum(per.values())))
    console.print(overview)

    manifests = sorted((store.root / "_manifests").glob("*.json"))
    if manifests:
        table = Table(title="stage manifests")
        for column in ("stage", "round", "rows in", "rows out", "drops", "created"):
            table.add_column(column)
        for path in manifests:
            m = json.loads(path.read_text())
            drops = ", ".join(f"{k}={v}" for k, v in (m.get("drops") or {}).items()) or "-"
            table.add_row(m["stage"], str(m["round"]), str(m.get("rows_in")), str(m.get("rows_out")), drops,
                          str(m.get("created_at", ""))[:19])
        console.print(table)

    for name in counts:
        data = store.read(name)
        columns = [c for c in _SHOWN_COLUMNS[name] if c in data.column_names]
        example = Table(title=f"{name}: first {min(rows, data.num_rows)} of {data.num_rows} rows")
        for column in columns:
            example.add_column(column, overflow="fold", max_width=40)
        for row in data.select(columns).slice(0, rows).to_pylist():
            example.add_row(*[_short(row[c], c) for c in columns])
        console.print(example)


def _short(value, column: str = "") -> str:
    if column == "prompt_id" and value is not None:
        return str(value)[:12]  # a sha256: the first 12 hex digits identify it in practice
    text = "null" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
