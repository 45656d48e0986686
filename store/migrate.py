"""Runs written without `_commits` (store/run_log.py): tables another tool wrote into a
run folder, and run folders of an older groupforge: its own commit log (`RUN/_log/<seq>.json`
beside hand-written Delta logs, run format 2) or, older still, `RUN/_manifests/<stage>-round=<n>.json`.

A reader sees them as their files and logs or manifests say (`unlisted_state`, nothing written);
the first job that writes the run takes them in (`import_unlisted`: each table's Delta log made
to list the live files, a row per old commit, an "import" row for the table files no manifest
lists), and from then on the run is like any other. `groupforge migrate RUN` does only that step.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from store import schema
from store.errors import first_line
from store.layout import PART_FILE, ROUND_DIR
from store.run_log import LoggedFile, RunLog, RunState
from store.storage import Storage

OLD_MANIFESTS = "_manifests"
OLD_LOG = "_log"


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


@dataclass(frozen=True)
class Found:
    """What a run written without `_commits` holds: its commits (stage, round, manifest), its
    live files, and those of them no manifest lists (taken in for good)."""

    commits: list[tuple[str, int, dict]] = field(default_factory=list)
    files: dict[str, LoggedFile] = field(default_factory=dict)
    imported: set[str] = field(default_factory=set)
    retired: dict[str, LoggedFile] = field(default_factory=dict)
    """Files an older commit listed that a later one replaced (kept for the old versions)."""


def _old_log(storage: Storage) -> Found | None:
    """A run of groupforge's run format 2 (RUN/_log/<seq>.json, one entry per commit, each
    listing its files): the newest commit of each stage and round, oldest first, and the live
    files. None when there is no such log."""
    names = sorted(e.rel for e in storage.list(OLD_LOG) if re.fullmatch(rf"{OLD_LOG}/\d{{20}}\.json", e.rel))
    if not names:
        return None
    newest: dict[tuple[str, int], tuple[dict, dict[str, LoggedFile]]] = {}
    imported: dict[str, LoggedFile] = {}
    every: dict[str, LoggedFile] = {}
    for rel in names:
        try:
            entry = json.loads(storage.read(rel))
            files = {path: LoggedFile(f["sha256"], int(f["size"]), int(f["rows"]))
                     for path, f in (entry.get("add") or {}).items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{storage.where(rel)}: not a commit log entry ({exc})") from None
        every.update(files)
        if entry.get("kind") == "commit":
            key = (entry["stage"], int(entry["round"]))
            newest.pop(key, None)  # a later commit of the stage and round: it goes last
            newest[key] = (entry.get("manifest") or {}, files)
        elif entry.get("kind") == "import":
            imported.update(files)
    found = Found(imported=set(imported))
    found.files.update(imported)
    for (stage, round), (manifest, files) in newest.items():
        found.commits.append((stage, round, manifest))
        found.files.update(files)
    found.retired.update({rel: f for rel, f in every.items() if rel not in found.files})
    return found


def unlisted(storage: Storage, skip_ours: bool = False) -> Found:
    """What a run without `_commits` holds: its format-2 commit log's commits, or else its old
    manifests' commits and an import of the table files no manifest lists. `skip_ours`: leave out
    the files no old manifest lists that are named as groupforge names its parts
    (`part-<part>-<sha>.parquet`): in a run whose log holds no commit yet, a killed commit's
    files, which the next writer sweeps."""
    old = _old_log(storage)
    if old is not None:
        return old
    files = _table_files(storage)
    found = Found()
    present = set(files)
    for manifest in _old_manifests(storage):
        outputs = manifest.get("outputs", [])
        missing = [rel for rel in outputs if rel not in present]
        if missing:
            raise ValueError(f"{storage.where(missing[0])}: listed by {OLD_MANIFESTS}/{manifest['stage']}-round="
                             f"{manifest['round']}.json but missing (the run folder is damaged)")
        found.commits.append((manifest["stage"], manifest["round"], manifest))
        for rel in outputs:
            found.files.setdefault(rel, _describe(storage, rel))
    for rel in files:
        if rel not in found.files and not (skip_ours and _ours(rel)):
            found.files[rel] = _describe(storage, rel)
            found.imported.add(rel)
    return found


def _ours(rel: str) -> bool:
    m = PART_FILE.fullmatch(rel.rsplit("/", 1)[-1])
    return bool(m and m["sha"])


def unlisted_state(storage: Storage, skip_ours: bool = False) -> RunState:
    """The state a reader sees of a run with no commit in `_commits` (nothing written;
    `skip_ours` as for `unlisted`)."""
    found = unlisted(storage, skip_ours=skip_ours)
    state = RunState(files=dict(found.files), imported=set(found.imported))
    for stage, round, manifest in found.commits:
        state.manifests[(stage, round)] = dict(manifest)
    state.listed = {rel: f.sha256 for rel, f in found.files.items()}
    return state


def import_unlisted(log: RunLog, storage: Storage) -> int:
    """Take a run written without `_commits` into its log (`RunLog.take_in`); how many commits
    and files it took in. The old commit log (RUN/_log/) is removed once its commits are rows."""
    found = unlisted(storage, skip_ours=any(e.writer != log.writer for e in log.entries()))
    if not found.commits and not found.files:
        return 0
    log.take_in(found.commits, found.files, found.imported, found.retired)
    storage.delete_all(e.rel for e in storage.list(OLD_LOG))
    folder = storage.local_path(OLD_LOG)
    if folder is not None and folder.is_dir():  # a local folder stays behind its files
        shutil.rmtree(folder, ignore_errors=True)
    return len(found.commits) + len(found.imported)
