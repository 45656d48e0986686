"""Each table of a run as a Delta Lake table, kept in step with the run's commit log.

The commit log (curation/store/commit_log.py) is what groupforge reads; the Delta log of each
table folder (`RUN/samples/_delta_log/`, curation/store/delta_log.py) is what other engines
read (Spark, Trino, Polars `scan_delta`, delta-rs, DuckDB's delta extension): after each commit,
every table it changed gets one Delta version adding the commit's new files and removing those
no commit lists any more, with the commit (stage, round, log entry) in the version's
commitInfo. A job killed between the two leaves the Delta table one version behind; the next
writer brings it level (`sync_tables`), so a Delta reader sees whole commits, in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from curation import schema
from curation.store import delta_log
from curation.store.commit_log import LoggedFile, RunState

if TYPE_CHECKING:
    from curation.store.run_store import RunStore


def _table_of(rel: str) -> str:
    return rel.split("/", 1)[0]


def _delta_file(table: str, rel: str, meta: LoggedFile) -> delta_log.DeltaFile:
    path = rel.split("/", 1)[1]
    parts = rel.split("/")
    stats = {}
    if len(parts) == 3 and parts[1].startswith("round="):
        stats = {"round": int(parts[1].removeprefix("round="))}
    return delta_log.DeltaFile(path, meta.size, meta.rows, stats, stats)


def _commit_tables(store: RunStore, added: dict[str, LoggedFile], removed: dict[str, LoggedFile],
                   info: dict) -> None:
    for table in sorted({_table_of(rel) for rel in (*added, *removed)}):
        if table not in schema.SCHEMAS:
            continue
        add = [_delta_file(table, rel, m) for rel, m in sorted(added.items()) if _table_of(rel) == table]
        remove = [_delta_file(table, rel, m) for rel, m in sorted(removed.items()) if _table_of(rel) == table]
        storage = store.storage.child(table)
        version = delta_log.commit(storage, schema.SCHEMAS[table], add=add, remove=remove, info=info)
        if version and version % delta_log.CHECKPOINT_EVERY == 0:
            delta_log.checkpoint(storage)


def mirror_commit(store: RunStore, before: RunState, gone: Iterable[str]) -> None:
    """One Delta version per table the newest commit changed (`before`: the state before it)."""
    after = store.state
    added = {rel: meta for rel, meta in after.files.items() if rel not in before.files}
    removed = {rel: before.files[rel] for rel in gone if rel in before.files}
    stage_round = next(((s, r) for (s, r), seq in after.commits.items() if seq == after.seq), (None, None))
    info = {"stage": stage_round[0], "round": stage_round[1], "log_entry": after.seq}
    _commit_tables(store, added, removed, info)


def delta_files(store: RunStore, table: str) -> set[str]:
    """The files (relative to the run) the table's Delta log has live, replaying its JSON versions."""
    storage = store.storage.child(table)
    live: set[str] = set()
    for entry in storage.list(delta_log.LOG_DIR):
        if not entry.rel.endswith(".json") or not entry.rel.rsplit("/", 1)[-1][:20].isdigit():
            continue
        for line in storage.read(entry.rel).decode().splitlines():
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                live.add(f"{table}/{action['add']['path']}")
            elif "remove" in action:
                live.discard(f"{table}/{action['remove']['path']}")
    return live


def lagging_tables(store: RunStore) -> list[str]:
    """The tables whose Delta log misses the newest commit (a job killed between the two):
    those the newest commit changed whose newest Delta version is not that commit's."""
    last = store.log.last_commit()
    lagging = []
    for table in last.tables if last is not None else ():
        storage = store.storage.child(table)
        version = delta_log.latest_version(storage)
        info = {}
        if version is not None:
            for line in storage.read(f"{delta_log.LOG_DIR}/{version:020d}.json").decode().splitlines():
                action = json.loads(line) if line.strip() else {}
                info = action.get("commitInfo", {}).get("groupforge", info)
        if info.get("log_entry") != last.seq:
            lagging.append(table)
    return lagging


def sync_tables(store: RunStore, tables: Iterable[str] | None = None) -> None:
    """Bring the tables' Delta logs (default: every table's) level with the commit log: one
    version per table that differs."""
    state = store.state
    for table in schema.SCHEMAS if tables is None else tables:
        logged = {rel: meta for rel, meta in state.files.items() if _table_of(rel) == table}
        if not logged and not store.storage.exists(f"{table}/{delta_log.LOG_DIR}/{0:020d}.json"):
            continue
        mirrored = delta_files(store, table)
        added = {rel: meta for rel, meta in logged.items() if rel not in mirrored}
        removed = {rel: LoggedFile("", 0, 0) for rel in mirrored if rel not in logged}
        if added or removed:
            _commit_tables(store, added, removed, {"stage": None, "round": None, "log_entry": state.seq,
                                                   "sync": True})
