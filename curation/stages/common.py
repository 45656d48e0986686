"""What every curation stage shares: input fingerprints, the rejects helper, the report.

A stage file holds two things:

- a pure function `(tables, config) -> tables` with the SQL/expressions inline (no I/O),
  which is what the tests and benchmarks call, and
- `run(run_dir, round, config, force=False) -> StageReport`, which reads its inputs from the
  run store (validated), skips when its manifest is up to date, calls the pure function and
  commits the outputs (with drop counts per reason) atomically.

Callers hold the run's lock (`RunStore.lock()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation import schema
from curation.schema import SCHEMAS
from curation.store import RunStore, fingerprint_file


@dataclass
class StageReport:
    stage: str
    round: int
    skipped: bool
    rows_in: int = 0
    rows_out: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def input_fingerprints(store: RunStore, tables: list[str], round: int, exclude_parts: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative path: sha256} of every part file the stage reads for `round` (prompts: all
    parts). `exclude_parts` leaves out the stage's own outputs (e.g. filter's rejects part)."""
    found: dict[str, str] = {}
    for table in tables:
        files = store.files(table) if table == "prompts" else store.files(table, round)
        for path in files:
            if path.stem.removeprefix("part-") in exclude_parts:
                continue
            found[path.relative_to(store.root).as_posix()] = fingerprint_file(path)
    return found


def rejects_table(run_id: list[str] | str, round: list[int] | int, prompt_id: list[str], sample_idx: list[int | None],
                  stage: str, reason: list[str] | str, detail: list[str | None] | None = None) -> pa.Table:
    """A rejects table; scalar arguments are repeated for every row."""
    n = len(prompt_id)

    def column(value):
        return value if isinstance(value, list) else [value] * n

    return pa.Table.from_pydict(
        {
            "run_id": column(run_id),
            "round": column(round),
            "prompt_id": prompt_id,
            "sample_idx": sample_idx,
            "stage": column(stage),
            "reason": column(reason),
            "detail": detail if detail is not None else [None] * n,
        },
        schema=SCHEMAS["rejects"],
    )


def drop_counts(rejects: pa.Table) -> dict[str, int]:
    """{reason: rows} of a rejects table."""
    counts = pc.value_counts(rejects.column("reason")).to_pylist()
    return {c["values"]: c["counts"] for c in counts}


def as_dict(config) -> Mapping:
    """A pydantic model or dataclass config as a plain dict (for manifests)."""
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    if hasattr(config, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(config)
    return dict(config)


def read_samples(store: RunStore, round: int, columns: list[str]) -> pa.Table:
    """`columns` of the round's samples, without reading the token and log-prob lists that
    filter and label never look at. Each part file's schema (from its Parquet footer) is
    validated against the samples contract; the columns read are checked for nulls."""
    files = store.files("samples", round)
    contract = schema.SCHEMAS["samples"]
    if not files:
        return contract.empty_table().select(columns)
    for path in files:
        schema.validate(pq.read_schema(path).empty_table(), "samples", path)
    con = duckdb.connect()
    try:
        sql = f"SELECT {', '.join(columns)} FROM read_parquet($files, hive_partitioning = false, union_by_name = true)"
        table = con.sql(sql, params={"files": [str(f) for f in files]}).to_arrow_table()
    finally:
        con.close()
    table = table.cast(pa.schema([contract.field(c) for c in columns]))
    for column in columns:
        if not contract.field(column).nullable and table.column(column).null_count:
            raise schema.SchemaError(f"samples table ({store.table_glob('samples')}): column {column!r} "
                                     f"has {table.column(column).null_count} null value(s)")
    if "round" in columns and table.num_rows and pc.min_max(table.column("round")).as_py() != {"min": round, "max": round}:
        raise schema.SchemaError(f"samples table ({store.partition_dir('samples', round)}): column 'round' "
                                 f"holds other rounds than {round}")
    return table
