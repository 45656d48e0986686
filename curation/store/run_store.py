"""The run store: where a run's tables live, and how stages write them so that a reader sees
each commit whole or not at all, on local disk and on object storage alike.

Layout of a run RUN (a local folder or an object-store prefix, curation/store/storage.py):

    RUN/_log/<seq>.json                              the commit log (curation/store/commit_log.py)
    RUN/prompts/part-<part>-<sha>.parquet            prompts (not partitioned by round)
    RUN/<table>/round=<n>/part-<part>-<sha>.parquet  samples | scores | groups | rejects | pairs
    RUN/<table>/_delta_log/                          each table as a Delta Lake table (external readers)
    RUN/_staging/<stage>-round=<n>/                  resumable work-in-progress of a long stage

A part file is named after its part (by default the stage that writes it) and the first 16 hex
digits of its sha256, so a name is never reused for other bytes: a commit writes its files
under their final names (no rename: object stores have none), and the commit log entry that
lists them, written last, makes them live. The store reads the live files the log lists and
nothing else; a file no entry lists (a killed commit's) is swept by the next writer.

Several stages add rows to one table and round (`rejects` gets rows from generate, score and
filter), so each stage writes its own parts. The `round=<n>` folder and the `round` column
inside the file always agree (docs/guide-data.md, "Read the tables yourself").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation import schema
from curation.store.commit_log import CommitLog, LoggedFile, RunState
from curation.store.fingerprints import config_hash
from curation.store.layout import (
    ROUND_DIR,
    check_name,
    check_round,
    contract_columns,
    part_name,
)
from curation.store.lock import writer_lock
from curation.store.object_storage import ObjectStorage
from curation.store.storage import LocalStorage, Storage, check_location, open_storage

if TYPE_CHECKING:
    from curation.store.commit import Commit


@dataclass
class JobWrites:
    """What the stores of one writing job share (`RunStore.sibling`): the lock that orders their
    commits, and the newest commit log entry any of them wrote."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = -1


