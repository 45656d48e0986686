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

A commit writes into `_tmp` (same filesystem), then renames each file into place and writes
the manifest last. Readers only glob the table folders, so they never see `_tmp`,
`_staging` or `_manifests`. The `round=<n>` folder and the `round` column inside the file
always agree, so every way of reading a table gives the same rounds:

    duckdb   read_parquet('RUN/samples/**/*.parquet', hive_partitioning=true)   path, BIGINT
    duckdb   read_parquet('RUN/samples/**/*.parquet', hive_partitioning=false)  file, INTEGER
    polars   pl.scan_parquet('RUN/samples/**/*.parquet')                        file, Int32
    polars   pl.scan_parquet('RUN/samples/**/*.parquet', hive_partitioning=True) path, Int32
    pyarrow  pyarrow.dataset.dataset('RUN/samples', partitioning='hive')         path, int32

(`pyarrow.parquet.read_table('RUN/samples')` fails: it infers `round` from the folders as a
dictionary type that does not merge with the int32 column; use `pyarrow.dataset` as above.)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation import schema

ROUND_TABLES = ("samples", "scores", "groups", "rejects", "pairs")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # stage and part names
_ROUND_DIR = re.compile(r"round=(\d+)")
_MANIFEST_FIELDS = {"stage", "round", "inputs", "config", "config_hash", "code_version", "outputs",
                    "output_rows", "rows_in", "rows_out", "drops", "created_at"}
_COMMIT_ROUND: Any = object()  # default of Commit.write(round=...): the commit's round
_HELD: dict[Path, int] = {}  # run roots whose lock this process holds, with a nesting count


class RunLockedError(RuntimeError):
    """Another process holds the run's writer lock. The message names the run and the holder."""


# ---- fingerprints -------------------------------------------------------------------


