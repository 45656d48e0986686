"""A table folder as a Delta Lake table: the transaction log that lets Spark, Trino, Polars,
DuckDB and delta-rs read a run's tables, with versions and time travel, without groupforge.

A Delta table is a folder of Parquet files plus `_delta_log/<version:020d>.json`, one file per
version, each a list of actions (Delta protocol, PROTOCOL.md of delta-io/delta):

    {"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}}          version 0 only
    {"metaData": {"id", "format", "schemaString", "partitionColumns", ...}} version 0 only
    {"add": {"path", "size", "modificationTime", "dataChange", "stats", ...}}  a file joins
    {"remove": {"path", "deletionTimestamp", "dataChange", ...}}           a file leaves
    {"commitInfo": {"timestamp", "operation", ..., "groupforge": {...}}}   who and why

The part files groupforge writes are added as they are (their paths are kept, e.g.
`round=3/part-generate-1a2b3c4d.parquet`); the table is not partitioned in Delta's sense, since
every file holds its `round` column, and each add carries min/max statistics of `round` so that
readers skip the files of other rounds. A version file is written with `Storage.create`
(If-None-Match), so two writers can never both write version n: the loser gets `DeltaConflict`,
on local disk and on every object store.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from curation.store.lock import RunLockedError
from curation.store.storage import Storage

LOG_DIR = "_delta_log"
CHECKPOINT_EVERY = 10
"""delta-rs writes a Parquet checkpoint of the log every this many versions, so a reader
replays at most this many JSON files (bench/table_format.py: opening a table after 200 commits
costs ~4x a plain Parquet read with a checkpoint every 10, ~14-22x with one every 100)."""


class DeltaConflict(RunLockedError):
    """Another writer wrote the version this commit meant to write: another job is writing the
    run (exit 3, as for a run taken over)."""


@dataclass(frozen=True)
class DeltaFile:
    """A data file of the table, by its path relative to the table folder."""

    path: str
    size: int
    rows: int
    min_values: Mapping[str, object] = field(default_factory=dict)
    """Column minimums for the stats (e.g. {"round": 3}); max_values alike."""
    max_values: Mapping[str, object] = field(default_factory=dict)


def _log_name(version: int) -> str:
    return f"{LOG_DIR}/{version:020d}.json"


def latest_version(table: Storage) -> int | None:
    """The newest version of the Delta table at `table` (None: no table yet)."""
    versions = [int(e.rel.rsplit("/", 1)[-1][:20]) for e in table.list(LOG_DIR)
                if e.rel.endswith(".json") and e.rel.rsplit("/", 1)[-1][:20].isdigit()
                and len(e.rel.rsplit("/", 1)[-1]) == 25]
    return max(versions) if versions else None


def _now_ms() -> int:
    return int(time.time() * 1000)


def schema_string(schema: pa.Schema) -> str:
    """`schema` in the Delta log's JSON form (metaData.schemaString)."""
    from deltalake import Schema

    return Schema.from_arrow(schema).to_json()


def _add(file: DeltaFile, now: int) -> dict:
    stats = {"numRecords": file.rows, "minValues": dict(file.min_values), "maxValues": dict(file.max_values),
             "nullCount": {}}
    return {"add": {"path": file.path, "partitionValues": {}, "size": file.size, "modificationTime": now,
                    "dataChange": True, "stats": json.dumps(stats, separators=(",", ":"))}}


def _remove(file: DeltaFile, now: int) -> dict:
    return {"remove": {"path": file.path, "deletionTimestamp": now, "dataChange": True,
                       "extendedFileMetadata": True, "partitionValues": {}, "size": file.size}}


def commit(table: Storage, schema: pa.Schema, add: Sequence[DeltaFile] = (), remove: Sequence[DeltaFile] = (),
           info: Mapping[str, object] | None = None, version: int | None = None) -> int:
    """Write the next version of the Delta table at `table`: `remove` leave it, `add` join it,
    `info` goes under commitInfo's "groupforge" key. `version`: the one to write (default: the
    newest + 1, or 0 with the protocol and `schema` when there is no table yet). Returns it;
    DeltaConflict when another writer wrote that version first."""
    if version is None:
        newest = latest_version(table)
        version = 0 if newest is None else newest + 1
    now = _now_ms()
    actions: list[dict] = []
    if version == 0:
        actions.append({"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}})
        actions.append({"metaData": {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
                                     "schemaString": schema_string(schema), "partitionColumns": [],
                                     "configuration": {}, "createdTime": now}})
    actions.extend(_remove(f, now) for f in remove)
    actions.extend(_add(f, now) for f in add)
    operation = "WRITE" if not remove else "DELETE" if not add else "OVERWRITE"
    actions.append({"commitInfo": {"timestamp": now, "operation": operation, "operationParameters": {},
                                   "engineInfo": "groupforge", "isBlindAppend": not remove,
                                   "groupforge": dict(info or {})}})
    payload = "\n".join(json.dumps(a, separators=(",", ":"), default=str) for a in actions) + "\n"
    if not table.create(_log_name(version), payload.encode()):
        raise DeltaConflict(f"{table.where(_log_name(version))}: another writer wrote version {version} first")
    return version


def checkpoint(table: Storage) -> None:
    """A Parquet checkpoint of the log at its newest version (delta-rs writes it, and
    `_delta_log/_last_checkpoint`), so readers replay at most CHECKPOINT_EVERY JSON files."""
    from deltalake import DeltaTable

    DeltaTable(table.url).create_checkpoint()
