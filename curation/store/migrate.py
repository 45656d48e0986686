"""Runs written without a commit log: tables another tool wrote into a run folder, and run
folders of an older groupforge (`RUN/_manifests/<stage>-round=<n>.json` beside part files).

A reader sees them as their files and manifests say (`unlisted_state`, nothing written); the
first job that writes the run takes them into its commit log (`import_unlisted`: one entry per
old manifest, then one "import" entry for the table files no manifest lists), and from then on
the run is like any other. `groupforge migrate RUN` does only that step.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from curation import schema
from curation.errors import first_line
from curation.store.commit_log import Entry, LoggedFile, RunState
from curation.store.layout import PART_FILE, ROUND_DIR
from curation.store.storage import Storage

if TYPE_CHECKING:
    from curation.store.run_store import RunStore

OLD_MANIFESTS = "_manifests"


def _describe(storage: Storage, rel: str) -> LoggedFile:
    """A table file's sha256, size and rows; a SchemaError naming it when it is not Parquet (its
    rows cannot be counted, and a reader that trusts the count would never open it)."""
    data = storage.read(rel)
    try:
        rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise schema.SchemaError(f"{rel.split('/', 1)[0]} table ({storage.where(rel)}): not a readable Parquet "
                                 f"file ({first_line(exc)})") from None
    return LoggedFile(hashlib.sha256(data).hexdigest(), len(data), rows)


def _table_files(storage: Storage) -> list[str]:
    """The Parquet files in the table folders (prompts/, <table>/round=<n>/), by path."""
    found = []
    for table in schema.SCHEMAS:
        for entry in storage.list(table):
            parts = entry.rel.split("/")
            if not parts[-1].endswith(".parquet"):
                continue
            if (table == "prompts" and len(parts) == 2) or (len(parts) == 3 and ROUND_DIR.fullmatch(parts[1])):
                found.append(entry.rel)
    return sorted(found)


def _old_manifests(storage: Storage) -> list[dict]:
    """The committed manifests of an older run folder, by stage and round."""
    manifests = []
    for entry in storage.list(OLD_MANIFESTS):
        if not entry.rel.endswith(".json"):
            continue
        try:
            manifest = json.loads(storage.read(entry.rel))
        except ValueError:
            raise ValueError(f"{storage.where(entry.rel)}: not valid JSON (a manifest of an older run folder)"
                             ) from None
        if isinstance(manifest, dict) and isinstance(manifest.get("stage"), str) and isinstance(
                manifest.get("round"), int):
            manifests.append(manifest)
    return sorted(manifests, key=lambda m: (m["round"], m["stage"]))


def unlisted_entries(storage: Storage, writer: str = "import", start: int = 0, skip_ours: bool = False
                     ) -> list[Entry]:
    """The commit log entries that take in a run written without one: its old manifests' commits,
    then an "import" of the table files no manifest lists (none when there are none).
    `skip_ours`: leave out the files no old manifest lists that are named as groupforge names
    its parts (`part-<part>-<sha>.parquet`): in a run whose log holds no commit yet, a killed
    commit's files, which the next writer sweeps."""
    files = _table_files(storage)
    described: dict[str, LoggedFile] = {}

    def describe(rel: str) -> LoggedFile:
        if rel not in described:
            described[rel] = _describe(storage, rel)
        return described[rel]

    entries: list[Entry] = []
    listed: set[str] = set()
    present = set(files)
    for manifest in _old_manifests(storage):
        outputs = manifest.get("outputs", [])
        missing = [rel for rel in outputs if rel not in present]
        if missing:
            raise ValueError(f"{storage.where(missing[0])}: listed by {OLD_MANIFESTS}/{manifest['stage']}-round="
                             f"{manifest['round']}.json but missing (the run folder is damaged)")
        entries.append(Entry(start + len(entries), "commit", writer, str(manifest.get("created_at", "")),
                             manifest["stage"], manifest["round"], manifest, {rel: describe(rel) for rel in outputs}))
        listed.update(outputs)
    rest = [rel for rel in files if rel not in listed and not (skip_ours and _ours(rel))]
    if rest:
        entries.append(Entry(start + len(entries), "import", writer, "", add={rel: describe(rel) for rel in rest}))
    return entries


def _ours(rel: str) -> bool:
    m = PART_FILE.fullmatch(rel.rsplit("/", 1)[-1])
    return bool(m and m["sha"])


def unlisted_state(storage: Storage, skip_ours: bool = False) -> RunState:
    """The state a reader sees of a run with no commit in its log (nothing written; `skip_ours`
    as for `unlisted_entries`)."""
    state = RunState()
    for entry in unlisted_entries(storage, skip_ours=skip_ours):
        state.apply(entry)
    return state


def import_unlisted(store: RunStore) -> int:
    """Append to the run's (new) commit log the entries `unlisted_entries` gives; how many."""
    # this job's "open" is the log's first entry: no earlier job can have left a killed commit
    entries = unlisted_entries(store.storage, store.log.writer or "import", store.log.state.seq + 1,
                               skip_ours=store.log.state.seq > 0)
    for entry in entries:
        if entry.kind == "commit":
            store.log.commit(entry.stage, entry.round, entry.manifest, entry.add)
        else:
            store.log.take_in(entry.add)
    if entries:
        from curation.store.delta_mirror import sync_tables

        sync_tables(store)
    return len(entries)
