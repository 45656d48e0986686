"""The run store: where a run's tables live, and how stages write them without ever
leaving a partial or duplicated file behind.

Layout of a run directory RUN:

    RUN/prompts/part-<part>.parquet                  prompts (not partitioned by round)
    RUN/<table>/round=<n>/part-<part>.parquet        samples | scores | groups | rejects | pairs
    RUN/_manifests/<stage>-round=<n>.json            what a stage's last successful commit did
    RUN/_manifests/<stage>-round=<n>.pending         outputs of a commit being published
    RUN/_staging/<stage>-round=<n>/                  resumable work-in-progress of a long stage
    RUN/_tmp/<commit>/                               files written but not yet committed
    RUN/.lock                                        the writer lock, and who holds it

Several stages add rows to one table and round (`rejects` gets rows from generate, score
and filter), so each stage writes its own part file, named after the stage by default.

A commit (curation/store/commit.py) writes into `_tmp` (same filesystem), then renames each
file into place and writes the manifest last. Readers only glob the table folders, so they
never see `_tmp`, `_staging` or `_manifests`; the `round=<n>` folder and the `round` column
inside the file always agree, so DuckDB, Polars and pyarrow read the same rounds
(docs/guide-data.md, "Read the tables yourself").
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation import schema
from curation.store.fingerprints import config_hash
from curation.store.layout import (
    NAME,
    ROUND_DIR,
    check_name,
    check_round,
    connect,
    contract_columns,
    parquet_files,
)
from curation.store.lock import writer_lock
from curation.store.runlog import read_json

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


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# ---- the store ----------------------------------------------------------------------


def committed_outputs(root: Path) -> set[str]:
    """Relative paths of the files the run's committed manifests list (RUN/_manifests/*.json)."""
    outputs: set[str] = set()
    for path in sorted((root / "_manifests").glob("*.json")):
        try:
            outputs.update((read_json(path) or {}).get("outputs", []))
        except ValueError:
            continue  # unreadable: verify names it; a reader sees that commit as absent
    return outputs


