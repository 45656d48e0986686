"""The run's log: each table of a run is a Delta Lake table written through deltalake, and one
more Delta table, `RUN/_commits/`, holds a row per commit. Nothing else records what is live.

    RUN/<table>/_delta_log/   one Delta version per commit that changed the table: its part files
                              added, the stage's earlier ones for the round removed; the commit's
                              stage, round and seq in commitInfo ("groupforge"), and an app
                              transaction "<stage>@round=<n>" whose version is that seq
    RUN/_commits/             a Delta table, a row per commit: seq, kind (open | commit | import),
                              writer, at, stage, round, manifest (JSON), versions (JSON: each
                              table's Delta version once the commit is made)

Why a table of commits: Delta commits one table at a time, and one stage's commit of a round can
change several tables (filter writes groups and rejects). The commit's row, appended after its
tables' versions, is its commit point: groupforge reads each table at the version the newest row
records, so a reader sees a stage's outputs whole or not at all. A job killed between a table's
version and the row leaves that table ahead of the row; the next writer restores the table to
the recorded version (`DeltaTable.restore`) before it writes. A reader of one table through Delta
itself (Polars, Spark, DuckDB) sees the table's newest version, which may be a stage's write
whose other tables are not written yet (docs/reliability.md).

Two writers: every append to `_commits` is conditional on the version this job last read
(`max_commit_retries=0`). A job appends an "open" row when it opens a run on an object store
(`open(claim=True)`: no lock reaches the other machines), else before its first write to the log
(a commit, an import or a restore), so an older job's next append fails and it stops with
`RunTakenOver` (exit 3): the newest job goes on. A job on local disk that writes nothing to a
run that has rows leaves no row.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from store import schema
from store.errors import JobError, is_no_space, no_space_error
from store.faults import fault_point
from store.lock import RunLockedError
from store.storage import LocalStorage, Storage
from store.store_errors import retry_config, store_error

COMMITS = "_commits"
COMPACT_EVERY = 100
"""Every this many rows the `_commits` table's small files are compacted into one, so a new
reader of a long run reads a few files, not one per commit."""
TABLE_CONFIG = {"delta.checkpointInterval": "10", "delta.enableExpiredLogCleanup": "false"}
"""A Parquet checkpoint of each Delta log every 10 versions, so a reader replays at most ten
JSON files (bench/table_format.py: ~4x a plain Parquet read after 200 commits, 14-22x at 100).
No expired-log cleanup after each commit: it looks for log files past their retention at every
commit (about half of a commit's time on an object store) to delete what time travel reads;
every version of a run's tables (and of an export's dataset) stays readable
(`DeltaTable.cleanup_metadata` deletes them by hand)."""

COMMITS_CONFIG = {**TABLE_CONFIG, "delta.dataSkippingNumIndexedCols": "2"}
"""`_commits` keeps file statistics of seq and kind only: not of the manifests' long JSON."""

ROWS = pa.schema([
    pa.field("seq", pa.int64(), nullable=False), pa.field("kind", pa.string(), nullable=False),
    pa.field("writer", pa.string(), nullable=False), pa.field("at", pa.string(), nullable=False),
    pa.field("stage", pa.string()), pa.field("round", pa.int64()), pa.field("manifest", pa.string()),
    pa.field("versions", pa.string(), nullable=False),
])


class RunTakenOver(RunLockedError):
    """Another job opened the run since this job last committed (exit 3, as a locked run)."""


@dataclass(frozen=True)
class LoggedFile:
    """A live part file of the run: its sha256 (from its commit's manifest), size and rows."""

    sha256: str
    size: int
    rows: int


