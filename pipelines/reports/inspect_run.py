"""`groupforge inspect RUN`: what a run holds — rows per table and round, manifests, examples;
with `--stages`, the stage graph: each stage, the tables it reads and writes, its last run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from curation.stages.runner import CURATION_STAGES, stage_module
from store.run_store import RunStore
from store.schema import SCHEMAS, empty

_SHOWN_COLUMNS = {
    "prompts": ["prompt_id", "prompt", "reference"],
    "samples": ["round", "prompt_id", "sample_idx", "response", "finish_reason", "policy_version"],
    "scores": ["round", "prompt_id", "sample_idx", "reward"],
    "groups": ["round", "prompt_id", "sample_idx", "reward", "advantage", "group_kept"],
    "rejects": ["round", "prompt_id", "sample_idx", "stage", "reason", "detail"],
    "pairs": ["round", "prompt_id", "chosen_idx", "rejected_idx", "margin", "soft_label"],
    "prompt_stats": ["round", "prompt_id", "rounds_seen", "samples", "passes", "pass_rate"],
}


def table_counts(run: str | Path) -> dict[str, dict[int | None, int]]:
    """{table: {round: rows}} as the commits recorded them (prompts: {None: rows}); no data is read."""
    store = RunStore(run).snapshot()  # whole commits only, while a job may be writing
    counts: dict[str, dict[int | None, int]] = {}
    for name in SCHEMAS:
        files = store.files(name)
        if not files:
            continue
        per_round: dict[int | None, int] = {}
        for rel in files:
            round = None if name == "prompts" else int(rel.split("/")[1].removeprefix("round="))
            per_round[round] = per_round.get(round, 0) + store.row_count(rel)
        counts[name] = dict(sorted(per_round.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))
    return counts


def inspect_run(run: Path, rows: int, console: Console) -> None:
    store = RunStore(run).snapshot()
    counts = table_counts(run)
    if not counts:
        console.print(f"{run}: no tables yet")
        return
    rounds = sorted({round for per in counts.values() for round in per if round is not None})
    overview = Table(title=f"{run}: rows per table and round")
    overview.add_column("table")
    for round in rounds:
        overview.add_column(f"round {round}", justify="right")
    overview.add_column("all", justify="right")
    for name, per in counts.items():
        cells = [str(per.get(round, "")) if name != "prompts" else "" for round in rounds]
        overview.add_row(name, *cells, str(sum(per.values())))
    console.print(overview)

    manifests = [m for _, m in sorted(store.state.manifests.items())]
    if manifests:
        table = Table(title="stage manifests")
        for column in ("stage", "round", "rows in", "rows out", "drops", "created"):
            table.add_column(column)
        for m in manifests:
            drops = ", ".join(f"{k}={v}" for k, v in (m.get("drops") or {}).items()) or "-"
            table.add_row(m["stage"], str(m["round"]), str(m.get("rows_in")), str(m.get("rows_out")), drops,
                          str(m.get("created_at", ""))[:19])
        console.print(table)

    for name, per in counts.items():
        total = sum(per.values())
        first = next(rel for rel in store.files(name) if store.row_count(rel)) if total else None
        data = store.read_part(first, name).slice(0, rows) if first else empty(name)
        columns = [c for c in _SHOWN_COLUMNS[name] if c in data.column_names]
        example = Table(title=f"{name}: first {min(rows, data.num_rows)} of {total} rows")
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


# ---- the stage graph ------------------------------------------------------------------------


@dataclass
class StageRow:
    """One stage of the graph, with what its manifests say about this run."""

    stage: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    rounds: list[int]
    """Rounds the stage has committed (a manifest each)."""
    last_run: str | None
    """created_at of its newest manifest (UTC, ISO 8601); None: never ran."""
    rows_in: int
    """Summed over its rounds."""
    rows_out: int


def stage_graph(run_dir: str | Path) -> list[StageRow]:
    """generate, score, filter, label, pair: each stage's declared reads and writes, and its
    manifests' rounds, newest created_at and rows in/out (summed over rounds)."""
    from curation.generate import stage as generate_stage  # its module loads torch: only when asked

    store = RunStore(run_dir)
    modules = [generate_stage, *(stage_module(name) for name in CURATION_STAGES)]
    rows = []
    for module in modules:
        name = module.STAGE
        rounds = sorted(r for stage, r in store.state.manifests if stage == name)
        manifests = [store.load_manifest(name, round) or {} for round in rounds]
        stamps = [str(m["created_at"]) for m in manifests if m.get("created_at")]
        rows.append(StageRow(name, tuple(getattr(module, "READS", ())), tuple(getattr(module, "WRITES", ())), rounds,
                             max(stamps) if stamps else None, sum(m.get("rows_in") or 0 for m in manifests),
                             sum(m.get("rows_out") or 0 for m in manifests)))
    return rows


def print_stage_graph(run_dir: Path, console: Console) -> None:
    """The stage graph of `run_dir` as one table (see stage_graph)."""
    table = Table(title=f"{run_dir}: stages, in the order they run")
    for column in ("stage", "reads", "writes", "rounds", "last run", "rows in", "rows out"):
        table.add_column(column, justify="right" if column.startswith("rows ") else "left")
    for row in stage_graph(run_dir):
        ran = bool(row.rounds)
        table.add_row(row.stage, ", ".join(row.reads) or "-", ", ".join(row.writes) or "-",
                      number_ranges(row.rounds) or "-", (row.last_run or "never")[:19].replace("T", " "),
                      str(row.rows_in) if ran else "-", str(row.rows_out) if ran else "-")
    console.print(table)


def number_ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in spans)
