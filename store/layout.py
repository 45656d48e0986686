"""The run folder's names and format: its round tables, part and round folder names, the run
format's version and a manifest's seal, the checks that keep every write inside the run folder,
and the small helpers every store module shares (a part file's name and path, a part's contract
columns, DuckDB)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import duckdb
import pyarrow as pa

from store import schema

ROUND_TABLES = ("samples", "scores", "groups", "rejects", "pairs", "prompt_stats")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # stage and part names
ROUND_DIR = re.compile(r"round=(\d+)")  # a round folder's name (RunStore.partition_dir)


def connect() -> duckdb.DuckDBPyConnection:
    """A new in-memory DuckDB connection (close it when done)."""
    return duckdb.connect(":memory:")


def contract_columns(table: str, data: pa.Table, columns: Sequence[str]) -> pa.Table:
    """`columns` of `data` (a part of `table`) in this order and with the contract's types (a
    samples trajectory column's: schema.field_of); a column the part lacks is an optional one,
    given as nulls."""
    wanted = pa.schema([schema.field_of(table, c) if c in data.column_names
                        else schema.field_of(table, c).with_nullable(True) for c in columns])
    arrays = [data.column(c).cast(f.type) if c in data.column_names else pa.nulls(data.num_rows, f.type)
              for c, f in zip(columns, wanted)]
    return pa.Table.from_arrays(arrays, schema=wanted)


PART_FILE = re.compile(r"part-(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*?)(?:-(?P<sha>[0-9a-f]{16}))?\.parquet")
"""A part file's name: `part-<part>-<first 16 hex of its sha256>.parquet` (files an older
groupforge or another tool wrote may lack the hash)."""


def part_name(rel: str) -> str:
    """The part of a part file (`samples/round=1/part-score-s0001-<sha>.parquet` -> 'score-s0001')."""
    name = rel.rsplit("/", 1)[-1]
    m = PART_FILE.fullmatch(name)
    return m["name"] if m else name.removesuffix(".parquet")


def round_of(rel: str) -> int | None:
    """The round of a part file `<table>/round=<n>/<file>` from its folder (None: prompts)."""
    parts = rel.split("/")
    m = ROUND_DIR.fullmatch(parts[1]) if len(parts) == 3 else None
    return int(m[1]) if m else None


def part_rel(table: str, round: int | None, part: str, sha256: str) -> str:
    """Where a part file goes, relative to the run (round None: prompts)."""
    folder = table if round is None else f"{table}/round={check_round(round)}"
    return f"{folder}/part-{check_name(part, 'part')}-{sha256[:16]}.parquet"


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"invalid {what} name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def check_round(round: int) -> int:
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"invalid round {round!r}: expected an integer >= 0")
    return round


FORMAT_VERSION = 3
"""The run format this groupforge writes and reads (manifests' `format_version`): 3 is the
tables' Delta logs and `_commits`; 2 (an older groupforge's RUN/_log/) and 1 (RUN/_manifests/,
or no `format_version`) are read through store/migrate.py."""

SEAL_FIELD = "seal"


class RunFolderError(ValueError):
    """A run folder that does not match its manifests; the message names the file."""


def seal_of(manifest: dict) -> str:
    """sha256 of a manifest's fields other than the seal, as canonical JSON."""
    body = {key: value for key, value in manifest.items() if key != SEAL_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_links(root: Path) -> None:
    """No entry of the run folder (nor a table's round folder) is a symlink that leads out of
    it: every write of a job stays inside the run folder."""
    inside = root.resolve()
    entries = list(root.iterdir()) if root.is_dir() else []
    entries += [sub for table in schema.SCHEMAS if (root / table).is_dir() and not (root / table).is_symlink()
                for sub in (root / table).iterdir()]
    for entry in entries:
        if entry.is_symlink() and not entry.resolve().is_relative_to(inside):
            raise RunFolderError(f"{entry}: a symlink to {entry.resolve()}, outside the run folder {root}; "
                                 "groupforge writes only inside the run folder: replace the link with a folder")


def check_inside(root: Path | None, rel: str) -> None:
    """Refuse a write to `rel` when its folder of a local run resolves outside the run folder
    (a symlink): a RunFolderError naming it."""
    if root is None:
        return
    folder = (root / rel).parent
    while not folder.exists() and folder != root:
        folder = folder.parent  # the nearest folder there is: it decides where the write lands
    if not folder.resolve().is_relative_to(root.resolve()):
        raise RunFolderError(f"{folder}: resolves to {folder.resolve()}, outside the run folder {root} "
                             "(a symlink?); groupforge writes only inside the run folder")