@dataclass(frozen=True)
class Entry:
    """A row of `_commits`: a stage's commit of a round, a job starting to write ("open"), or
    files taken in from a run written without this log ("import")."""

    seq: int
    kind: str
    writer: str
    at: str
    stage: str | None = None
    round: int | None = None
    manifest: Mapping[str, Any] = field(default_factory=dict)
    """The stage's manifest: inputs, config and its hash, outputs with their sha256 and rows,
    counts, code version. An import's lists the files it takes in."""
    versions: Mapping[str, int] = field(default_factory=dict)
    """Each table's Delta version once this row is written: what readers read."""

    def row(self) -> dict:
        return {"seq": self.seq, "kind": self.kind, "writer": self.writer, "at": self.at, "stage": self.stage,
                "round": self.round, "manifest": json.dumps(dict(self.manifest), sort_keys=True, default=str),
                "versions": json.dumps(dict(sorted(self.versions.items())))}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Entry:
        return cls(int(row["seq"]), row["kind"], row["writer"], row["at"], row["stage"], row["round"],
                   json.loads(row["manifest"] or "{}"), json.loads(row["versions"]))


@dataclass
class RunState:
    """The run after row `seq` of `_commits` (-1: none yet)."""

    seq: int = -1
    versions: dict[str, int] = field(default_factory=dict)
    """Each table's Delta version to read."""
    files: dict[str, LoggedFile] = field(default_factory=dict)
    """The live part files (path relative to the run): the tables' files at `versions`."""
    manifests: dict[tuple[str, int], dict] = field(default_factory=dict)
    """(stage, round) -> the manifest of the stage's newest commit of the round."""
    commits: dict[tuple[str, int], int] = field(default_factory=dict)
    """(stage, round) -> the seq of that commit."""
    writer: str | None = None
    """The job that opened the run last."""
    listed: dict[str, str] = field(default_factory=dict)
    """Every file any commit or import listed -> its sha256 (live or replaced: replaced files are
    kept for earlier versions of the run until vacuumed)."""
    imported: set[str] = field(default_factory=set)
    """Files an import took in: live for good."""

    @property
    def retired(self) -> set[str]:
        """Files that were live and are not any more (kept for earlier versions of the run)."""
        return set(self.listed) - set(self.files)

    def apply(self, entry: Entry) -> None:
        """Fold one row in (the files are the tables', read at `versions`)."""
        if entry.seq != self.seq + 1:
            raise ValueError(f"{COMMITS}: row {entry.seq} read after {self.seq}")
        self.seq = entry.seq
        self.versions = dict(entry.versions)
        if entry.kind == "open":
            self.writer = entry.writer
        for rel, meta in (entry.manifest.get("output_files") or {}).items():
            self.listed[rel] = meta["sha256"]
        if entry.kind == "import":
            self.imported.update(entry.manifest.get("outputs", []))
        elif entry.kind == "commit" and entry.stage is not None and entry.round is not None:
            self.manifests[(entry.stage, entry.round)] = dict(entry.manifest)
            self.commits[(entry.stage, entry.round)] = entry.seq

    def replaced(self, stage: str, round: int, outputs: Iterable[str]) -> list[str]:
        """The files that leave the live set when `stage` commits `outputs` for `round`: its
        earlier outputs for the round that no other stage's newest commit (nor an import) lists."""
        keep = set(outputs) | self.imported
        for key, manifest in self.manifests.items():
            if key != (stage, round):
                keep.update(manifest.get("outputs", []))
        earlier = (self.manifests.get((stage, round)) or {}).get("outputs", [])
        return sorted(rel for rel in earlier if rel not in keep and rel in self.files)

    def copy(self) -> RunState:
        return RunState(self.seq, dict(self.versions), dict(self.files), dict(self.manifests), dict(self.commits),
                        self.writer, dict(self.listed), set(self.imported))


