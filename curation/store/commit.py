"""A stage's commit: its outputs for one round appear all at once, or not at all.

    with store.commit(stage, round, inputs, config) as commit:
        commit.write("rejects", table)          # validated, staged under RUN/_tmp/<commit>/
        commit.record(rows_in=..., drops=...)   # counts for the manifest
    # here: part files renamed into place, stale parts of the stage removed, manifest written

A commit through a `RunStore(..., hold=True)` (the round loop's) leaves each part it wrote
in `store.held` (its sha256 and table), so the next stage and the trainer read it from memory.

The manifest (`RUN/_manifests/<stage>-round=<n>.json`) is written last: it is the commit
point. It records each output file's sha256 (hashed while it was written), size and mtime_ns
(`output_files`), so the next stage fingerprints its inputs without reading them again
(`curation.store.fingerprints.known_fingerprint`). A journal (`<stage>-round=<n>.pending`) lists
what is being published, so a process killed half-way leaves no file that the next commit
forgets (see curation/store/run_store.py for the run layout).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation import schema
from curation.errors import disk_write
from curation.faults import fault_point
from curation.store.fingerprints import (
    canonical_json,
    code_version,
    config_hash,
    file_stat,
)
from curation.store.layout import ROUND_TABLES, check_name, check_round
from curation.store.run_store import HeldPart, RunStore
from curation.store.runlog import fsync_dir, read_json, to_json, write_atomic
from curation.store.verify import FORMAT_VERSION, SEAL_FIELD, seal_of

_MANIFEST_FIELDS = {"stage", "round", "inputs", "config", "config_hash", "code_version", "outputs",
                    "output_rows", "output_files", "rows_in", "rows_out", "drops", "created_at",
                    "format_version", SEAL_FIELD}
_COMMIT_ROUND: Any = object()  # default of Commit.write(round=...): the commit's round
SKIPPED_WHEN_EMPTY = frozenset({"rejects"})
"""Tables of which an empty write leaves no part file (no rows dropped: nothing to keep, and a
file fewer to write, sync and fingerprint)."""


@dataclass(frozen=True)
class EncodedPart:
    """One part file's table, validated against its contract and encoded as Parquet (zstd)
    in memory: what a commit writes, known (bytes, rows, sha256) before any file is."""

    table: str
    final: Path
    """Where the commit puts it: RUN/<table>/round=<n>/part-<part>.parquet."""
    rel: str
    data: pa.Table
    payload: pa.Buffer
    sha256: str


def part_file(store: RunStore, stage: str, table: str, part: str | None, round: int | None) -> tuple[Path, str]:
    """(path, path relative to the run) of stage `stage`'s part `part` (default: the stage's
    name) of `table` in `round` (None: prompts, not partitioned)."""
    if table in ROUND_TABLES and round is None:
        raise ValueError(f"the {table} table is partitioned by round; give a round")
    final = store.partition_dir(table, round) / f"part-{check_name(part or stage, 'part')}.parquet"
    return final, final.relative_to(store.root).as_posix()


def encode_part(store: RunStore, stage: str, table: str, data: pa.Table, part: str | None = None,
                round: int | None = None) -> EncodedPart | None:
    """`data` validated as `table` and encoded for stage `stage`'s part file (see `part_file`),
    without touching the disk; None for an empty table of SKIPPED_WHEN_EMPTY (no file)."""
    final, rel = part_file(store, stage, table, part, round)
    data = data if isinstance(data, pa.Table) else pa.table(data)
    data = schema.validate(data, table, source=f"{rel}, written by stage {stage!r}")
    if table in SKIPPED_WHEN_EMPTY and data.num_rows == 0:
        return None
    if round is not None and data.num_rows:
        bounds = pc.min_max(data["round"])
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if (lo, hi) != (round, round):
            raise schema.SchemaError(f"{table} table ({rel}): column 'round' holds {lo}..{hi}, "
                                     f"but it is written to round={round}")
    # Encoded in memory, then hashed and written in one go (a Python file object in between
    # would take pyarrow's many small writes one call at a time: ~2x the write).
    encoded = pa.BufferOutputStream()
    pq.write_table(data, encoded, compression="zstd")
    payload = encoded.getvalue()
    return EncodedPart(table, final, rel, data, payload, hashlib.sha256(payload).hexdigest())


class Commit:
    """Writes one stage's outputs for one round; nothing is visible until the `with` block ends.

    On success: every part file is renamed into place, the stage's earlier part files that
    were not rewritten are deleted, the manifest is written last, and the temporary and
    staging folders are removed. On an exception: nothing is published and it re-raises.
    A pending journal (`_manifests/<stage>-round=<n>.pending`) lists what is being
    published, so a process killed half-way leaves no file that the next commit forgets.
    """

    def __init__(self, store: RunStore, stage: str, round: int, inputs: Mapping[str, str], config: Mapping):
        self.store, self.stage, self.round = store, check_name(stage, "stage"), check_round(round)
        self.inputs = dict(inputs)
        self.config = json.loads(canonical_json(config))  # fails early if not JSON-serialisable
        self._staged: dict[Path, Path] = {}  # final path -> temporary path
        self._rows: dict[str, int] = {}
        self._sha256: dict[str, str] = {}
        self._tables: dict[str, pa.Table] = {}  # the tables to hold in the store (RunStore.hold)
        self._record: dict[str, object] = {"rows_in": None, "rows_out": None, "drops": {}}
        self._owners: dict[bool, dict[str, str]] | None = None  # round table or prompts -> {output: stage}
        self._tmp: Path | None = None
        self._own: set[str] | None = None  # what this stage's manifest and journal list (`_own_outputs`)
        self._inside: set[Path] = set()  # table folders checked to resolve inside the run folder
        self._root_resolved = store.root.resolve()

    def __enter__(self) -> Commit:
        prefix = f"{self.stage}-round={self.round}-"
        tmp_root = self.store.root / "_tmp"
        # Callers hold the run's lock: a temp folder of this stage and round is a killed commit's
        # (its staged parts, a large round's slices), never one in progress.
        try:
            stale = [entry.path for entry in os.scandir(tmp_root) if entry.name.startswith(prefix)]
        except FileNotFoundError:
            stale = []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        self._tmp = tmp_root / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp.mkdir(parents=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self._publish()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        return False

    def write(self, table: str, data: pa.Table, part: str | None = None,
              round: int | None = _COMMIT_ROUND, hold: bool = True) -> None:
        """Validate `data` as `table` and stage it as `part-<part>.parquet` (default part: the stage).

        `data` is a pyarrow Table or anything `pa.table` accepts (a polars DataFrame, a dict).
        An empty table of `SKIPPED_WHEN_EMPTY` (rejects) is validated and writes no file.
        `hold=False`: the table is not kept in the store's `held` parts even when the store
        holds them (a stage writing a large round slice by slice, so memory holds one slice).
        """
        if self._tmp is None:
            raise RuntimeError("Commit.write must be called inside `with store.commit(...)`")
        if round is _COMMIT_ROUND:
            round = None if table == "prompts" else self.round
        final, rel = part_file(self.store, self.stage, table, part, round)
        self._check_target(final, rel)
        encoded = encode_part(self.store, self.stage, table, data, part, round)
        if encoded is not None:  # None: an empty rejects table, no file (an earlier attempt's is stale)
            self._stage_file(encoded, hold)

    def _check_target(self, final: Path, rel: str) -> None:
        """A part file this commit may write: inside the run folder, once, not another stage's."""
        self._check_inside(final.parent, rel)
        if final in self._staged:
            raise ValueError(f"{rel} is written twice in one commit of stage {self.stage!r}")
        owner = self._owner(rel)
        if owner is not None and owner != self.stage:
            raise ValueError(f"{rel} belongs to stage {owner!r}; "
                             f"stage {self.stage!r} must write another part name")

    def _stage_file(self, encoded: EncodedPart, hold: bool) -> None:
        tmp = self._tmp / f"{len(self._staged):06d}.parquet"  # flat: no folders to make and remove
        with disk_write(encoded.final), open(tmp, "wb") as f:  # a full disk names the table folder
            f.write(encoded.payload)
            f.flush()
            os.fsync(f.fileno())
        self._staged[encoded.final] = tmp
        self._rows[encoded.rel] = encoded.data.num_rows
        self._sha256[encoded.rel] = encoded.sha256
        if hold and self.store.hold:
            self._tables[encoded.rel] = encoded.data

    def _check_inside(self, folder: Path, rel: str) -> None:
        """Refuse a table folder that resolves outside the run folder (a symlink), once per folder."""
        if folder in self._inside:
            return
        inside = folder.resolve()
        if not inside.is_relative_to(self._root_resolved):
            raise ValueError(f"{rel}: the folder resolves to {inside}, outside the run folder {self.store.root} "
                             "(a symlink?); refusing to write there")
        self._inside.add(folder)

    def scratch(self, name: str) -> Path:
        """A path in this commit's temp folder (removed with it, whatever happens) for files a
        stage needs while it writes, e.g. a large round split into slices."""
        if self._tmp is None:
            raise RuntimeError("Commit.scratch must be called inside `with store.commit(...)`")
        return self._tmp / check_name(name, "scratch")

    def record(self, rows_in: int | None = None, rows_out: int | None = None,
               drops: Mapping[str, int] | None = None, **extra) -> None:
        """Row counts, drop counts per reason, and any extra JSON fields for the manifest."""
        clash = _MANIFEST_FIELDS & extra.keys()
        if clash:
            raise ValueError(f"extra manifest keys clash with standard fields: {sorted(clash)}")
        if rows_in is not None:
            self._record["rows_in"] = int(rows_in)
        if rows_out is not None:
            self._record["rows_out"] = int(rows_out)
        if drops is not None:
            self._record["drops"] = {str(k): int(v) for k, v in drops.items()}
        self._record.update(json.loads(to_json(extra)))  # fails here, not while publishing

    def _manifests(self, round_table: bool) -> list[Path]:
        """The manifests and pending journals that can list a file of this commit: those of
        its round for a round table (a part file of round n is only ever written in round n),
        every one for prompts (not partitioned by round)."""
        if round_table:
            return sorted(self.store.round_manifests(self.round) + self.store.round_manifests(self.round, ".pending"))
        return [path for path in sorted((self.store.root / "_manifests").glob("*"))
                if path.suffix in (".json", ".pending")]

    def _owner(self, rel: str) -> str | None:
        """The stage whose manifest (or pending journal) lists `rel`, if any; looked up only
        when the file exists or a journal is pending (a new file has no owner)."""
        round_table = Path(rel).parts[0] != "prompts"
        if not (self.store.root / rel).exists() and not self._journals_pending():
            return None
        if rel in self._own_outputs():
            return self.stage  # rewritten by its own stage: the usual case, no scan of the others
        if self._owners is None or round_table not in self._owners:
            self._owners = self._owners or {}
            found: dict[str, str] = {}
            for path in self._manifests(round_table):
                manifest = read_json(path) or {}
                for out in manifest.get("outputs", []):
                    found[out] = manifest.get("stage")
            self._owners[round_table] = found
        return self._owners[round_table].get(rel)

    def _journals_pending(self) -> bool:
        """Whether a commit's journal other than this one's is pending (`RunStore.pending_journals`)."""
        own = self.store.pending_path(self.stage, self.round)
        return any(path != own and path.exists() for path in self.store.pending_journals())

    def _own_outputs(self) -> set[str]:
        """What this stage's manifest and journal for the round list."""
        if self._own is None:
            self._own = set()
            for earlier in (self.store.load_manifest(self.stage, self.round),
                            read_json(self.store.pending_path(self.stage, self.round))):
                self._own.update((earlier or {}).get("outputs", []))
        return self._own

    def _listed_elsewhere(self, candidates: set[str]) -> set[str]:
        """The `candidates` that another manifest lists too (a prompts part shared by rounds)."""
        if not candidates:
            return set()
        mine = {self.store.manifest_path(self.stage, self.round), self.store.pending_path(self.stage, self.round)}
        prompts = any(Path(rel).parts[0] == "prompts" for rel in candidates)
        listed: set[str] = set()
        for path in self._manifests(round_table=not prompts):
            if path not in mine:
                listed.update((read_json(path) or {}).get("outputs", []))
        return candidates & listed

    def _publish(self) -> None:
        store, root = self.store, self.store.root
        manifest_path = store.manifest_path(self.stage, self.round)
        journal_path = store.pending_path(self.stage, self.round)
        before = set()
        for earlier in (store.load_manifest(self.stage, self.round), read_json(journal_path)):
            before.update((earlier or {}).get("outputs", []))
        before = {rel for rel in before if _is_part_file(rel)}  # never delete anything else
        outputs = sorted(self._rows)
        journal = {"stage": self.stage, "round": self.round, "outputs": sorted(before | set(outputs))}
        write_atomic(journal_path, to_json(journal), tmp_dir=self._tmp)
        fault_point("commit.journal_written")
        touched = set()
        files = {}
        for final, tmp in self._staged.items():
            if not final.parent.is_dir():
                final.parent.mkdir(parents=True)
                touched.add(final.parent.parent)  # a new partition folder
            os.replace(tmp, final)  # overwrites a stale part of an interrupted attempt
            touched.add(final.parent)
            rel = final.relative_to(root).as_posix()
            files[rel] = {"sha256": self._sha256[rel], **file_stat(final)}  # a rename keeps size and mtime
        stale = before - set(outputs)
        for rel in stale - self._listed_elsewhere(stale):
            store.held.pop(rel, None)
            (root / rel).unlink(missing_ok=True)
            if (root / rel).parent.is_dir():
                touched.add((root / rel).parent)
        for folder in touched:
            fsync_dir(folder)
        content = json.loads(to_json({
            "stage": self.stage, "round": self.round, "inputs": self.inputs, "config": self.config,
            "config_hash": config_hash(self.config), "code_version": code_version(), "format_version": FORMAT_VERSION,
            "outputs": outputs, "output_rows": self._rows, "output_files": files,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **self._record,
        }))
        manifest = to_json({**content, SEAL_FIELD: seal_of(content)})  # a hand edit shows (store/verify.py)
        fault_point("commit.files_published")
        write_atomic(manifest_path, manifest, tmp_dir=self._tmp)  # last: the commit point
        journal_path.unlink()
        for rel in outputs:
            if rel in self._tables:
                store.held[rel] = HeldPart(self._sha256[rel], self._tables[rel])
            else:
                store.held.pop(rel, None)
        shutil.rmtree(root / "_staging" / f"{self.stage}-round={self.round}", ignore_errors=True)


def _is_part_file(rel: str) -> bool:
    parts = Path(rel).parts
    return (len(parts) in (2, 3) and parts[0] in schema.SCHEMAS and ".." not in parts
            and parts[-1].startswith("part-") and parts[-1].endswith(".parquet"))
