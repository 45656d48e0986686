"""The run store: where a run's tables live, and how stages write them so that a reader sees
each commit whole or not at all, on local disk and on object storage alike.

Layout of a run RUN (a local folder or an object-store prefix, curation/store/storage.py):

    RUN/prompts/part-<part>-<sha>.parquet            prompts (not partitioned by round)
    RUN/<table>/round=<n>/part-<part>-<sha>.parquet  samples | scores | groups | rejects | pairs |
                                                     prompt_stats
    RUN/<table>/_delta_log/                          each table's Delta log (curation/store/run_log.py)
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

from curation import schema
from curation.store.fingerprints import config_hash
from curation.store.layout import check_name, check_round, round_of
from curation.store.lock import writer_lock
from curation.store.object_storage import ObjectStorage
from curation.store.run_log import LoggedFile, RunLog, RunState
from curation.store.storage import LocalStorage, Storage, check_location, open_storage
from curation.store.table_reads import TableReads

if TYPE_CHECKING:
    from curation.store.commit import Commit


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
    reads (`read`, `read_columns`, `iter_columns`, ...) are curation/store/table_reads.py's.

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
        second job here waits, or exits 3 with `wait=False`; and everywhere an "open" row in
        `_commits` before this job's first write, so that a job that opened the run earlier (on
        another machine) stops at its next write (exit 3). Files that no commit lists (a killed
        job's) are swept."""
        from curation.store.location import node_cache

        folder = self.root if self.root is not None else node_cache(self.storage.url)
        with writer_lock(folder, wait=wait, timeout=timeout, on_wait=on_wait, name=self.location):
            self.open_for_writing()
            yield

    def open_for_writing(self) -> None:
        """Start writing the run (once per store): name this job in the log (its "open" row is
        written before its first write: `RunLog`), then
        `curation.store.tidy.tidy`. A commit does it when the caller did not take `lock()`. A
        local run folder is checked first for links that lead out of it (and each commit checks
        the folders it writes to: `curation.store.tidy.check_inside`), so no write lands outside it."""
        if self.log.writer is None:
            if self.root is not None:
                from curation.store.verify import check_links

                check_links(self.root)
            self.log.open()
            if isinstance(self.storage, ObjectStorage):  # no lock reaches another machine: fence each write
                self.storage.fence_writes(self.log.fence)
            self._unlisted = None
            from curation.store.tidy import tidy

            tidy(self)