def new_writer_id() -> str:
    """host:pid:random, naming a writing job in the log."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def delta_location(storage: Storage, rel: str) -> tuple[str, dict[str, str] | None]:
    """The table folder `rel` as deltalake opens it: a path or URL, and its storage options (an
    object store's non-secret settings; credentials come from the environment, as for obstore)."""
    if isinstance(storage, LocalStorage):
        return str((storage.root / rel if rel else storage.root).absolute()), None
    options = {key: str(value).lower() if isinstance(value, bool) else str(value)
               for key, value in getattr(storage, "options", {}).items() if key != "retry_config"}
    retry = retry_config()  # the same bounded retries as obstore's requests
    options["retry_timeout"] = f"{retry['retry_timeout'].total_seconds()}s"
    options["backoff_config.max_backoff"] = f"{retry['backoff']['max_backoff'].total_seconds()}s"
    return f"{storage.url.rstrip('/')}/{rel}" if rel else storage.url.rstrip("/"), options


def is_conflict(exc: BaseException) -> bool:
    from deltalake.exceptions import CommitFailedError

    return isinstance(exc, CommitFailedError)


@contextmanager
def delta_errors(storage: Storage, rel: str, action: str) -> Iterator[None]:
    """deltalake's failures as the storage's own (its errors carry the store's text): a full disk
    is a NoSpaceError, an object store's refusal one StorageError line; a conflict and anything
    else pass through."""
    start = time.monotonic()
    try:
        yield
    except Exception as exc:
        if isinstance(exc, (JobError, RunLockedError)) or is_conflict(exc):
            raise
        local = storage.local_path(rel)
        if is_no_space(exc):
            raise no_space_error(local) from exc
        if local is None:
            raise store_error(storage.url, storage.where(rel), action, exc, took=time.monotonic() - start) from exc
        raise


class RunLog:
    """The Delta log of the run at `storage`, and the state this object has read of it. Holds
    one DeltaTable per table it has opened (explicit state of this object, not a process cache)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.state = RunState()
        self.writer: str | None = None
        """This job's id once it has opened the run (`open`)."""
        self.opened = False
        """Whether this job's "open" row is in `_commits` (written before its first write)."""
        self._handles: dict[str, Any] = {}  # table folder -> DeltaTable at the newest version known
        self._read_paths: set[str] = set()  # `_commits` files whose rows this object has read
        self._entries: list[Entry] = []  # every row read, oldest first
        self._row_files: dict[int, str] = {}  # seq -> the `_commits` file it was read from

    def fork(self) -> RunLog:
        """Another RunLog of this job on the run (a thread's: `RunStore.sibling`): the same writer,
        a copy of the state and rows read, its own table handles."""
        other = RunLog(self.storage)
        other.writer, other.state, other.opened = self.writer, self.state.copy(), self.opened
        other._entries, other._read_paths = list(self._entries), set(self._read_paths)
        other._row_files = dict(self._row_files)
        return other

    # -- the tables
    def handle(self, rel: str):
        """The DeltaTable at folder `rel` (None when there is none), opened once."""
        from deltalake import DeltaTable

        if rel not in self._handles:
            uri, options = delta_location(self.storage, rel)
            with delta_errors(self.storage, rel, "listing"):  # is_deltatable lists the table's log
                if not DeltaTable.is_deltatable(uri, storage_options=options):
                    return None
                self._handles[rel] = DeltaTable(uri, storage_options=options)
        return self._handles[rel]

    def _create(self, rel: str, arrow_schema: pa.Schema):
        from deltalake import DeltaTable

        uri, options = delta_location(self.storage, rel)
        config = COMMITS_CONFIG if rel == COMMITS else TABLE_CONFIG
        try:
            with delta_errors(self.storage, rel, "writing"):
                self._handles[rel] = DeltaTable.create(uri, arrow_schema, mode="ignore", configuration=config,
                                                   storage_options=options)
        except Exception as exc:
            if not is_conflict(exc):  # another job created it first: it is there now
                raise
            self._handles[rel] = DeltaTable(uri, storage_options=options)
        return self._handles[rel]

    def _files_at(self, table: str, version: int) -> dict[str, tuple[int, int]]:
        """{rel: (size, rows)} of the table's files at `version`."""
        from deltalake import DeltaTable

        uri, options = delta_location(self.storage, table)
        with delta_errors(self.storage, table, "reading"):
            actions = pa.table(DeltaTable(uri, version=version, storage_options=options).get_add_actions(flatten=True))
        return {f"{table}/{path}": (int(size), int(rows or 0)) for path, size, rows in zip(
            actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(),
            actions.column("num_records").to_pylist())}

    def _load_files(self, state: RunState, changed: Iterable[str]) -> None:
        for table in changed:
            state.files = {rel: f for rel, f in state.files.items() if not rel.startswith(table + "/")}
            version = state.versions.get(table)
            if version is None:
                continue
            for rel, (size, rows) in self._files_at(table, version).items():
                state.files[rel] = LoggedFile(state.listed.get(rel, ""), size, rows)

    # -- the rows
    def _read_rows(self) -> None:
        """Read the rows of `_commits` this object has not read into `_entries` (by seq)."""
        table = self.handle(COMMITS)
        if table is None:
            return
        with delta_errors(self.storage, COMMITS, "reading"):
            table.update_incremental()
        rows: list[tuple[int, Entry]] = []
        for path in pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist():
            if path in self._read_paths:
                continue
            for row in pq.read_table(pa.BufferReader(self.storage.read(f"{COMMITS}/{path}"))).to_pylist():
                if row["seq"] >= len(self._entries):
                    try:
                        rows.append((row["seq"], Entry.from_row(row)))
                        self._row_files[row["seq"]] = f"{COMMITS}/{path}"
                    except ValueError:
                        raise ValueError(f"{self.storage.where(f'{COMMITS}/{path}')}: row {row['seq']}: its "
                                         "manifest is not JSON (edited by hand?)") from None
            self._read_paths.add(path)
        self._entries.extend(entry for _, entry in sorted(rows, key=lambda r: r[0]))

    def _pending(self) -> list[Entry]:
        """The rows read that the state does not hold yet."""
        return self._entries[self.state.seq + 1:]

    def _apply(self, entries: list[Entry]) -> RunState:
        before = dict(self.state.versions)
        for entry in entries:
            self.state.apply(entry)
        changed = {t for t in set(before) | set(self.state.versions) if before.get(t) != self.state.versions.get(t)}
        self._load_files(self.state, changed)
        return self.state

    def refresh(self) -> RunState:
        """Read the rows written since this object last looked; the state after the newest."""
        self._read_rows()
        return self._apply(self._pending())

    def catch_up(self) -> RunState:
        """A writer's refresh: the rows its job's other stores wrote (`RunStore.sibling`);
        RunTakenOver when another job's row is among them."""
        self._read_rows()
        self.check_writer()
        return self._apply(self._pending())

    def entries(self) -> list[Entry]:
        """Every row, oldest first."""
        self._read_rows()
        return list(self._entries)

    def row_file(self, seq: int) -> str:
        """The `_commits` file (relative to the run) that holds row `seq`, as this object read it."""
        self._read_rows()
        return self._row_files.get(seq, COMMITS)

    def state_as_of(self, seq: int) -> RunState:
        """The run after row `seq` (an earlier version of the run)."""
        state = RunState()
        for entry in self.entries():
            if entry.seq > seq:
                break
            state.apply(entry)
        self._load_files(state, state.versions)
        return state

    def _append(self, entry: Entry) -> None:
        """Append `entry` as row `self.state.seq + 1`, conditional on no other row since. The row's
        Parquet file is written here and added by a write transaction: `write_deltalake` costs
        2-3x as much for one row (it plans a write and gathers statistics of every column)."""
        table = self.handle(COMMITS) or self._create(COMMITS, ROWS)
        name = f"part-{entry.seq:08d}-{uuid.uuid4().hex[:12]}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist([entry.row()], schema=ROWS), sink)
        data = sink.getvalue()
        self.storage.write(f"{COMMITS}/{name}", data, fenced=False)  # the commit below is conditional
        with delta_errors(self.storage, COMMITS, "writing"):
            self._write_version(table, {f"{COMMITS}/{name}": LoggedFile("", data.size, 1)}, {}, {"seq": entry.seq},
                                "_commits", entry.seq, seq_stats=True)
        self._row_files[entry.seq] = f"{COMMITS}/{name}"
        self._read_paths.add(name)
        if len(self._entries) != entry.seq:
            raise RuntimeError(f"{COMMITS}: row {entry.seq} appended after {len(self._entries) - 1}")
        self._entries.append(entry)
        self.state.apply(entry)
        if entry.seq and entry.seq % COMPACT_EVERY == 0:
            try:
                with delta_errors(self.storage, COMMITS, "writing"):
                    table.optimize.compact()
            except Exception as exc:
                if not is_conflict(exc):  # another job's row came first: compacted at a later row
                    raise
            self._read_rows()  # the compacted file (rows known: skipped), and any row since

    # -- writing
    def open(self, claim: bool = False) -> None:
        """Start writing: read the log and name this job. Its "open" row is appended before its
        first write to the log (`_write_open_row`), or now with `claim` (a run that jobs on
        other machines may write: the older one stops at once, before this job plans from what
        it read) or when the run has no row yet (the row marks the run as written through the
        log, so a reader takes part files no commit lists for a killed or unfinished commit's)."""
        self.refresh()
        self.writer = self.writer or new_writer_id()
        if claim or self.state.seq < 0:
            self._write_open_row()

    def _write_open_row(self) -> None:
        """Append this job's "open" row once, after the rows written before it (its own job's
        other stores' rows count as its open)."""
        if self.writer is None:
            raise RuntimeError("RunLog: a write before open(): a writer opens the run first")
        if self.opened:
            return
        self._read_rows()
        if any(entry.writer == self.writer for entry in self._pending()):
            self.opened = True  # a sibling store of this job opened it
            return
        self._apply(self._pending())
        self._append(Entry(self.state.seq + 1, "open", self.writer, _now(), versions=self.state.versions))
        self.opened = True

    def check_writer(self) -> None:
        """Raise RunTakenOver when another job has appended a row since this job's state (a newer
        job opened the run). One read of the newest versions of `_commits`, however long it is.
        Before this job's first row there is nothing of its own to fence."""
        if not self.opened:
            return
        self._read_rows()
        for entry in self._pending():
            if entry.writer != self.writer:
                raise self._taken_over(entry)

    def commit(self, stage: str, round: int, manifest: Mapping[str, Any], files: Mapping[str, LoggedFile],
               columns: Mapping[str, Iterable[str]] | None = None) -> list[str]:
        """A stage's commit of `round`: one Delta version per table whose files change (its new
        part files added, its earlier ones for the round removed), then its row (the commit
        point). `files`: the manifest's outputs with their sha256, size and rows; `columns`: the
        column names of each new part (a table's Delta log gets the optional ones it lacks,
        `_add_columns`). Returns the files no longer live."""
        self._write_open_row()
        if self._pending():
            self.catch_up()
        outputs = list(manifest.get("outputs", []))
        missing = [rel for rel in outputs if rel not in files]
        if missing:
            raise ValueError(f"commit of {stage} round {round}: no file record for outputs {missing}")
        seq = self.state.seq + 1
        gone = self.state.replaced(stage, round, outputs)
        added = {rel: files[rel] for rel in outputs if rel not in self.state.files}
        versions = dict(self.state.versions)
        info = {"stage": stage, "round": round, "seq": seq}
        for table in sorted({rel.split("/", 1)[0] for rel in (*added, *gone)}):
            versions[table] = self._commit_table(
                table, {rel: m for rel, m in added.items() if rel.startswith(table + "/")},
                [rel for rel in gone if rel.startswith(table + "/")], info, f"{stage}@round={round}", seq,
                {name for rel in added if rel.startswith(table + "/") for name in (columns or {}).get(rel, ())})
        fault_point("commit.tables_written")
        self._append(Entry(seq, "commit", self.writer, _now(), stage, round, dict(manifest), versions))
        for rel in gone:
            self.state.files.pop(rel, None)
        self.state.files.update(added)
        return gone

    def take_in(self, commits: Iterable[tuple[str, int, Mapping[str, Any]]], files: Mapping[str, LoggedFile],
                imported: Iterable[str] = (), retired: Mapping[str, LoggedFile] | None = None) -> None:
        """Take in a run written without `_commits` (an older groupforge, other tools): each
        table gets one Delta version that makes `files` its live files (none when its Delta log,
        an older groupforge's, lists them already), then a row per commit of `commits` (stage,
        round, manifest, oldest first) and an "import" row for `imported` (files no manifest
        lists: live for good; `retired`: files of earlier versions, kept)."""
        self._write_open_row()
        versions = dict(self.state.versions)
        for table in sorted({rel.split("/", 1)[0] for rel in files} | {t for t in schema.SCHEMAS if self.handle(t)}):
            handle = self.handle(table) or self._create(table, schema.SCHEMAS[table])
            with delta_errors(self.storage, table, "reading"):
                handle.update_incremental()
            present = {rel: size for rel, (size, _) in self._files_at(table, handle.version()).items()}
            wanted = {rel: f for rel, f in files.items() if rel.startswith(table + "/")}
            added = {rel: f for rel, f in wanted.items() if present.get(rel) != f.size}
            removed = {rel: size for rel, size in present.items() if rel not in wanted}
            versions[table] = handle.version()
            if added or removed:
                with delta_errors(self.storage, table, "writing"):
                    versions[table] = self._write_version(handle, added, removed, {"import": True}, "import",
                                                          self.state.seq + 1)
        for stage, round, manifest in commits:
            self._append(Entry(self.state.seq + 1, "commit", self.writer, _now(), stage, round, dict(manifest),
                               versions))
        rest, kept = sorted(imported), {**(retired or {}), **{rel: files[rel] for rel in imported}}
        if kept:
            manifest = {"outputs": rest, "output_files": {rel: {"sha256": f.sha256, "size": f.size}
                                                          for rel, f in sorted(kept.items())},
                        "output_rows": {rel: f.rows for rel, f in sorted(kept.items())}}
            self._append(Entry(self.state.seq + 1, "import", self.writer, _now(), manifest=manifest,
                               versions=versions))
        self.state.files = dict(files)

    def _commit_table(self, table: str, added: Mapping[str, LoggedFile], removed: list[str], info: Mapping,
                      app_id: str, seq: int, columns: set[str] = frozenset()) -> int:
        """One Delta version of `table` (created when new): `added` join it, `removed` leave it.
        Returns the version. Versions no row records (a killed commit's, or a job's this one took
        the run from) are restored away first."""
        handle = self.handle(table) or self._create(table, schema.SCHEMAS[table])
        expected = self.state.versions.get(table, 0)
        with delta_errors(self.storage, table, "writing"):
            if handle.version() != expected:  # versions this job has not read: see what is there
                handle.update_incremental()
            if handle.version() != expected:
                self.check_writer()  # a newer job's versions: stop; else a killed or stopped job's
                self._restore(handle, expected)
            self._add_columns(handle, table, columns)
            return self._write_version(handle, added, {rel: self.state.files[rel].size for rel in removed}, info,
                                       app_id, seq)

    def _add_columns(self, handle, table: str, columns: set[str]) -> None:
        """Declare in the table's Delta log, nullable, the optional contract columns (the samples
        table's trajectory columns: `schema.field_of`) that the parts of this commit carry and
        the log lacks: one Delta version before the commit's, so that readers of the log see
        them (null in the parts without them). A table whose parts have none keeps the
        contract's schema."""
        optional = sorted(columns - set(schema.SCHEMAS[table].names))
        if not optional:
            return
        names = set(handle.schema().to_arrow().names)
        missing = [schema.field_of(table, name).with_nullable(True) for name in optional
                   if name not in names and _is_contract_column(table, name)]
        if missing:
            from deltalake.schema import Field

            handle.alter.add_columns([Field.from_arrow(field) for field in missing])

    def _write_version(self, handle, added: Mapping[str, LoggedFile], removed: Mapping[str, int], info: Mapping,
                       app_id: str, seq: int, seq_stats: bool = False) -> int:
        """The next version of the table `handle`: `added` join, `removed` ({rel: size}) leave;
        `info` in commitInfo, the app transaction (app_id, seq). `seq_stats`: the added file is
        `_commits` row `seq` (its statistics name the seq, not a round). Returns the version."""
        from deltalake import CommitProperties, Transaction
        from deltalake.transaction import AddAction, RemoveAction

        now = int(time.time() * 1000)
        actions: list = [RemoveAction(rel.split("/", 1)[1], True, now, size, {}) for rel, size in removed.items()]
        for rel, meta in added.items():
            round = None if seq_stats else _round_of(rel)
            bounds = {"seq": seq} if seq_stats else {} if round is None else {"round": round}
            stats = {"numRecords": meta.rows, "nullCount": {}, "minValues": bounds, "maxValues": bounds}
            actions.append(AddAction(rel.split("/", 1)[1], meta.size, {}, now, True,
                                     json.dumps(stats, separators=(",", ":"))))
        properties = CommitProperties(custom_metadata={"groupforge": dict(info)},
                                      app_transactions=[Transaction(app_id, seq)], max_commit_retries=0)
        try:
            handle.create_write_transaction(actions, mode="append", schema=handle.schema(),
                                            commit_properties=properties)
        except Exception as exc:
            if is_conflict(exc):
                raise self._taken_over() from None
            raise
        handle.update_incremental()
        return handle.version()

    def restore_tables(self) -> list[str]:
        """Bring every table back to the version the newest row records (a killed commit's
        versions undone); the tables restored."""
        restored = []
        for table in schema.SCHEMAS:
            handle = self.handle(table)
            if handle is None:
                continue
            with delta_errors(self.storage, table, "reading"):
                handle.update_incremental()
            if handle.version() == self.state.versions.get(table, 0):
                continue
            self._write_open_row()  # a restore is a write: this job's row first (its state may move)
            expected = self.state.versions.get(table, 0)
            if handle.version() != expected:
                with delta_errors(self.storage, table, "writing"):
                    self._restore(handle, expected)
                restored.append(table)
        return restored

    def _restore(self, handle, version: int) -> None:
        """The table back to `version` in a new version (RunTakenOver when another job commits
        to it meanwhile)."""
        try:
            handle.restore(version)
        except Exception as exc:
            if is_conflict(exc):
                raise self._taken_over() from None
            raise
        handle.update_incremental()

    def _taken_over(self, entry: Entry | None = None) -> RunTakenOver:
        if entry is None:
            self._read_rows()
            entry = next((e for e in reversed(self._entries) if e.writer != self.writer), None)
        who = f"job {entry.writer} ({entry.kind} at {entry.at})" if entry is not None else "another job"
        return RunTakenOver(f"{self.storage.where()}: run taken over: {who} wrote to this run after this job; "
                            "this job stops without writing more. Only one job may write a run: the newer one "
                            "goes on.")


def _round_of(rel: str) -> int | None:
    parts = rel.split("/")
    return int(parts[1].removeprefix("round=")) if len(parts) == 3 and parts[1].startswith("round=") else None


def _is_contract_column(table: str, name: str) -> bool:
    """Whether `name` is a column of the `table` contract, optional ones included."""
    try:
        schema.field_of(table, name)
    except KeyError:
        return False
    return True
