"""A dataset that grows by versions: each export appends a run's newly finished rounds to a
Delta Lake table, one version per append, with the append's provenance in the version.

    groupforge export RUN --format preference --append-to s3://bucket/datasets/pairs
    [export] append_to = "s3://bucket/datasets/pairs"      (a spec: `groupforge run` appends at its end)

The table is an ordinary Delta table (a folder or an object-store prefix): Parquet files with
the export's columns (curation/stages/export.py), and `_delta_log/<version>.json` written by
curation/store/delta_log.py. Version v's commitInfo["groupforge"] is its provenance:

    run              the run (its resolved folder or its URL)
    rounds, rows     the rounds this version added and their rows (a round may have none)
    format, style    the export's
    spec_sha256      sha256 of RUN/spec.toml, the resolved spec that ran (null without one)
    prompt_files     RUN/pipeline.json's prompt files: every train file the run has seen
    groupforge       the code version that appended
    export           the export's provenance (model, policy versions, sampling, rewards, stages)

Which rounds an append adds: those whose table the format reads first is made (the pair stage's
commit for preference, label's for unpaired and sft), that the run finished (a round record in
RUN/metrics.jsonl, when the run has one), minus the rounds of this run that the table's
provenance lists. So a rerun after a kill, or a second refresh, never adds a round twice.

The version is written with `Storage.create` (If-None-Match) at the version number read before
the export was built: of two appenders, one wins; the other deletes its data file, reads the
table again and appends what is still missing (usually nothing). A kill between the data file
and the version leaves a file no version lists, which readers ignore (`DeltaTable.vacuum`
removes it). A Parquet checkpoint of the log every `delta_log.CHECKPOINT_EVERY` versions keeps
opening the table cheap; the JSON versions, which hold the provenance, stay.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation.card import METADATA_KEY
from curation.errors import JobError
from curation.faults import fault_point
from curation.stages.export import ExportConfig, export_rows
from curation.store import delta_log
from curation.store.fingerprints import code_version
from curation.store.location import RunLocation
from curation.store.run_store import RunStore
from curation.store.runlog import SPEC_FILE, MetricsLog, load_pipeline_state
from curation.store.storage import Storage, open_storage

ROUNDS_FROM = {"preference": "pair", "unpaired": "label", "sft": "label"}
"""Per format, the stage whose commit makes a round exportable."""
ATTEMPTS = 5
"""Appends tried before giving up when other appenders keep writing the next version first."""


@dataclass(frozen=True)
class Appended:
    """What one append did."""

    table: str
    """The dataset's location."""
    version: int | None
    """The version written; None when every finished round was in the table already."""
    rounds: list[int] = field(default_factory=list)
    rows: int = 0


@dataclass(frozen=True)
class DatasetLog:
    """What an appender reads of the table's log: its next version, its schema, and the rounds
    each run has in it (from every version's provenance)."""

    next_version: int
    schema: dict | None
    """The table's schema (Delta's JSON form), None before version 0."""
    rounds: dict[str, set[int]]


def read_dataset_log(table: Storage) -> DatasetLog:
    """The table's log read from its JSON versions (see `DatasetLog`)."""
    schema, rounds, newest = None, {}, -1
    for entry in table.list(delta_log.LOG_DIR):
        name = entry.rel.rsplit("/", 1)[-1]
        if not (name.endswith(".json") and len(name) == 25 and name[:20].isdigit()):
            continue
        newest = max(newest, int(name[:20]))
        for line in table.read(entry.rel).decode().splitlines():
            action = json.loads(line) if line.strip() else {}
            if "metaData" in action:
                schema = json.loads(action["metaData"]["schemaString"])
            info = action.get("commitInfo", {}).get("groupforge") or {}
            if "run" in info:
                rounds.setdefault(info["run"], set()).update(info.get("rounds") or [])
    return DatasetLog(newest + 1, schema, rounds)


