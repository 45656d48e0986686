"""The run store: where a run's tables live, and how stages write them so that a reader sees
each commit whole or not at all, on local disk and on object storage alike.

Layout of a run RUN (a local folder or an object-store prefix, store/storage.py):

    RUN/prompts/part-<part>-<sha>.parquet            prompts (not partitioned by round)
    RUN/<table>/round=<n>/part-<part>-<sha>.parquet  samples | scores | groups | rejects | pairs |
                                                     prompt_stats
    RUN/<table>/_delta_log/                          each table's Delta log (store/run_log.py)
    RUN/_commits/                                    a Delta table, a row per commit: the commit points
    RUN/_staging/<stage>-round=<n>/                  resumable work-in-progress of a long stage

A part file is named after its part (by default the stage that writes it) and the first 16 hex
digits of its sha256, so a name is never reused for other bytes: a commit writes its files
under their final names (no rename: object stores have none), then each table they belong to
gets a Delta version adding them, and the commit's row in `_commits`, written last, makes those
versions the ones groupforge reads. The store reads the live files of each table at the version
the newest row records and nothing else; a file no commit lists (a killed commit's) is swept by
the next writer.

Several stages add rows to one table and round (`rejects` gets rows from generate, score and
filter), so each stage writes its own parts. The `round=<n>` folder and the `round` column
inside the file always agree (docs/guide-data.md, "Read the tables yourself").

A stage's commit (`Commit`): its outputs for one round appear all at once, or not at all.

    with store.commit(stage, round, inputs, config) as commit:
        commit.write("rejects", table)          # validated, written under its final name
        commit.record(rows_in=..., drops=...)   # counts for the manifest
    # here: each table written got a Delta version, then the commit's row in _commits (the
    # commit point); the stage's earlier parts for the round left the live files (kept for
    # earlier versions of the run)

The manifest in the row records each output's sha256, size and rows, so the next stage
fingerprints its inputs without reading them again. A commit through a `RunStore(...,
hold=True)` (the round loop's) leaves each part it wrote in `store.held` (its sha256 and
table), so the next stage and the trainer read it from memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store import schema
from store.faults import fault_point
from store.fingerprints import canonical_json, code_version, config_hash
from store.layout import (
    FORMAT_VERSION,
    PART_FILE,
    ROUND_TABLES,
    SEAL_FIELD,
    check_inside,
    check_links,
    check_name,
    check_round,
    part_name,
    part_rel,
    round_of,
    seal_of,
)
from store.location import node_cache
from store.lock import writer_lock
from store.migrate import import_unlisted, unlisted_state
from store.run_files import to_json
from store.run_log import LoggedFile, RunLog, RunState
from store.storage import LocalStorage, ObjectStorage, Storage, check_location, open_storage
from store.table_reads import TableReads


@dataclass(frozen=True)
class HeldPart:
    """A part file committed through a `RunStore(..., hold=True)` in this process, kept in
    memory so the next stage and the trainer read the table instead of the file."""

    sha256: str
    """The file's sha256 (its fingerprint as a stage input)."""
    table: pa.Table
    """The validated table the file holds."""


