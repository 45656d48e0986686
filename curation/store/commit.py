"""A stage's commit: its outputs for one round appear all at once, or not at all.

    with store.commit(stage, round, inputs, config) as commit:
        commit.write("rejects", table)          # validated, written under its final name
        commit.record(rows_in=..., drops=...)   # counts for the manifest
    # here: each table written got a Delta version, then the commit's row in _commits (the
    # commit point); the stage's earlier parts for the round left the live files (kept for
    # earlier versions of the run)

Each part file is written under a name no other bytes can have (`part-<part>-<sha>.parquet`,
curation/store/layout.py), straight to the run's storage: no temporary file and no rename,
which object stores do not have. Nothing lists it until its table's Delta version and the
commit's row in `_commits` are written (curation/store/run_log.py), so a reader sees the commit
whole or not at all; a kill before that point leaves files that nobody lists, which the next
writer sweeps, and table versions that no row records, which it restores away.

The manifest in the row records each output's sha256, size and rows, so the next stage
fingerprints its inputs without reading them again. A commit through a `RunStore(...,
hold=True)` (the round loop's) leaves each part it wrote in `store.held` (its sha256 and
table), so the next stage and the trainer read it from memory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation import schema
from curation.faults import fault_point
from curation.store.fingerprints import canonical_json, code_version, config_hash
from curation.store.layout import ROUND_TABLES, check_name, check_round, part_name, part_rel
from curation.store.run_log import LoggedFile
from curation.store.run_store import HeldPart, RunStore
from curation.store.runlog import to_json
from curation.store.tidy import check_inside
from curation.store.verify import FORMAT_VERSION, SEAL_FIELD, seal_of

_MANIFEST_FIELDS = {"stage", "round", "inputs", "config", "config_hash", "code_version", "outputs",
                    "output_rows", "output_files", "rows_in", "rows_out", "drops", "created_at",
                    "format_version", SEAL_FIELD}
_COMMIT_ROUND: Any = object()  # default of Commit.write(round=...): the commit's round
SKIPPED_WHEN_EMPTY = frozenset({"rejects"})
"""Tables of which an empty write leaves no part file (no rows dropped: nothing to keep, and a
file fewer to write and fingerprint)."""


@dataclass(frozen=True)
class EncodedPart:
    """One part file's table, validated against its contract and encoded as Parquet (zstd)
    in memory: what a commit writes, known (bytes, rows, sha256) before anything is written."""

    table: str
    rel: str
    """Where the commit puts it, relative to the run: <table>/round=<n>/part-<part>-<sha>.parquet."""
    data: pa.Table
    payload: pa.Buffer
    sha256: str


def encode_part(stage: str, table: str, data: pa.Table, part: str | None = None,
                round: int | None = None) -> EncodedPart | None:
    """`data` validated as `table` and encoded for stage `stage`'s part `part` (default: the
    stage's name) of `round` (None: prompts); None for an empty table of SKIPPED_WHEN_EMPTY."""
    if table in ROUND_TABLES and round is None:
        raise ValueError(f"the {table} table is partitioned by round; give a round")
    if table not in ROUND_TABLES and round is not None:
        raise ValueError(f"the {table} table is not partitioned by round; give round=None")
    part = check_name(part or stage, "part")
    where = f"{table}/{'' if round is None else f'round={round}/'}part-{part}"
    data = data if isinstance(data, pa.Table) else pa.table(data)
    data = schema.validate(data, table, source=f"{where}, written by stage {stage!r}")
    if table in SKIPPED_WHEN_EMPTY and data.num_rows == 0:
        return None
    if round is not None and data.num_rows:
        bounds = pc.min_max(data["round"])
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if (lo, hi) != (round, round):
            raise schema.SchemaError(f"{table} table ({where}): column 'round' holds {lo}..{hi}, "
                                     f"but it is written to round={round}")
    encoded = pa.BufferOutputStream()
    pq.write_table(data, encoded, compression="zstd")
    payload = encoded.getvalue()
    sha256 = hashlib.sha256(payload).hexdigest()
    return EncodedPart(table, part_rel(table, round, part, sha256), data, payload, sha256)


