"""A dataset that grows by versions: each export appends a run's newly finished rounds to a
Delta Lake table, one version per append, with the append's provenance in the version.

    groupforge export RUN --format preference --append-to s3://bucket/datasets/pairs
    [export] append_to = "s3://bucket/datasets/pairs"      (a spec: `groupforge run` appends at its end)

The table is an ordinary Delta table (a folder or an object-store prefix) written by deltalake:
Parquet files with the export's columns (curation/stages/export.py); a trajectory export's JSON
messages and tools are plain strings there (Delta has no JSON type). Version v's commitInfo
"groupforge" is its provenance:

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

Each version carries an app transaction whose id is the run (Delta's `txn` action, for
exactly-once writes by an application): of two appenders of one run, the one that commits
second finds the other's transaction among the versions written since it read the table, its
commit fails, and it reads the table again and appends what is still missing (usually nothing).
Appenders of other runs do not conflict: deltalake commits them one after the other. A kill
before the commit leaves at most a data file that no version lists, which readers ignore
(`DeltaTable.vacuum` removes it). A Parquet checkpoint of the log every 10 versions keeps
opening the table cheap; the JSON versions, which hold the provenance, stay.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake import Schema as DeltaSchema

from curation.card import METADATA_KEY
from curation.stages.export import ExportConfig, export_rows, plain_json
from store.faults import fault_point
from store.fingerprints import code_version
from store.location import RunLocation
from store.run_files import SPEC_FILE, MetricsLog, load_pipeline_state
from store.run_log import TABLE_CONFIG, delta_location, is_conflict
from store.run_store import RunStore
from store.storage import Storage, open_storage

ROUNDS_FROM = {"preference": "pair", "unpaired": "label", "sft": "label", "messages": "label"}
"""Per format, the stage whose commit makes a round exportable."""


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
    """What an appender reads of the table: the table at its newest version (None before the
    first append) and the rounds each run has in it (from every version's provenance)."""

    table: DeltaTable | None
    rounds: dict[str, set[int]]

    @property
    def next_version(self) -> int:
        return 0 if self.table is None else self.table.version() + 1


def read_dataset_log(target: str) -> DatasetLog:
    """The dataset at `target` as `DatasetLog` says."""
    uri, options = delta_location(open_storage(target), "")
    if not DeltaTable.is_deltatable(uri, storage_options=options):
        return DatasetLog(None, {})
    table = DeltaTable(uri, storage_options=options)
    rounds: dict[str, set[int]] = {}
    for commit in table.history():
        info = commit.get("groupforge") or {}
        if isinstance(info, dict) and "run" in info:
            rounds.setdefault(info["run"], set()).update(info.get("rounds") or [])
    return DatasetLog(table, rounds)


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
    store = RunStore(run).snapshot()  # whole commits only
    run_key = RunLocation.of(store.storage).key
    for attempt in range(2):  # the second: after losing to an appender of this run (module docstring)
        log = read_dataset_log(target)
        new = [r for r in finished_rounds(store, cfg) if r not in log.rounds.get(run_key, set())]
        if not new:
            return Appended(target, None)
        rows = plain_json(export_rows(store, cfg.model_copy(update={"rounds": new}), allow_empty=True))
        schema = rows.schema.remove_metadata()
        if not rows.num_rows and log.table is None:
            return Appended(target, None)  # no rows to make the table from yet: those rounds are looked at again
        if log.table is not None and DeltaSchema.from_arrow(schema).to_json() != log.table.schema().to_json():
            raise ValueError(f"--append-to {target}: the table's columns differ from this {cfg.format} "
                             f"({cfg.style}) export's; append to another table")
        fault_point("dataset.rows_built")
        info = _provenance(store, run_key, cfg, new, rows)
        done = (log.table.transaction_version(run_key) if log.table is not None else None)
        properties = CommitProperties(custom_metadata={"groupforge": info},
                                      app_transactions=[Transaction(run_key, 0 if done is None else done + 1)])
        uri, options = delta_location(open_storage(target), "")
        try:
            if log.table is None:  # the first append makes the table; it fails when another made it first
                write_deltalake(uri, rows, mode="error", storage_options=options,
                                configuration=TABLE_CONFIG, commit_properties=properties)
            else:
                write_deltalake(log.table, rows, mode="append",
                                commit_properties=properties)
        except Exception as exc:
            if attempt or not (is_conflict(exc) or (log.table is None and read_dataset_log(target).table)):
                raise
            continue
        return Appended(target, read_dataset_log(target).next_version - 1, new, rows.num_rows)
    raise AssertionError("unreachable")


def _provenance(store: RunStore, run_key: str, cfg: ExportConfig, rounds: list[int], rows: pa.Table) -> dict:
    """commitInfo["groupforge"] of an append (the module docstring)."""
    spec = store.storage.read_if_exists(SPEC_FILE)
    return {"run": run_key, "rounds": rounds, "rows": rows.num_rows, "format": cfg.format, "style": cfg.style,
            "spec_sha256": hashlib.sha256(spec).hexdigest() if spec is not None else None,
            "prompt_files": load_pipeline_state(store.storage).get("prompt_files", []),
            "groupforge": code_version(),
            "export": json.loads(rows.schema.metadata[METADATA_KEY])}