@dataclass
class JobWrites:
    """What the stores of one writing job share (`RunStore.sibling`): the lock that orders their
    commits, and the newest row any of them wrote to `_commits`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = -1


class RunStore(TableReads):
    """One run (see the module docstring). Creates nothing until something is written. Its table
    reads (`read`, `read_columns`, `iter_columns`, ...) are store/table_reads.py's.

    `root`: a local folder, an object-store URL (`s3://bucket/runs/x`), or a Storage."""

    def __init__(self, root: str | Path | Storage, hold: bool = False):
        if not isinstance(root, Storage):
            check_location(str(root), run=True)
        self.storage = root if isinstance(root, Storage) else open_storage(root)
        self.root: Path | None = self.storage.root if isinstance(self.storage, LocalStorage) else None
        """The run folder on local disk (None on an object store)."""
        self.location = self.storage.url
        """The run as a path or URL, for messages."""
        self.name = self.location.rstrip("/").rsplit("/", 1)[-1]
        """The run's folder name (the default run_id of its samples)."""
        self.hold = hold
        """Keep the parts committed through this store in memory (`held`): the round loop."""
        self.held: dict[str, HeldPart] = {}
        """The parts committed through this store (with `hold`), by path relative to the run."""
        self.log = RunLog(self.storage)
        self.job = JobWrites()
        """Shared with this store's siblings: their commits take turns and see each other's."""
        self._frozen = False  # a snapshot: the state is not read again
        self._unlisted: RunState | None = None  # the state of a run without _commits (`refresh`)

    @property
    def state(self) -> RunState:
        """What the run's log says the run holds, as this store last read it. A run written
        without a log (by other tools, or an older groupforge) reads as its files and old
        manifests say (`store.migrate`) until a writer takes them into the log."""
        if self._unlisted is not None:
            return self._unlisted
        if self.log.state.seq < 0 and not self._frozen:
            self.refresh()
        return self._unlisted or self.log.state

    def refresh(self) -> RunState:
        """Read the commits made since this store last looked (by another process)."""
        if self._frozen:
            return self.state
        state = self.log.refresh()
        self._unlisted = None
        if not state.manifests and not state.files and self.log.writer is None:
            # nothing committed yet (no log, or only jobs that opened it): what the files and any
            # old manifests say; with a log, files named as groupforge names them are a killed
            # commit's, not the run's
            self._unlisted = unlisted_state(self.storage, skip_ours=state.seq >= 0)
            return self._unlisted
        return state

    @property
    def logged(self) -> bool:
        """Whether the run's log (_commits) holds its tables (False: nothing committed through a log
        yet; the run reads as its files and old manifests say until a writer takes them in)."""
        return self.state is not self._unlisted

    def held_part(self, rel: str) -> HeldPart | None:
        """The part held for the file `rel` (None: read the file)."""
        return self.held.get(rel) if self.held else None

    def release(self) -> None:
        """Drop the held parts (the round loop, once a round is done with them)."""
        self.held.clear()

    def __repr__(self) -> str:
        return f"RunStore({self.location!r}{', snapshot' if self._frozen else ''})"

    def sibling(self) -> RunStore:
        """Another store of this writing job on the run, for a thread that commits beside this
        store's user (the round loop's next-round generate): the same writer in the log,
        commits in turn with this store's, no held parts. Call after the job opened the run."""
        other = RunStore(self.storage)
        other.log, other.job = self.log.fork(), self.job
        return other

    def catch_up(self) -> None:
        """Read the commits this store's siblings made since it last looked."""
        if self.job.seq > self.log.state.seq:
            self.log.catch_up()

    def snapshot(self) -> RunStore:
        """A reader's view of the run as of now: the commits made so far, and no later one,
        while a job may go on committing beside it. Take a new snapshot to see later commits."""
        view = RunStore(self.storage)
        view.log.state = self.refresh().copy()
        if self._unlisted is not None:  # a run without commits: as its files say
            view._unlisted = view.log.state
        view._frozen = True
        return view

    def as_of_round(self, round: int) -> RunStore:
        """A reader's view of the run as it was when `round` was done: the commits up to the
        first entry of a later round (a later rerun of an earlier round is not in it). Its files
        are all kept (replaced ones are retired, not deleted), so reads give the same bytes."""
        self.refresh()
        entries = self.log.entries()
        rounds = [e.round for e in entries if e.kind == "commit" and e.round is not None]
        if round not in rounds:
            raise ValueError(f"{self.location}: no commit of round {round}; rounds committed: "
                             f"{sorted(set(rounds)) or 'none'}")
        later = next((e.seq for e in entries if e.kind == "commit" and e.round is not None and e.round > round),
                     None)
        seq = entries[-1].seq if later is None else later - 1
        view = RunStore(self.storage)
        view.log.state = self.log.state_as_of(seq)
        view._frozen = True
        return view

    def duckdb_views(self, con: duckdb.DuckDBPyConnection, rounds: int | Sequence[int] | None = None,
                     prefix: str = "") -> duckdb.DuckDBPyConnection:
        """Create (or replace) a view per table (samples, scores, groups, rejects, pairs, prompts)
        in `con` over this store's live files (use it on a `snapshot()`): e.g.
        `RunStore("runs/x").snapshot().duckdb_views(duckdb.connect()).sql("SELECT ... FROM groups")`.
        `rounds`: only those rounds' files (prompts: every file); `prefix`: before each view's name."""
        for table in schema.SCHEMAS:
            data = self.read(table, None if table == "prompts" else rounds)
            con.register(f"_{prefix}{table}_arrow", data)
            con.execute(f"CREATE OR REPLACE VIEW {prefix}{table} AS SELECT * FROM _{prefix}{table}_arrow")
        return con

    # -- layout
    def table_dir(self, table: str) -> str:
        """The table's folder, relative to the run."""
        if table not in schema.SCHEMAS:
            raise ValueError(f"unknown table {table!r}; known: {', '.join(schema.SCHEMAS)}")
        return table

    def partition_dir(self, table: str, round: int | None) -> str:
        """`<table>/round=<n>` relative to the run; `round=None` gives the table folder (prompts)."""
        if round is None:
            return self.table_dir(table)
        if table == "prompts":
            raise ValueError("the prompts table is not partitioned by round")
        return f"{self.table_dir(table)}/round={check_round(round)}"

    def where(self, rel: str = "") -> str:
        """`rel` as a full path or URL, for messages."""
        return self.storage.where(rel)

    def rounds(self, table: str) -> list[int]:
        """The rounds that hold at least one live part file, ascending."""
        if table == "prompts":
            raise ValueError("the prompts table is not partitioned by round")
        self.table_dir(table)
        return sorted({r for rel in self.state.files if rel.startswith(table + "/")
                       and (r := round_of(rel)) is not None})

    def files(self, table: str, rounds: int | Sequence[int] | None = None) -> list[str]:
        """The live part files of `table` (all rounds, or the given ones), relative to the run, in
        round then name order."""
        self.table_dir(table)
        if table == "prompts":
            if rounds is not None:
                raise ValueError("the prompts table is not partitioned by round")
            return sorted(rel for rel in self.state.files if rel.startswith("prompts/") and rel.count("/") == 1)
        wanted = None if rounds is None else {check_round(r) for r in ([rounds] if isinstance(rounds, int)
                                                                      else rounds)}
        found = [(r, rel) for rel in self.state.files if rel.startswith(table + "/")
                 and (r := round_of(rel)) is not None and (wanted is None or r in wanted)]
        return [rel for _, rel in sorted(found)]

    def file_record(self, rel: str) -> LoggedFile:
        """sha256, size and rows of a live file, as its commit recorded them."""
        return self.state.files[rel]

    def staging(self, stage: str, round: int) -> Storage:
        """Where a long stage keeps its resumable work-in-progress for `round` (removed by its commit)."""
        return self.storage.child(f"_staging/{check_name(stage, 'stage')}-round={check_round(round)}")

    # -- manifests
    def load_manifest(self, stage: str, round: int) -> dict | None:
        """The manifest of the stage's newest commit for `round` (None: never committed)."""
        return self.state.manifests.get((check_name(stage, "stage"), check_round(round)))

    def round_manifests(self, round: int) -> dict[str, dict]:
        """{stage: manifest} of every stage that committed `round`, by stage name."""
        return {stage: m for (stage, r), m in sorted(self.state.manifests.items()) if r == round}

    def round_prompts(self, round: int) -> list[str] | None:
        """The prompts parts the round's samples came from: those listed by the commits that
        list the round's samples parts (its generate and refill calls), sorted. None when a
        samples part of the round is listed by no commit that lists a prompts part: then only
        the whole prompts table is sure to hold its prompts."""
        samples = set(self.files("samples", round))
        prompts: set[str] = set()
        for manifest in self.round_manifests(round).values():
            outputs = set(manifest.get("outputs", []))
            mine = outputs & samples
            listed = {out for out in outputs if out.startswith("prompts/")}
            if mine and listed:
                samples -= mine
                prompts |= listed
        return None if samples else sorted(prompts)

    def part_fingerprints(self, rels: Sequence[str]) -> dict[str, str]:
        """{rel: sha256} of live part files of the run: a held part's own, else what its commit
        recorded in the run's log (no file is read)."""
        found = {}
        for rel in rels:
            held = self.held_part(rel)
            found[rel] = held.sha256 if held is not None else self.file_record(rel).sha256
        return found

    def is_up_to_date(self, stage: str, round: int, inputs: dict[str, str], config: Mapping) -> bool:
        """True when the stage's newest commit for the round had these inputs and config, and its
        outputs all exist."""
        manifest = self.load_manifest(stage, round)
        return (manifest is not None and manifest.get("inputs") == dict(inputs)
                and manifest.get("config_hash") == config_hash(config)
                and all(self.held_part(rel) is not None or self.storage.exists(rel)
                        for rel in manifest.get("outputs", [])))

    # -- writing
    def commit(self, stage: str, round: int, inputs: dict[str, str], config: Mapping) -> Commit:
        """A context manager that writes a stage's outputs atomically (`Commit`)."""
        return Commit(self, stage, round, inputs, config)

    @contextlib.contextmanager
    def lock(self, wait: bool = True, timeout: float | None = None,
             on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Write the run: the writer lock of this machine (`store.lock.writer_lock` on the
        run folder, or for a run on an object store on its folder in this machine's cache): a
        second job here waits, or exits 3 with `wait=False`; and everywhere an "open" row in
        `_commits` (on an object store at once, on local disk before this job's first write), so
        that a job that opened the run earlier (on another machine) stops at its next write
        (exit 3). Files that no commit lists (a killed job's) are swept."""
        folder = self.root if self.root is not None else node_cache(self.storage.url)
        with writer_lock(folder, wait=wait, timeout=timeout, on_wait=on_wait, name=self.location):
            self.open_for_writing()
            yield

    def open_for_writing(self) -> None:
        """Start writing the run (once per store): name this job in the log (its "open" row:
        now on an object store, else before its first write: `RunLog.open`), then `_tidy`. A
        commit does it when the caller did not take `lock()`. A local run folder is checked
        first for links that lead out of it (and each commit checks the folders it writes to:
        `layout.check_inside`), so no write lands outside it."""
        if self.log.writer is None:
            if self.root is not None:
                check_links(self.root)
            remote = isinstance(self.storage, ObjectStorage)  # no lock reaches another machine:
            self.log.open(claim=remote)  # claim the run now, and fence each write
            if remote:
                self.storage.fence_writes(self.log.check_writer)
            self._unlisted = None
            self._tidy()

    def _tidy(self) -> None:
        """What a job that starts writing does first: take in the tables of a run written without
        `_commits` (`store.migrate`), restore each table to the version the newest
        commit recorded (a killed commit's versions undone), and remove what killed jobs left
        (`orphans`, local temporary files)."""
        if not self.state.manifests and not self.state.files:  # nothing committed yet
            import_unlisted(self.log, self.storage)
        self.log.restore_tables()
        self.storage.delete_all(self.orphans())
        if isinstance(self.storage, LocalStorage):
            self.storage.remove_dead_temps()

    def orphans(self) -> list[str]:
        """Part files of killed commits: in a table folder, named `part-<part>-<sha16>.parquet`
        with bytes that hash to that name, and never listed by a commit (neither live nor
        retired). A file that only looks like one (its bytes hash to another name) is not
        touched: `verify` names it as a foreign file."""
        known = self.state.files.keys() | self.state.listed.keys()
        found = []
        for table in schema.SCHEMAS:
            for entry in self.storage.list(table):
                m = PART_FILE.fullmatch(entry.rel.rsplit("/", 1)[-1])
                if entry.rel in known or not m or not m["sha"] or "/_delta_log/" in f"/{entry.rel}":
                    continue
                if hashlib.sha256(self.storage.read(entry.rel)).hexdigest()[:16] == m["sha"]:
                    found.append(entry.rel)
        return found


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
        self._columns: dict[str, list[str]] = {}  # each part's column names (run_log: optional columns)
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
            check_inside(self.store.root, encoded.rel)
            self._folders.add(_unhashed(encoded.rel).rpartition("/")[0])
        if encoded.rel not in self.store.state.files:
            self.store.storage.write(encoded.rel, encoded.payload)
            self._written.append(encoded.rel)
        elif not self.store.storage.exists(encoded.rel):  # live, but lost since: written again
            self.store.storage.write(encoded.rel, encoded.payload)
        self._files[encoded.rel] = LoggedFile(encoded.sha256, encoded.payload.size, encoded.data.num_rows)
        self._columns[encoded.rel] = encoded.data.column_names
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
            gone = store.log.commit(self.stage, self.round, manifest, self._files,  # the commit point
                                    self._columns)
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
