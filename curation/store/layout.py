"""The run folder's names: its round tables, part and round folder names, and the small
helpers every store module shares (listing part files, a part's contract columns, DuckDB)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import duckdb
import pyarrow as pa

from curation import schema

ROUND_TABLES = ("samples", "scores", "groups", "rejects", "pairs")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # stage and part names
ROUND_DIR = re.compile(r"round=(\d+)")  # a round folder's name (RunStore.partition_dir)


def connect() -> duckdb.DuckDBPyConnection:
    """A new in-memory DuckDB connection (close it when done)."""
    return duckdb.connect(":memory:")


def contract_columns(table: str, data: pa.Table, columns: Sequence[str]) -> pa.Table:
    """`columns` of `data` (a part of `table`) in this order and with the contract's types; a
    column the part lacks is an optional one, given as nulls."""
    wanted = pa.schema([schema.SCHEMAS[table].field(c) for c in columns])
    arrays = [data.column(c).cast(f.type) if c in data.column_names else pa.nulls(data.num_rows, f.type)
              for c, f in zip(columns, wanted)]
    return pa.Table.from_arrays(arrays, schema=wanted)


def parquet_files(folder: Path) -> list[Path]:
    """The *.parquet files of `folder`, by name ([] when there is no folder)."""
    try:
        return sorted(folder / entry.name for entry in os.scandir(folder)
                      if entry.name.endswith(".parquet") and entry.is_file())
    except (FileNotFoundError, NotADirectoryError):
        return []


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"invalid {what} name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def check_round(round: int) -> int:
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"invalid round {round!r}: expected an integer >= 0")
    return round