@dataclass(frozen=True)
class HeldPart:
    """A part file committed through a `RunStore(..., hold=True)` in this process, kept in
    memory so the next stage and the trainer read the table instead of the file."""

    sha256: str
    """The file's sha256 (its fingerprint as a stage input)."""
    table: pa.Table
    """The validated table the file holds."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _round_of(rel: str) -> int | None:
    """The round of a part file from its `round=<n>` folder (None: prompts)."""
    parts = rel.split("/")
    m = ROUND_DIR.fullmatch(parts[1]) if len(parts) == 3 else None
    return int(m[1]) if m else None


class RunStore:
    """One run (see the module docstring). Creates nothing until something is written.

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
        self.log = CommitLog(self.storage)
        self.job = JobWrites()
        """Shared with this store's siblings: their commits take turns and see each other's."""
        self._frozen = False  # a snapshot: the state is not read again
        self._unlisted: RunState | None = None  # the state of a run without a commit log (`refresh`)

    @property
    def state(self) -> RunState:
        """What the commit log says the run holds, as this store last read it. A run written
        without a log (by other tools, or an older groupforge) reads as its files and old
        manifests say (`curation.store.migrate`) until a writer takes them into the log."""
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
            from curation.store.migrate import unlisted_state

            self._unlisted = unlisted_state(self.storage, skip_ours=state.seq >= 0)
            return self._unlisted
        return state

    @property
    def logged(self) -> bool:
        """Whether the run's commit log holds its tables (False: nothing committed through a log
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
        store's user (the round loop's next-round generate): the same writer in the commit log,
        commits in turn with this store's, no held parts. Call after the job opened the run."""
        other = RunStore(self.storage)
        other.log.writer, other.log.state, other.job = self.log.writer, self.log.state.copy(), self.job
        return other

    def catch_up(self) -> None:
        """Read the commits this store's siblings made since it last looked."""
        if self.job.seq > self.log.state.seq:
            self.log.catch_up(self.job.seq)

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
                       and (r := _round_of(rel)) is not None})

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
                 and (r := _round_of(rel)) is not None and (wanted is None or r in wanted)]
        return [rel for _, rel in sorted(found)]

    def file_record(self, rel: str) -> LoggedFile:
        """sha256, size and rows of a live file, as its commit recorded them."""
        return self.state.files[rel]

    def staging(self, stage: str, round: int) -> Storage:
        """Where a long stage keeps its resumable work-in-progress for `round` (removed by its commit)."""
        return self.storage.child(f"_staging/{check_name(stage, 'stage')}-round={check_round(round)}")

    # -- reading
    def source(self, rel: str) -> str | pa.BufferReader:
        """What pyarrow reads the file `rel` from: its local path, or its bytes from the object store."""
        if self.root is not None:
            return str(self.root / rel)
        return pa.BufferReader(self.storage.read(rel))

    def read_part(self, rel: str, table: str, columns: Sequence[str] | None = None) -> pa.Table:
        """One live part file (held: from memory), validated as `table`; `columns`: only those."""
        held = self.held_part(rel)
        if held is not None:
            return held.table if columns is None else contract_columns(table, held.table, columns)
        data = self._read_file(rel, table)
        return data if columns is None else contract_columns(table, data, columns)

    def _read_file(self, rel: str, table: str) -> pa.Table:
        where = self.where(rel)
        try:
            data = pq.read_table(self.source(rel))
        except FileNotFoundError:
            raise schema.SchemaError(f"{table} table ({where}): file not found (listed by the commit log)") from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise schema.SchemaError(f"{table} table ({where}): not a readable Parquet file "
                                     f"({_first_line(exc)})") from None
        return schema.validate(data, table, where)

    def read(self, table: str, rounds: int | Sequence[int] | None = None, validate: bool = True,
             columns: Sequence[str] | None = None) -> pa.Table:
        """All rounds (or the given ones) of `table`, as a pyarrow Table.

        Validated against `curation.schema` unless `validate=False`; an empty table with the
        schema when nothing was written yet. The `round` column is checked against each file's
        `round=<n>` folder. `columns`: only these contract columns, in this order (`read_columns`).
        """
        if columns is not None:
            return self.read_columns(table, columns, rounds, validate)
        files = self.files(table, rounds)
        if not files:
            return schema.empty(table)
        parts = []
        for rel in files:
            held = self.held_part(rel)
            part = held.table if held is not None else self._read_file(rel, table) if validate else \
                pq.read_table(self.source(rel))
            if validate and table != "prompts":
                self._check_round(table, rel, part)
            parts.append(part)
        result = pa.concat_tables(parts, promote_options="permissive")
        return schema.validate(result, table, self.where(table)) if validate else result

    def _check_round(self, table: str, rel: str, part: pa.Table) -> None:
        folder = _round_of(rel)
        if not part.num_rows or folder is None:
            return
        lo, hi = pc.min_max(part.column("round")).as_py().values()
        if (lo, hi) != (folder, folder):
            raise schema.SchemaError(f"{table} table ({self.where(rel)}): column 'round' holds {lo}..{hi}, "
                                     f"but the file is in folder round={folder}")

    def read_columns(self, table: str, columns: Sequence[str], rounds: int | Sequence[int] | None = None,
                     validate: bool = True, exclude_parts: Sequence[str] = ()) -> pa.Table:
        """`columns` of `table` (contract columns, e.g. the keys and reward of scores), the same
        rows and values as `read(...).select(columns)` without reading the other columns.
        `exclude_parts`: part names (`part-<name>-<sha>.parquet`) left unread, e.g. a stage's own output."""
        parts = list(self.iter_columns(table, columns, rounds, validate, exclude_parts))
        if parts:
            return pa.concat_tables(parts)
        return pa.schema([schema.SCHEMAS[table].field(c) for c in columns]).empty_table()

    def iter_columns(self, table: str, columns: Sequence[str], rounds: int | Sequence[int] | None = None,
                     validate: bool = True, exclude_parts: Sequence[str] = (),
                     batch_rows: int | None = None) -> Iterator[pa.Table]:
        """read_columns as an iterator: one table per file, or per batch of <= `batch_rows` rows
        of a file (memory then holds one batch: a curation stage's pass over a large round),
        each checked as read_columns checks the whole. A part `held` is taken from memory, whole."""
        contract = schema.SCHEMAS[table]
        unknown = [c for c in columns if c not in contract.names]
        if unknown:
            raise ValueError(f"the {table} table has no column(s) {unknown} in its contract; "
                             f"known: {', '.join(contract.names)}")
        wanted = pa.schema([contract.field(c) for c in columns])
        check_round = validate and table != "prompts"
        for rel in self.files(table, rounds):
            if part_name(rel) in exclude_parts:
                continue
            held = self.held_part(rel)
            if held is not None:  # validated when it was committed
                yield contract_columns(table, held.table, columns)
                continue
            where = self.where(rel)
            try:
                file = pq.ParquetFile(self.source(rel))
                found = file.schema_arrow
                if validate:
                    schema.validate(found.empty_table(), table, where)
                present = [c for c in columns if c in found.names]
                extra = ["round"] if check_round and "round" not in present else []
                if batch_rows is None:
                    pieces: Iterator[pa.Table] = iter([file.read(columns=present + extra)])
                else:
                    batches = file.iter_batches(batch_size=batch_rows, columns=present + extra)
                    pieces = (pa.Table.from_batches([batch]) for batch in batches)
                for part in pieces:
                    if check_round:
                        self._check_round(table, rel, part)
                    part = contract_columns(table, part, columns)
                    if validate:
                        for field in wanted:
                            nulls = part.column(field.name).null_count
                            if not field.nullable and nulls:
                                raise schema.SchemaError(f"{table} table ({where}): column "
                                                         f"{field.name!r} has {nulls} null value(s)")
                    yield part
            except FileNotFoundError:
                raise schema.SchemaError(f"{table} table ({where}): file not found (listed by the commit log)"
                                         ) from None
            except (pa.ArrowInvalid, OSError) as exc:
                raise schema.SchemaError(f"{table} table ({where}): not a readable Parquet file "
                                         f"({_first_line(exc)})") from None

    def row_count(self, rel: str) -> int:
        """Rows of a live part file (from memory or its commit's record)."""
        held = self.held_part(rel)
        return held.table.num_rows if held is not None else self.state.files[rel].rows

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
        """A context manager that writes a stage's outputs atomically (see `curation.store.commit.Commit`)."""
        from curation.store.commit import Commit

        return Commit(self, stage, round, inputs, config)

    @contextlib.contextmanager
    def lock(self, wait: bool = True, timeout: float | None = None,
             on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Write the run: the writer lock of this machine (`curation.store.lock.writer_lock` on the
        run folder, or for a run on an object store on its folder in this machine's cache): a
        second job here waits, or exits 3 with `wait=False`; and everywhere an "open" entry in
        the commit log, so that a job that opened the run earlier (on another machine) stops at
        its next write (exit 3). Files that no commit lists (a killed job's) are swept."""
        from curation.store.location import node_cache

        folder = self.root if self.root is not None else node_cache(self.storage.url)
        with writer_lock(folder, wait=wait, timeout=timeout, on_wait=on_wait, name=self.location):
            self.open_for_writing()
            yield

    def open_for_writing(self) -> None:
        """Start writing the run (once per store): an "open" entry in the commit log, then
        `curation.store.tidy.tidy`. A commit does it when the caller did not take `lock()`. A
        local run folder is checked first for links that lead out of it (and each commit checks
        the folders it writes to: `curation.store.tidy.check_inside`), so no write lands outside it."""
        if self.log.writer is None:
            if self.root is not None:
                from curation.store.verify import check_links

                check_links(self.root)
            self.log.open()
            if isinstance(self.storage, ObjectStorage):  # no lock reaches another machine: fence each write
                self.storage.fence_writes(self.log.check_writer)
            self._unlisted = None
            from curation.store.tidy import tidy

            tidy(self)