def finished_rounds(store: RunStore, cfg: ExportConfig) -> list[int]:
    """The run's rounds an append of `cfg` may add (the module docstring): made by the stage of
    `ROUNDS_FROM`, finished when the run has round records, within `cfg.rounds` when set."""
    stage = ROUNDS_FROM[cfg.format]
    made = {r for (s, r) in store.state.manifests if s == stage}
    metrics = MetricsLog(store.storage)
    if metrics.exists():
        made &= {record["round"] for record in metrics.rounds()}
    if cfg.rounds is not None:
        made &= set(cfg.rounds)
    return sorted(made)


def append_export(run: str | Path | Storage, cfg: ExportConfig, target: str | None = None) -> Appended:
    """Append the export (`cfg`) of the run's finished rounds that the Delta table at `target`
    (default `cfg.append_to`) does not hold yet, as one new version; see the module docstring."""
    target = target or cfg.append_to
    if not target:
        raise ValueError("append_export: no table to append to (give --append-to or [export] append_to)")
    if cfg.format not in ROUNDS_FROM:
        raise ValueError(f"--append-to {target}: format {cfg.format} has no rounds to append; use one of "
                         + ", ".join(ROUNDS_FROM))
    table = open_storage(target)
    store = RunStore(run).snapshot()  # whole commits only
    run_key = RunLocation.of(store.storage).key
    for _ in range(ATTEMPTS):
        log = read_dataset_log(table)
        new = [r for r in finished_rounds(store, cfg) if r not in log.rounds.get(run_key, set())]
        if not new:
            return Appended(target, None)
        rows = export_rows(store, cfg.model_copy(update={"rounds": new}), allow_empty=True)
        schema = rows.schema.remove_metadata()
        if not rows.num_rows and log.schema is None:
            return Appended(target, None)  # no rows to make the table from yet: those rounds are looked at again
        if rows.num_rows and log.schema is not None and log.schema != json.loads(delta_log.schema_string(schema)):
            raise ValueError(f"--append-to {target}: the table's columns differ from this {cfg.format} "
                             f"({cfg.style}) export's; append to another table")
        added = _write_file(table, rows, RunLocation.of(store.storage).name, new) if rows.num_rows else []
        fault_point("dataset.file_written")
        info = _provenance(store, run_key, cfg, new, rows)
        try:
            version = delta_log.commit(table, schema, add=added, info=info, version=log.next_version)
        except delta_log.DeltaConflict:
            table.delete_all(f.path for f in added)  # named by a uuid: no other version lists it
            continue
        if version and version % delta_log.CHECKPOINT_EVERY == 0:
            delta_log.checkpoint(table)
        return Appended(target, version, new, rows.num_rows)
    raise JobError(f"--append-to {target}: {ATTEMPTS} appends in a row lost to other writers of the table; "
                   "rerun to append what is still missing")


def _write_file(table: Storage, rows: pa.Table, run_name: str, rounds: list[int]) -> list[delta_log.DeltaFile]:
    """`rows` as one Parquet file of the table, named by the run, its rounds and a uuid."""
    sink = pa.BufferOutputStream()
    pq.write_table(rows, sink, compression="zstd")
    data = sink.getvalue()
    path = f"part-{run_name}-rounds-{rounds[0]}-{rounds[-1]}-{uuid.uuid4().hex[:16]}.parquet"
    table.write(path, data)
    span = pc.min_max(rows.column("round")).as_py()
    low, high = {"round": span["min"]}, {"round": span["max"]}
    return [delta_log.DeltaFile(path, data.size, rows.num_rows, low, high)]


def _provenance(store: RunStore, run_key: str, cfg: ExportConfig, rounds: list[int], rows: pa.Table) -> dict:
    """commitInfo["groupforge"] of an append (the module docstring)."""
    spec = store.storage.read_if_exists(SPEC_FILE)
    return {"run": run_key, "rounds": rounds, "rows": rows.num_rows, "format": cfg.format, "style": cfg.style,
            "spec_sha256": hashlib.sha256(spec).hexdigest() if spec is not None else None,
            "prompt_files": load_pipeline_state(store.storage).get("prompt_files", []),
            "groupforge": code_version(),
            "export": json.loads(rows.schema.metadata[METADATA_KEY])}