class RunStore:
    """One run directory (see the module docstring). Creates nothing until something is written."""

    def __init__(self, root: str | Path, hold: bool = False):
        self.root = Path(root)
        self.hold = hold
        """Keep the parts committed through this store in memory (`held`): the round loop."""
        self.held: dict[str, HeldPart] = {}
        """The parts committed through this store (with `hold`), by path relative to the run.
        Commits made through another RunStore object do not update it: a process writes a run
        through one store (callers hold the run's lock, so no other process writes)."""
        self._committed: frozenset[Path] | None = None  # set by snapshot(): only these files are read
        self._journals: set[Path] | None = None  # `pending_journals`, listed on first use

    def held_part(self, path: Path) -> HeldPart | None:
        """The part held for the file at `path` (None: read the file)."""
        return self.held.get(path.relative_to(self.root).as_posix()) if self.held else None

    def release(self) -> None:
        """Drop the held parts (the round loop, once a round is done with them)."""
        self.held.clear()

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r}{', snapshot' if self._committed is not None else ''})"

    def snapshot(self) -> RunStore:
        """A reader's view of the run as of now: the same store, reading only the part files
        that committed manifests list. A commit publishes its files, then its manifest, so a
        reader on a snapshot sees each commit (a stage's round) whole or not at all, while a
        job commits beside it; a plain store (and a bare glob over the table folders) can see
        a commit's first file before its last. Readers that run beside a job (`export`,
        `inspect`, `report`, `duckdb_views`) use one; stages run under the writer lock and
        need none. Take a new snapshot to see later commits."""
        view = RunStore(self.root)
        if (self.root / "_manifests").is_dir():  # else tables written by hand: nothing to hold them to
            view._committed = frozenset(self.root / rel for rel in committed_outputs(self.root))
        return view

    def duckdb_views(self, con: duckdb.DuckDBPyConnection, rounds: int | Sequence[int] | None = None,
                     prefix: str = "") -> duckdb.DuckDBPyConnection:
        """Create (or replace) a view per table (samples, scores, groups, rejects, pairs, prompts)
        in `con` over this store's files (use it on a `snapshot()`): e.g.
        `RunStore("runs/x").snapshot().duckdb_views(duckdb.connect()).sql("SELECT ... FROM groups")`.
        `rounds`: only those rounds' files (prompts: every file); `prefix`: before each view's name."""
        for table in schema.SCHEMAS:
            files = self.files(table, None if table == "prompts" else rounds)
            if files:
                listed = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
                con.execute(f"CREATE OR REPLACE VIEW {prefix}{table} AS SELECT * FROM read_parquet([{listed}], "
                            "hive_partitioning = false, union_by_name = true)")
            else:
                con.register(f"_empty_{table}", schema.empty(table))
                con.execute(f"CREATE OR REPLACE VIEW {prefix}{table} AS SELECT * FROM _empty_{table}")
        return con

    # -- layout
    def table_dir(self, table: str) -> Path:
        if table not in schema.SCHEMAS:
            raise ValueError(f"unknown table {table!r}; known: {', '.join(schema.SCHEMAS)}")
        return self.root / table

    def partition_dir(self, table: str, round: int | None) -> Path:
        """`RUN/<table>/round=<n>`; `round=None` gives the table folder (prompts)."""
        if round is None:
            return self.table_dir(table)
        if table == "prompts":
            raise ValueError("the prompts table is not partitioned by round")
        return self.table_dir(table) / f"round={check_round(round)}"

    def table_glob(self, table: str) -> str:
        """The glob that reads the whole table, e.g. 'RUN/samples/**/*.parquet'."""
        pattern = "*.parquet" if table == "prompts" else "**/*.parquet"
        return str(self.table_dir(table) / pattern)

    def rounds(self, table: str) -> list[int]:
        """The rounds that hold at least one part file, ascending."""
        if table == "prompts":
            raise ValueError("the prompts table is not partitioned by round")
        return sorted(self._round_files(table))

    def files(self, table: str, rounds: int | Sequence[int] | None = None) -> list[Path]:
        """The part files of `table` (all rounds, or the given ones), in round then name order
        (on a snapshot, only those committed when it was taken)."""
        found = self._files(table, rounds)
        return found if self._committed is None else [f for f in found if f in self._committed]

    def _files(self, table: str, rounds: int | Sequence[int] | None = None) -> list[Path]:
        if table == "prompts":
            if rounds is not None:
                raise ValueError("the prompts table is not partitioned by round")
            return sorted(self.table_dir(table).glob("*.parquet"))
        if rounds is None:
            by_round = self._round_files(table)
            return [f for r in sorted(by_round) for f in by_round[r]]
        wanted = [rounds] if isinstance(rounds, int) else rounds
        return [f for r in sorted(set(wanted)) for f in parquet_files(self.partition_dir(table, r))]

    def _round_files(self, table: str) -> dict[int, list[Path]]:
        """{round: its part files, by name} of every round folder that holds one (one scan of
        the table folder and of each round folder: the round loop asks every round)."""
        found: dict[int, list[Path]] = {}
        try:
            entries = list(os.scandir(self.table_dir(table)))
        except (FileNotFoundError, NotADirectoryError):
            return found
        for entry in entries:
            m = ROUND_DIR.fullmatch(entry.name)
            if m and entry.is_dir():
                files = parquet_files(Path(entry.path))
                if self._committed is not None:
                    files = [f for f in files if f in self._committed]
                if files:
                    found[int(m[1])] = files
        return found

    def staging_dir(self, stage: str, round: int) -> Path:
        path = self.root / "_staging" / f"{check_name(stage, 'stage')}-round={check_round(round)}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def clean_tmp(self) -> None:
        """Remove every uncommitted temporary file (left by killed processes). Call under the lock."""
        shutil.rmtree(self.root / "_tmp", ignore_errors=True)

    # -- reading
    def read(self, table: str, rounds: int | Sequence[int] | None = None, validate: bool = True,
             columns: Sequence[str] | None = None) -> pa.Table:
        """All rounds (or the given ones) of `table` in one DuckDB query, as a pyarrow Table.

        Validated against `curation.schema` unless `validate=False`; an empty table with the
        schema when nothing was written yet. The `round` column comes from the files
        (hive_partitioning=false), and validation checks it against the `round=<n>` folders.

        `columns`: only these contract columns, in this order (see `read_columns`).
        """
        if columns is not None:
            return self.read_columns(table, columns, rounds, validate)
        files = self.files(table, rounds)
        if not files:
            return schema.empty(table)
        paths = [str(f) for f in files]
        con = connect()
        try:
            sql = "SELECT * FROM read_parquet($files, hive_partitioning = false, union_by_name = true)"
            result = con.sql(sql, params={"files": paths}).to_arrow_table()
            if validate:
                result = schema.validate(result, table, self.table_glob(table))
                if table != "prompts":
                    self._check_round_folders(con, table, paths)
        except (duckdb.Error, schema.SchemaError) as exc:
            self._raise_for_bad_file(table, files)
            if isinstance(exc, schema.SchemaError):
                raise
            raise schema.SchemaError(f"{table} table ({self.table_glob(table)}): {_first_line(exc)}") from exc
        finally:
            con.close()
        return result

    def read_columns(self, table: str, columns: Sequence[str], rounds: int | Sequence[int] | None = None,
                     validate: bool = True, exclude_parts: Sequence[str] = ()) -> pa.Table:
        """`columns` of `table` (contract columns, e.g. the keys and reward of scores), the same
        rows and values as `read(...).select(columns)` without reading the other columns.
        `exclude_parts`: part names (`part-<name>.parquet`) left unread, e.g. a stage's own output.

        Each file is read on its own with pyarrow (a 64-char string column read through DuckDB
        costs ~1.6x), and the files are concatenated in `files()` order, as DuckDB does. With
        `validate`, every file's schema (its Parquet footer) is still checked against the whole
        contract, the columns read are checked for nulls, and `round` against the folders.
        """
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
        for path in self.files(table, rounds):
            if path.stem.removeprefix("part-") in exclude_parts:
                continue
            held = self.held_part(path)
            if held is not None:  # validated when it was committed
                yield contract_columns(table, held.table, columns)
                continue
            try:
                found = pq.read_schema(path)
                if validate:
                    schema.validate(found.empty_table(), table, path)
                present = [c for c in columns if c in found.names]
                extra = ["round"] if check_round and "round" not in present else []
                if batch_rows is None:
                    pieces: Iterator[pa.Table] = iter([pq.read_table(path, columns=present + extra)])
                else:
                    batches = pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=present + extra)
                    pieces = (pa.Table.from_batches([batch]) for batch in batches)
                for part in pieces:
                    if check_round and part.num_rows:
                        folder = int(ROUND_DIR.fullmatch(path.parent.name)[1])
                        lo, hi = pc.min_max(part.column("round")).as_py().values()
                        if (lo, hi) != (folder, folder):
                            raise schema.SchemaError(f"{table} table ({path}): column 'round' holds {lo}..{hi}, "
                                                     f"but the file is in folder round={folder}")
                    part = contract_columns(table, part, columns)
                    if validate:
                        for field in wanted:
                            nulls = part.column(field.name).null_count
                            if not field.nullable and nulls:
                                raise schema.SchemaError(f"{table} table ({self.table_glob(table)}): column "
                                                         f"{field.name!r} has {nulls} null value(s)")
                    yield part
            except (pa.ArrowInvalid, OSError):
                schema.read_table_file(path, table)  # raises SchemaError naming the file
                raise

    def _check_round_folders(self, con: duckdb.DuckDBPyConnection, table: str, paths: list[str]) -> None:
        sql = ("SELECT filename, min(round), max(round) FROM read_parquet($files, hive_partitioning = false,"
               " filename = true) GROUP BY filename")
        for filename, lo, hi in con.sql(sql, params={"files": paths}).fetchall():
            folder = int(ROUND_DIR.fullmatch(Path(filename).parent.name)[1])
            if (lo, hi) != (folder, folder):
                raise schema.SchemaError(f"{table} table ({filename}): column 'round' holds {lo}..{hi}, "
                                         f"but the file is in folder round={folder}")

    @staticmethod
    def _raise_for_bad_file(table: str, files: list[Path]) -> None:
        """Name the file a multi-file read failed on: the first that fails on its own."""
        for f in files:
            schema.read_table_file(f, table)  # raises SchemaError naming the file

    # -- manifests
    def manifest_path(self, stage: str, round: int) -> Path:
        return self.root / "_manifests" / f"{check_name(stage, 'stage')}-round={check_round(round)}.json"

    def pending_path(self, stage: str, round: int) -> Path:
        """The journal of a commit being published (not *.json: not a manifest)."""
        return self.manifest_path(stage, round).with_suffix(".pending")

    def pending_journals(self) -> set[Path]:
        """The journals (`*.pending`) of commits a killed process left, listed once per store:
        callers hold the run's lock, so no other process adds one (a caller checks that a listed
        journal still exists: a commit deletes its own once it is done)."""
        if self._journals is None:
            try:
                self._journals = {Path(entry.path) for entry in os.scandir(self.root / "_manifests")
                                  if entry.name.endswith(".pending")}
            except (FileNotFoundError, NotADirectoryError):
                self._journals = set()
        return self._journals

    def load_manifest(self, stage: str, round: int) -> dict | None:
        return read_json(self.manifest_path(stage, round))

    def round_manifests(self, round: int, suffix: str = ".json") -> list[Path]:
        """The manifests (`suffix` ".pending": the journals) of every stage of `round`, by name
        (one scan of the folder: a run of many rounds holds thousands; the loop asks each stage)."""
        tail = f"-round={check_round(round)}{suffix}"
        try:
            entries = os.scandir(self.root / "_manifests")
            return sorted(Path(entry.path) for entry in entries if entry.name.endswith(tail))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def recorded_files(self, round: int) -> dict[str, dict]:
        """{relative path: {sha256, size, mtime_ns}} of every file the round's manifests record
        as written (`output_files`; manifests of older runs record none)."""
        recorded: dict[str, dict] = {}
        for path in self.round_manifests(round):
            files = (read_json(path) or {}).get("output_files")
            if isinstance(files, dict):
                recorded.update(files)
        return recorded

    def round_prompts(self, round: int) -> list[Path] | None:
        """The prompts parts the round's samples came from: those listed by the manifests that
        list the round's samples parts (its generate and refill calls), sorted. A part
        `part-<stage>.parquet` is looked up in that stage's manifest (a commit names its parts
        after its stage), so the call reads the round's own manifests only.
        None when a samples part of the round is listed by no manifest (or by one that lists
        no prompts part): then only the whole prompts table is sure to hold its prompts."""
        samples = {path.relative_to(self.root).as_posix() for path in self.files("samples", round)}
        prompts: set[str] = set()
        for rel in sorted(samples):
            stage = Path(rel).stem.removeprefix("part-")
            if not NAME.fullmatch(stage) or rel not in samples:
                continue
            outputs = set((self.load_manifest(stage, round) or {}).get("outputs", []))
            mine = outputs & samples
            listed = {out for out in outputs if out.startswith("prompts/")}
            if mine and listed:
                samples -= mine
                prompts |= listed
        return None if samples else [self.root / rel for rel in sorted(prompts)]

    def is_up_to_date(self, stage: str, round: int, inputs: dict[str, str], config: Mapping) -> bool:
        """True when the stage's last commit had these inputs and config, and its outputs all exist."""
        manifest = self.load_manifest(stage, round)
        if manifest is None or self.pending_path(stage, round).exists():
            return False  # never committed, or a commit died while publishing
        return (manifest.get("inputs") == dict(inputs)
                and manifest.get("config_hash") == config_hash(config)
                and all((self.root / rel).is_file() for rel in manifest.get("outputs", [])))

    # -- writing
    def commit(self, stage: str, round: int, inputs: dict[str, str], config: Mapping) -> Commit:
        """A context manager that writes a stage's outputs atomically (see `curation.store.commit.Commit`)."""
        from curation.store.commit import Commit

        return Commit(self, stage, round, inputs, config)

    def lock(self, wait: bool = True, timeout: float | None = None,
             on_wait: Callable[[str], None] | None = None) -> contextlib.AbstractContextManager[None]:
        """The run's exclusive writer lock (`curation.store.lock.writer_lock`)."""
        return writer_lock(self.root, wait=wait, timeout=timeout, on_wait=on_wait)