def fingerprint_file(path: str | Path) -> str:
    """sha256 (hex) of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint_path(path: str | Path) -> str:
    """sha256 of a file, or of a folder: its sorted relative paths and their content hashes."""
    path = Path(path)
    if path.is_file():
        return fingerprint_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"cannot fingerprint {path}: no such file or folder")
    digest = hashlib.sha256()
    for rel in sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()):
        digest.update(f"{rel}\0{fingerprint_file(path / rel)}\n".encode())
    return digest.hexdigest()


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"config value {value!r} ({type(value).__name__}) is not JSON-serialisable")


def _canonical_json(config: Mapping) -> str:
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"), default=_json_default)


def config_hash(config: Mapping) -> str:
    """sha256 of the canonical JSON of `config` (sorted keys), so key order does not matter."""
    return hashlib.sha256(_canonical_json(config).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """'groupforge <version> (<short commit>[-dirty])', or without the commit outside a git checkout."""
    try:
        version = importlib.metadata.version("groupforge")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    here = Path(__file__).resolve()
    try:
        git = ["git", "-C", str(here.parent)]
        top, commit = subprocess.run(git + ["rev-parse", "--show-toplevel", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=10, check=True).stdout.split()
        if (Path(top) / "curation" / here.name).resolve() != here:
            return f"groupforge {version}"  # installed inside some other repository
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return f"groupforge {version}"
    return f"groupforge {version} ({commit}{'-dirty' if dirty else ''})"


# ---- small helpers ------------------------------------------------------------------


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"invalid {what} name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def _check_round(round: int) -> int:
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"invalid round {round!r}: expected an integer >= 0")
    return round


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_json(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=_json_default)


def _write_text_atomic(path: Path, text: str, tmp_dir: Path) -> None:
    tmp = tmp_dir / f"{path.name}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# ---- the store ----------------------------------------------------------------------


class RunStore:
    """One run directory (see the module docstring). Creates nothing until something is written."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r})"

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
        return self.table_dir(table) / f"round={_check_round(round)}"

    def table_glob(self, table: str) -> str:
        """The glob that reads the whole table, e.g. 'RUN/samples/**/*.parquet'."""
        pattern = "*.parquet" if table == "prompts" else "**/*.parquet"
        return str(self.table_dir(table) / pattern)

    def rounds(self, table: str) -> list[int]:
        """The rounds that hold at least one part file, ascending."""
        if table == "prompts":
            raise ValueError("the prompts table is not partitioned by round")
        found = []
        if self.table_dir(table).is_dir():
            for d in self.table_dir(table).iterdir():
                m = _ROUND_DIR.fullmatch(d.name)
                if m and d.is_dir() and any(d.glob("*.parquet")):
                    found.append(int(m[1]))
        return sorted(found)

    def files(self, table: str, rounds: int | Sequence[int] | None = None) -> list[Path]:
        """The part files of `table` (all rounds, or the given ones), in round then name order."""
        if table == "prompts":
            if rounds is not None:
                raise ValueError("the prompts table is not partitioned by round")
            return sorted(self.table_dir(table).glob("*.parquet"))
        wanted = self.rounds(table) if rounds is None else [rounds] if isinstance(rounds, int) else rounds
        return [f for r in sorted(set(wanted))
                for f in sorted(self.partition_dir(table, r).glob("*.parquet"))]

    def staging_dir(self, stage: str, round: int) -> Path:
        path = self.root / "_staging" / f"{_check_name(stage, 'stage')}-round={_check_round(round)}"
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
        con = duckdb.connect()
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
        contract = schema.SCHEMAS[table]
        unknown = [c for c in columns if c not in contract.names]
        if unknown:
            raise ValueError(f"the {table} table has no column(s) {unknown} in its contract; "
                             f"known: {', '.join(contract.names)}")
        wanted = pa.schema([contract.field(c) for c in columns])
        check_round = validate and table != "prompts"
        parts = []
        for path in self.files(table, rounds):
            if path.stem.removeprefix("part-") in exclude_parts:
                continue
            try:
                found = pq.read_schema(path)
                if validate:
                    schema.validate(found.empty_table(), table, path)
                present = [c for c in columns if c in found.names]
                extra = ["round"] if check_round and "round" not in present else []
                part = pq.read_table(path, columns=present + extra)
            except (pa.ArrowInvalid, OSError):
                schema.read_table_file(path, table)  # raises SchemaError naming the file
                raise
            if check_round and part.num_rows:
                folder = int(_ROUND_DIR.fullmatch(path.parent.name)[1])
                lo, hi = pc.min_max(part.column("round")).as_py().values()
                if (lo, hi) != (folder, folder):
                    raise schema.SchemaError(f"{table} table ({path}): column 'round' holds {lo}..{hi}, "
                                             f"but the file is in folder round={folder}")
            arrays = [part.column(c).cast(f.type) if c in present else pa.nulls(part.num_rows, f.type)
                      for c, f in zip(columns, wanted)]  # a missing column: an optional one (validated)
            parts.append(pa.Table.from_arrays(arrays, schema=wanted))
        result = pa.concat_tables(parts) if parts else wanted.empty_table()
        if validate:
            for field in wanted:
                nulls = result.column(field.name).null_count
                if not field.nullable and nulls:
                    raise schema.SchemaError(f"{table} table ({self.table_glob(table)}): column {field.name!r} "
                                             f"has {nulls} null value(s)")
        return result

    def _check_round_folders(self, con: duckdb.DuckDBPyConnection, table: str, paths: list[str]) -> None:
        sql = ("SELECT filename, min(round), max(round) FROM read_parquet($files, hive_partitioning = false,"
               " filename = true) GROUP BY filename")
        for filename, lo, hi in con.sql(sql, params={"files": paths}).fetchall():
            folder = int(_ROUND_DIR.fullmatch(Path(filename).parent.name)[1])
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
        return self.root / "_manifests" / f"{_check_name(stage, 'stage')}-round={_check_round(round)}.json"

    def _pending_path(self, stage: str, round: int) -> Path:
        return self.manifest_path(stage, round).with_suffix(".pending")  # not *.json: not a manifest

    def load_manifest(self, stage: str, round: int) -> dict | None:
        return _load_json(self.manifest_path(stage, round))

    def is_up_to_date(self, stage: str, round: int, inputs: dict[str, str], config: Mapping) -> bool:
        """True when the stage's last commit had these inputs and config, and its outputs all exist."""
        manifest = self.load_manifest(stage, round)
        if manifest is None or self._pending_path(stage, round).exists():
            return False  # never committed, or a commit died while publishing
        return (manifest.get("inputs") == dict(inputs)
                and manifest.get("config_hash") == config_hash(config)
                and all((self.root / rel).is_file() for rel in manifest.get("outputs", [])))

    # -- writing
    def commit(self, stage: str, round: int, inputs: dict[str, str], config: Mapping) -> Commit:
        """A context manager that writes a stage's outputs atomically (see `Commit`)."""
        return Commit(self, stage, round, inputs, config)

    @contextlib.contextmanager
    def lock(self, wait: bool = True, timeout: float | None = None,
             on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """The exclusive writer lock (flock on RUN/.lock), re-entrant within one process.

        `wait=False`, or `timeout` seconds passing, raises RunLockedError naming the holder;
        `on_wait(message)` is called once when the lock is busy and we start waiting.
        """
        key = self.root.resolve()
        if _HELD.get(key):
            _HELD[key] += 1
            try:
                yield
            finally:
                _HELD[key] -= 1
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._acquire(fd, path, wait, timeout, on_wait)
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                      "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            _HELD[key] = 1
            try:
                yield
            finally:
                del _HELD[key]
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _acquire(self, fd: int, path: Path, wait: bool, timeout: float | None,
                 on_wait: Callable[[str], None] | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            message = f"run {self.root} is locked by {_describe_holder(path)}"
            if not wait:
                raise RunLockedError(message)
            if deadline is not None and time.monotonic() >= deadline:
                raise RunLockedError(f"{message}; gave up after {timeout:g}s")
            if on_wait is not None and not waited:
                on_wait(message + "; waiting")
            waited = True
            time.sleep(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _describe_holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class Commit:
    """Writes one stage's outputs for one round; nothing is visible until the `with` block ends.

    On success: every part file is renamed into place, the stage's earlier part files that
    were not rewritten are deleted, the manifest is written last, and the temporary and
    staging folders are removed. On an exception: nothing is published and it re-raises.
    A pending journal (`_manifests/<stage>-round=<n>.pending`) lists what is being
    published, so a process killed half-way leaves no file that the next commit forgets.
    """

    def __init__(self, store: RunStore, stage: str, round: int, inputs: Mapping[str, str], config: Mapping):
        self.store, self.stage, self.round = store, _check_name(stage, "stage"), _check_round(round)
        self.inputs = dict(inputs)
        self.config = json.loads(_canonical_json(config))  # fails early if not JSON-serialisable
        self._staged: dict[Path, Path] = {}  # final path -> temporary path
        self._rows: dict[str, int] = {}
        self._record: dict[str, object] = {"rows_in": None, "rows_out": None, "drops": {}}
        self._owners: dict[str, str] | None = None
        self._tmp: Path | None = None

    def __enter__(self) -> Commit:
        name = f"{self.stage}-round={self.round}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp = self.store.root / "_tmp" / name
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
              round: int | None = _COMMIT_ROUND) -> None:
        """Validate `data` as `table` and stage it as `part-<part>.parquet` (default part: the stage).

        `data` is a pyarrow Table or anything `pa.table` accepts (a polars DataFrame, a dict).
        """
        if self._tmp is None:
            raise RuntimeError("Commit.write must be called inside `with store.commit(...)`")
        if round is _COMMIT_ROUND:
            round = None if table == "prompts" else self.round
        if table in ROUND_TABLES and round is None:
            raise ValueError(f"the {table} table is partitioned by round; give a round")
        part = _check_name(part or self.stage, "part")
        final = self.store.partition_dir(table, round) / f"part-{part}.parquet"
        rel = final.relative_to(self.store.root).as_posix()
        if final in self._staged:
            raise ValueError(f"{rel} is written twice in one commit of stage {self.stage!r}")
        owner = self._owner(rel)
        if owner is not None and owner != self.stage:
            raise ValueError(f"{rel} belongs to stage {owner!r}; "
                             f"stage {self.stage!r} must write another part name")
        data = data if isinstance(data, pa.Table) else pa.table(data)
        data = schema.validate(data, table, source=f"{rel}, written by stage {self.stage!r}")
        if round is not None and data.num_rows:
            lo, hi = pc.min(data["round"]).as_py(), pc.max(data["round"]).as_py()
            if (lo, hi) != (round, round):
                raise schema.SchemaError(f"{table} table ({rel}): column 'round' holds {lo}..{hi}, "
                                         f"but it is written to round={round}")
        tmp = self._tmp / rel
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            pq.write_table(data, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        self._staged[final] = tmp
        self._rows[rel] = data.num_rows

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
        self._record.update(json.loads(_to_json(extra)))  # fails here, not while publishing

    def _owner(self, rel: str) -> str | None:
        """The stage whose manifest (or pending journal) lists `rel`, if any."""
        if self._owners is None:
            self._owners = {}
            for path in sorted((self.store.root / "_manifests").glob("*")):
                if path.suffix not in (".json", ".pending"):
                    continue
                manifest = _load_json(path) or {}
                for out in manifest.get("outputs", []):
                    self._owners[out] = manifest.get("stage")
        return self._owners.get(rel)

    def _listed_elsewhere(self) -> set[str]:
        """Outputs that another round's manifest lists too (a prompts part shared by rounds)."""
        mine = {self.store.manifest_path(self.stage, self.round), self.store._pending_path(self.stage, self.round)}
        listed: set[str] = set()
        for path in (self.store.root / "_manifests").glob("*"):
            if path.suffix in (".json", ".pending") and path not in mine:
                listed.update((_load_json(path) or {}).get("outputs", []))
        return listed

    def _publish(self) -> None:
        store, root = self.store, self.store.root
        manifest_path = store.manifest_path(self.stage, self.round)
        journal_path = store._pending_path(self.stage, self.round)
        before = set()
        for earlier in (store.load_manifest(self.stage, self.round), _load_json(journal_path)):
            before.update((earlier or {}).get("outputs", []))
        before = {rel for rel in before if _is_part_file(rel)}  # never delete anything else
        outputs = sorted(self._rows)
        manifest = _to_json({
            "stage": self.stage, "round": self.round, "inputs": self.inputs, "config": self.config,
            "config_hash": config_hash(self.config), "code_version": code_version(),
            "outputs": outputs, "output_rows": self._rows,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **self._record,
        })
        journal = {"stage": self.stage, "round": self.round, "outputs": sorted(before | set(outputs))}
        _write_text_atomic(journal_path, _to_json(journal), self._tmp)
        touched = set()
        for final, tmp in self._staged.items():
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)  # overwrites a stale part of an interrupted attempt
            touched.update((final.parent, final.parent.parent))  # the file, and a new partition
        for rel in before - set(outputs) - self._listed_elsewhere():
            (root / rel).unlink(missing_ok=True)
            if (root / rel).parent.is_dir():
                touched.add((root / rel).parent)
        for folder in touched:
            _fsync_dir(folder)
        _write_text_atomic(manifest_path, manifest, self._tmp)  # last: the commit point
        journal_path.unlink()
        shutil.rmtree(root / "_staging" / f"{self.stage}-round={self.round}", ignore_errors=True)


def _is_part_file(rel: str) -> bool:
    parts = Path(rel).parts
    return (len(parts) in (2, 3) and parts[0] in schema.SCHEMAS and ".." not in parts
            and parts[-1].startswith("part-") and parts[-1].endswith(".parquet"))
