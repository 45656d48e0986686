"""List columns as flat numpy arrays: what the micro-batches are filled from.

A list<...> column becomes one flat array of its values plus each row's start and length
(`Ragged`), and `spans` turns rows of such an array into index arrays, so a micro-batch is
filled with one numpy assignment per column instead of a Python loop over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["Ragged", "read_ragged", "spans"]


@dataclass(frozen=True)
class Ragged:
    """A list<...> column as one flat numpy array + per-row start and length."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def read_ragged(table: pa.Table, name: str) -> Ragged:
    column = table.column(name)
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise ValueError(f"column {name!r} must be a list column, got {column.type}")
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if array.null_count:
        row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {name!r}: row {row} is null")
    offsets = array.offsets.to_numpy()  # of this (possibly sliced) array, indexing .values
    values = array.values.to_numpy(zero_copy_only=False)
    return Ragged(values, offsets[:-1].astype(np.int64), np.diff(offsets).astype(np.int64))


def spans(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows given by `starts` and `lengths` of a flat array, laid end to end: for each of their
    elements (row number 0..n-1, offset within its row, index into the flat array). The
    micro-batches are filled with these index arrays in one numpy assignment per column,
    not with a Python loop over rows."""
    ends = np.cumsum(lengths)
    row = np.repeat(np.arange(lengths.size), lengths)
    within = np.arange(int(ends[-1]) if ends.size else 0) - np.repeat(ends - lengths, lengths)
    return row, within, starts[row] + within