class Commit:
    """Writes one stage's outputs for one round; nothing is visible until the `with` block ends.

    On success: every touched table gets a Delta version and `_commits` a row (the commit
    point), the stage's earlier files for the round leave the live files (they stay on storage
    for earlier versions of the run), and the stage's staging folder is removed. On an exception:
    the files written are deleted (best effort; nothing lists them) and it re-raises.
    """

    def __init__(self, store: RunStore, stage: str, round: int, inputs: Mapping[str, str], config: Mapping):
        self.store, self.stage, self.round = store, check_name(stage, "stage"), check_round(round)
        self.inputs = dict(inputs)
        self.config = json.loads(canonical_json(config))  # fails early if not JSON-serialisable
        self._files: dict[str, LoggedFile] = {}
        self._written: list[str] = []  # files this commit wrote (not those it found live already)
        self._tables: dict[str, pa.Table] = {}  # the tables to hold in the store (RunStore.hold)
        self._record: dict[str, object] = {"rows_in": None, "rows_out": None, "drops": {}}
        self._scratch: Path | None = None
        self._open = False  # inside the `with` block: writes are taken
        self._folders: set[str] = set()  # folders checked to lie inside a local run folder

    def __enter__(self) -> Commit:
        self.store.open_for_writing()
        self._open = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._open = False
        try:
            if exc_type is None:
                self._publish()
            else:
                self.store.storage.delete_all(self._written)
        finally:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
        return False

    def write(self, table: str, data: pa.Table, part: str | None = None,
              round: int | None = _COMMIT_ROUND, hold: bool = True) -> None:
        """Validate `data` as `table` and write it as part `part` (default: the stage's name).

        `data` is a pyarrow Table or anything `pa.table` accepts (a polars DataFrame, a dict).
        An empty table of `SKIPPED_WHEN_EMPTY` (rejects) is validated and writes no file.
        `hold=False`: the table is not kept in the store's `held` parts even when the store
        holds them (a stage writing a large round slice by slice, so memory holds one slice).
        """
        if not self._open:
            raise RuntimeError("Commit.write must be called inside `with store.commit(...)`")
        if round is _COMMIT_ROUND:
            round = None if table == "prompts" else self.round
        encoded = encode_part(self.stage, table, data, part, round)
        if encoded is None:
            return
        named = _unhashed(encoded.rel)
        if any(_unhashed(rel) == named for rel in self._files):
            raise ValueError(f"part {named} is written twice in one commit of stage {self.stage!r}")
        owner = self._owner(named, round)
        if owner is not None:
            raise ValueError(f"part {named} belongs to stage {owner!r}; stage {self.stage!r} must write another "
                             "part name")
        if _unhashed(encoded.rel).rpartition("/")[0] not in self._folders:
            check_inside(self.store, encoded.rel)
            self._folders.add(_unhashed(encoded.rel).rpartition("/")[0])
        if encoded.rel not in self.store.state.files:
            self.store.storage.write(encoded.rel, encoded.payload)
            self._written.append(encoded.rel)
        elif not self.store.storage.exists(encoded.rel):  # live, but lost since: written again
            self.store.storage.write(encoded.rel, encoded.payload)
        self._files[encoded.rel] = LoggedFile(encoded.sha256, encoded.payload.size, encoded.data.num_rows)
        if hold and self.store.hold:
            self._tables[encoded.rel] = encoded.data

    def _owner(self, named: str, round: int | None) -> str | None:
        """The other stage whose newest commit lists a file of the part `named` (folder and
        part name, e.g. `rejects/round=0/part-filter`): of the same round for a round table,
        of any round for prompts. A stage's parts are told apart by their name (a stage that
        reads a table it writes leaves its own parts out), so two stages never share one."""
        for (stage, r), manifest in self.store.state.manifests.items():
            if stage == self.stage or (round is not None and r != round):
                continue
            if any(_unhashed(rel) == named for rel in manifest.get("outputs", [])):
                return stage
        return None

    def scratch(self, name: str) -> Path:
        """A local path (removed with the commit, whatever happens) for files a stage needs
        while it writes, e.g. a large round split into slices."""
        if not self._open:
            raise RuntimeError("Commit.scratch must be called inside `with store.commit(...)`")
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix=f"gf-{self.stage}-{self.round}-"))
        return self._scratch / check_name(name, "scratch")

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

    def _publish(self) -> None:
        store = self.store
        outputs = sorted(self._files)
        content = json.loads(to_json({
            "stage": self.stage, "round": self.round, "inputs": self.inputs, "config": self.config,
            "config_hash": config_hash(self.config), "code_version": code_version(), "format_version": FORMAT_VERSION,
            "outputs": outputs, "output_rows": {rel: f.rows for rel, f in self._files.items()},
            "output_files": {rel: {"sha256": f.sha256, "size": f.size} for rel, f in self._files.items()},
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **self._record,
        }))
        manifest = {**content, SEAL_FIELD: seal_of(content)}  # a hand edit shows (store/verify.py)
        fault_point("commit.files_published")
        with store.job.lock:  # a sibling store of this job (another thread) commits in turn
            store.catch_up()
            gone = store.log.commit(self.stage, self.round, manifest, self._files)  # the commit point
            store.job.seq = store.log.state.seq
            fault_point("commit.logged")
            for rel in outputs:
                if rel in self._tables:
                    store.held[rel] = HeldPart(self._files[rel].sha256, self._tables[rel])
                else:
                    store.held.pop(rel, None)
        for rel in gone:  # kept on storage for earlier versions of the run (RunState.retired)
            store.held.pop(rel, None)
        staging = store.staging(self.stage, self.round)
        staging.delete_all(e.rel for e in staging.list())
        folder = staging.local_path()
        if folder is not None:  # a local folder stays behind its files
            shutil.rmtree(folder, ignore_errors=True)


def _unhashed(rel: str) -> str:
    """A part file's folder and part name, without its hash: `samples/round=0/part-generate`."""
    return f"{rel.rpartition('/')[0]}/part-{part_name(rel)}"
