"""Is a run what its log says? `check_run(RUN)` before a command reads or extends it.

A run is shared with people and tools: a part file can be cut short by a copy, a log entry
edited by hand, a Parquet file dropped into a table folder (every reader that globs
`RUN/<table>/**/*.parquet` would count its rows), or the run written by a newer groupforge.
Each of these is a `RunFolderError` (a ValueError: exit 2 in the CLI) naming the file and the
problem, raised before anything is read or written:

    log        an entry that is not JSON; a manifest with a `format_version` newer than
               FORMAT_VERSION, or whose `seal` (sha256 of its other fields, written by the
               commit) no longer matches
    outputs    a live file (one the log lists) is missing or its size differs from what its
               commit recorded (`deep`: its sha256 too)
    links      an entry of a local run folder (or a round folder) that is a symlink leading out
               of it: no write of a job may land outside the run folder
    foreign    a *.parquet file in a table folder that the log does not list (live, or retired:
               kept for earlier versions) and that is not a killed commit's (those are named
               `part-<part>-<sha>.parquet` after their bytes; the next writer sweeps them)

A run written without `_commits` (other tools, an older groupforge) is checked as
store/migrate.py reads it. Cost: one listing per table folder, one JSON read per log
entry (`deep` reads and hashes every live file).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from store import schema
from store.layout import FORMAT_VERSION, PART_FILE, SEAL_FIELD, RunFolderError, check_links, seal_of
from store.migrate import OLD_MANIFESTS
from store.run_store import RunStore
from store.storage import LocalStorage, Storage, open_storage


@dataclass
class RunCheck:
    manifests: int = 0
    files: int = 0
    bytes: int = 0
    orphans: int = 0
    """Files of killed commits (listed by no entry; the next writer removes them)."""
    retired: int = 0
    """Files of earlier versions of the run (replaced by a later commit; kept for time travel)."""


def check_run(root: str | Path | Storage, deep: bool = False) -> RunCheck:
    """Check the run at `root` (see the module docstring); what was checked, or a RunFolderError."""
    storage = root if isinstance(root, Storage) else open_storage(root)
    if isinstance(storage, LocalStorage):
        check_links(storage.root)
    store = RunStore(storage)
    try:
        state = store.state
    except ValueError as exc:
        raise RunFolderError(str(exc)) from None
    result = RunCheck()
    for (stage, round), manifest in sorted(state.manifests.items()):
        if store.logged:  # the log entry of the stage's newest commit for the round
            seq = state.commits[(stage, round)]
            where = f"{storage.where(store.log.row_file(seq))}, row {seq} (the manifest of {stage} round {round})"
        else:
            where = storage.where(f"{OLD_MANIFESTS}/{stage}-round={round}.json")
        result.manifests += 1
        version = manifest.get("format_version", 1)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise RunFolderError(f"{where}: written by a newer groupforge (run format {version}; this one reads "
                                 f"up to {FORMAT_VERSION}): upgrade groupforge to read this run")
        if SEAL_FIELD in manifest and manifest[SEAL_FIELD] != seal_of(manifest):
            raise RunFolderError(f"{where}: edited after its commit (its seal does not match its content); "
                                 "restore it, or rerun the stage with --force to write it again")
    listed = {e.rel: e.size for table in schema.SCHEMAS for e in storage.list(table)}
    for rel, meta in sorted(state.files.items()):
        where = storage.where(rel)
        if rel not in listed:
            raise RunFolderError(f"{where}: listed by the run's log but missing")
        if listed[rel] != meta.size:
            raise RunFolderError(f"{where}: {listed[rel]:,} bytes, but its commit recorded {meta.size:,} "
                                 "(truncated or replaced after its commit)")
        if deep and hashlib.sha256(storage.read(rel)).hexdigest() != meta.sha256:
            raise RunFolderError(f"{where}: its sha256 differs from the one its commit recorded "
                                 "(changed after its commit)")
        result.files += 1
        result.bytes += meta.size
    for rel in sorted(listed):
        name = rel.rsplit("/", 1)[-1]
        if rel in state.files or not name.endswith(".parquet") or "/_delta_log/" in f"/{rel}":
            continue
        if rel in state.retired:
            result.retired += 1
            continue
        m = PART_FILE.fullmatch(name)
        if m and m["sha"] and hashlib.sha256(storage.read(rel)).hexdigest()[:16] == m["sha"]:
            result.orphans += 1
            continue
        raise RunFolderError(f"{storage.where(rel)}: a Parquet file in the {rel.split('/', 1)[0]} table folder "
                             "that the run's log does not list (a foreign file: a reader that globs the "
                             "table folder would count its rows); move it out of the run folder")
    return result
