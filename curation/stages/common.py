"""What the curation stages share: the rejects helper and groups as integers.

Each stage file (score.py, filter.py, label.py, pair.py) declares the tables it reads and
writes and one pure transform; runner.py runs any of them (fingerprints, up-to-date check,
read, transform, validate, atomic commit). This module holds the table helpers their
transforms use: `rejects_table`, `drop_counts`, group ids, `SampleIndex`, `unrejected` (the
samples no rejects row names, with their rewards) and `group_moments` (count, min, max, mean,
variance per group). They are numpy and Arrow compute, not Polars queries: a query costs
~0.3-0.5 ms however few the rows, more than a whole transform at a round of 512 samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from store.schema import KEYS, SCHEMAS

GROUP = ("run_id", "round", "prompt_id")


def rejects_table(run_id: list[str] | str, round: list[int] | int, prompt_id: list[str], sample_idx: list[int | None],
                  stage: str, reason: list[str] | str, detail: list[str | None] | None = None) -> pa.Table:
    """A rejects table; scalar arguments are repeated for every row."""
    n = len(prompt_id)

    def column(value):
        return value if isinstance(value, list) else [value] * n

    return pa.Table.from_pydict(
        {
            "run_id": column(run_id),
            "round": column(round),
            "prompt_id": prompt_id,
            "sample_idx": sample_idx,
            "stage": column(stage),
            "reason": column(reason),
            "detail": detail if detail is not None else [None] * n,
        },
        schema=SCHEMAS["rejects"],
    )


def drop_counts(rejects: pa.Table) -> dict[str, int]:
    """{reason: rows} of a rejects table."""
    counts = pc.value_counts(rejects.column("reason")).to_pylist()
    return {c["values"]: c["counts"] for c in counts}


# ---- groups as integers ----------------------------------------------------------------
#
# Stages find a sample's group, and the scores and rejects rows of a sample, through integer
# group ids (`gid`), not by joining on the 64-char prompt_id: strings are compared once per
# run of adjacent rows with equal keys, and a table's rows become positions in the samples.


def group_ids(table: pa.Table, by: tuple[str, ...] = GROUP) -> pl.Series:
    """One int64 `gid` per row, equal for rows with equal `by` columns (a group: run_id,
    round, prompt_id). Grouping by one integer is ~3x faster than by three key columns, and
    the key strings never enter Polars.

    Fast path: each group is one run of adjacent rows, as the generate stage writes samples
    (gid = number of the run). Otherwise: the columns' dictionary codes packed into one number.
    """
    return pl.Series("gid", _group_ids(table, by)[0])


def _group_ids(table: pa.Table, by: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    """(group_ids, the boolean run starts when each group is one run (the fast path), else None)."""
    starts = _run_starts(table, by)
    at_starts = table.column(by[-1]).filter(starts)
    if len(pc.unique(at_starts)) == len(at_starts):  # no two runs share a key: each group is one run
        return np.cumsum(starts, dtype=np.int64) - 1, starts
    ids = np.zeros(table.num_rows, dtype=np.int64)
    for column in by:
        encoded = pc.dictionary_encode(table.column(column)).combine_chunks()  # one dictionary
        ids = ids * len(encoded.dictionary) + encoded.indices.to_numpy(zero_copy_only=False)
    return ids, None


def _run_starts(table: pa.Table, by: tuple[str, ...]) -> np.ndarray:
    """True at each row whose `by` columns differ from the row before (and at row 0)."""
    n = table.num_rows
    starts = np.ones(n, dtype=bool)
    if n > 1:
        starts[1:] = False
        for column in by:
            values = table.column(column)
            starts[1:] |= pc.not_equal(values.slice(1), values.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    return starts


def rows_of(table: pa.Table, rows: np.ndarray | pl.Series) -> pa.Table:
    """The rows at the ascending positions `rows`, or where the boolean mask `rows` is True
    (a boolean filter: much faster than take)."""
    rows = rows.to_numpy() if isinstance(rows, pl.Series) else rows
    if rows.dtype == bool:
        return table.filter(rows)
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[rows] = True
    return table.filter(mask)


class SampleIndex:
    """Where each group and each sample of a samples table is, as integers.

    `gid`: a dense group id per samples row (0, 1, ... in order of first appearance);
    `first`: each group's first row. `match` and `named` find the scores and rejects rows of
    each sample: their group keys are compared with the samples' once per run of adjacent
    equal keys (a join only when the groups differ from the samples'), and when every group
    is one run of adjacent rows with sample_idx 0, 1, ... (as generate writes them) the row
    of (group g, sample i) is first[g] + i, with no join at all; otherwise rows are joined on
    the integers (gid, sample_idx).
    """

    def __init__(self, samples: pa.Table):
        self.keys = samples.select(list(KEYS))
        n = self.keys.num_rows
        gid, starts = _group_ids(self.keys, GROUP)
        if starts is None:  # packed codes: make them dense, in order of first appearance
            gid = pc.dictionary_encode(pa.array(gid)).indices.to_numpy(zero_copy_only=False).astype(np.int64)
            starts = np.diff(gid, prepend=-1) != 0
            contiguous = not (np.diff(gid) < 0).any()  # ids in order of first appearance never go back
        else:
            contiguous = True
        self.gid, self.n_groups = gid, int(gid[-1]) + 1 if n and contiguous else int(gid.max(initial=-1)) + 1
        self.first = np.flatnonzero(starts) if contiguous else np.unique(gid, return_index=True)[1]
        self.sizes = np.diff(self.first, append=n)  # rows per group when contiguous
        self.sample_idx = self.keys.column("sample_idx").to_numpy(zero_copy_only=False)
        # standard layout: sample_idx counts 0, 1, ... within each group
        self.standard = contiguous and bool(np.all(self.sample_idx[self.first] == 0)) and \
            bool(np.all((np.diff(self.sample_idx) == 1) | starts[1:]))

    def group_of(self, other: pa.Table) -> np.ndarray:
        """The gid of each row of `other` (by run_id, round, prompt_id); -1 where the samples
        have no such group."""
        m = other.num_rows
        if m == 0 or self.n_groups == 0:
            return np.full(m, -1, dtype=np.int64)
        starts = np.flatnonzero(_run_starts(other, GROUP))
        heads = rows_of(other.select(list(GROUP)), starts)
        groups = rows_of(self.keys.select(list(GROUP)), self.first)  # first is ascending: ids by first appearance
        if heads.num_rows == groups.num_rows and all(heads.column(c).equals(groups.column(c)) for c in GROUP):
            found = np.arange(self.n_groups, dtype=np.int64)  # the same groups in the same order
        else:  # one run_id and round on both sides (the usual case): look up prompt_id alone
            on = [c for c in GROUP if not _one_value_in_both(heads.column(c), groups.column(c))] or ["prompt_id"]
            found = _positions_in(heads, groups, on)
        return np.repeat(found, np.diff(starts, append=m))

    def match(self, other: pa.Table) -> np.ndarray:
        """For each samples row, the row of `other` (keys run_id, round, prompt_id, sample_idx)
        with the same keys, or -1 (a left join). Raises DuplicateKeys when two rows of `other`
        in the samples' groups have the same keys."""
        found = np.full(len(self.gid), -1, dtype=np.int64)
        if self.n_groups == 0:
            return found
        gid, idx, known = self._keys_of(other)
        if self.standard:
            row = self._rows(gid, idx, known)
            hit = np.flatnonzero(row >= 0)
            unique = len(hit) == 0 or np.bincount(row[hit]).max() == 1
            lost = known & (row < 0)  # in a samples group but not one of its samples: these must be unique too
            if unique and lost.any():
                unique = pl.DataFrame({"gid": gid[lost], "sample_idx": idx[lost]}).is_unique().all()
            if not unique:
                raise DuplicateKeys
            found[row[hit]] = hit
            return found
        right = pl.DataFrame({"gid": gid[known], "sample_idx": idx[known], "other": np.flatnonzero(known)})
        left = pl.DataFrame({"gid": self.gid, "sample_idx": self.sample_idx.astype(np.int64)})
        try:
            joined = left.join(right, on=["gid", "sample_idx"], how="left", validate="m:1", maintain_order="left")
        except pl.exceptions.ComputeError:  # m:1 failed
            raise DuplicateKeys from None
        return joined.get_column("other").fill_null(-1).to_numpy()

    def named(self, rejects: pa.Table) -> np.ndarray:
        """True at each samples row that a rejects row names: by its keys, or every sample of
        its group when its sample_idx is null."""
        if self.n_groups == 0:
            return np.zeros(0, dtype=bool)
        gid, idx, known = self._keys_of(rejects)
        by_sample = known & ~rejects.column("sample_idx").is_null().to_numpy(zero_copy_only=False)
        whole = np.zeros(self.n_groups, dtype=bool)
        whole[gid[known & ~by_sample]] = True
        named = whole[self.gid]
        if self.standard:
            row = self._rows(gid, idx, by_sample)
            named[row[row >= 0]] = True
        elif by_sample.any():
            asked = pl.DataFrame({"gid": gid[by_sample], "sample_idx": idx[by_sample]}).unique()
            left = pl.DataFrame({"gid": self.gid, "sample_idx": self.sample_idx.astype(np.int64)}).with_row_index("row")
            named[left.join(asked, on=["gid", "sample_idx"], how="semi").get_column("row").to_numpy()] = True
        return named

    def _keys_of(self, other: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gid, sample_idx with nulls as -1, gid found) of each row of `other`."""
        gid = self.group_of(other)
        idx = pc.fill_null(other.column("sample_idx"), -1).to_numpy(zero_copy_only=False).astype(np.int64)
        return gid, idx, gid >= 0

    def _rows(self, gid: np.ndarray, idx: np.ndarray, ask: np.ndarray) -> np.ndarray:
        """Standard layout: the samples row of (gid, sample_idx) where `ask`, else -1."""
        g = np.where(ask, gid, 0)
        ok = ask & (idx >= 0) & (idx < self.sizes[g])
        return np.where(ok, self.first[g] + idx, -1)


def _positions_in(rows: pa.Table, table: pa.Table, on: list[str]) -> np.ndarray:
    """For each row of `rows`, the position of the row of `table` with equal `on` columns (the
    rows of `table` are distinct on them), or -1: Arrow hash lookups, with no fixed cost of a
    query engine (a Polars join costs ~0.5 ms however small the tables)."""
    if len(on) == 1:
        needles, haystack = rows.column(on[0]), table.column(on[0]).combine_chunks()
    else:  # the columns' dictionary codes over both tables, packed into one integer
        needles = np.zeros(rows.num_rows, dtype=np.int64)
        haystack = np.zeros(table.num_rows, dtype=np.int64)
        for column in on:
            both = pa.chunked_array(table.column(column).chunks + rows.column(column).chunks)
            encoded = pc.dictionary_encode(both).combine_chunks()
            codes = encoded.indices.to_numpy(zero_copy_only=False)
            haystack = haystack * len(encoded.dictionary) + codes[:table.num_rows]
            needles = needles * len(encoded.dictionary) + codes[table.num_rows:]
        needles, haystack = pa.array(needles), pa.array(haystack)
    found = pc.index_in(needles, value_set=haystack)
    return pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def _one_value_in_both(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    """True when `a` and `b` hold one and the same value in every row."""
    lo_hi = pc.min_max(a).as_py()
    return lo_hi["min"] == lo_hi["max"] and pc.min_max(b).as_py() == lo_hi


class DuplicateKeys(ValueError):
    """Two rows of a table that must have one row per sample share (run_id, round, prompt_id, sample_idx)."""


def unrejected(samples: pa.Table, scores: pa.Table, rejects: pa.Table, columns: tuple[str, ...] = ()) -> pa.Table:
    """The samples that no rejects row names, in samples order: `row` (int64, position in
    samples), `gid` (int64, see SampleIndex), sample_idx, reward (float64, null when unscored)
    and `columns` of samples.

    A rejects row names one sample, or every sample of its prompt when its sample_idx is null.
    An Arrow table, not a Polars frame: building one costs microseconds, where a Polars
    `with_columns` runs a query (~0.3 ms at any size).
    """
    index = SampleIndex(samples)
    reward = scores.column("reward")
    if not _same_keys(samples, scores):  # as the score stage writes them, they are: no lookup needed
        try:
            at = index.match(scores)
        except DuplicateKeys:
            raise ValueError("scores table: a (run_id, round, prompt_id, sample_idx) appears more than once; "
                             "a sample has one reward") from None
        reward = pc.take(reward, nullable_indices(at))
    keep = ~index.named(rejects) if rejects.num_rows else None
    out = {"row": np.flatnonzero(keep) if keep is not None else np.arange(samples.num_rows, dtype=np.int64),
           "gid": index.gid if keep is None else index.gid[keep],
           "sample_idx": samples.column("sample_idx"), "reward": reward.cast(pa.float64()),
           **{c: samples.column(c) for c in columns}}
    if keep is not None:
        mask = pa.array(keep)
        out.update({c: out[c].filter(mask) for c in ("sample_idx", "reward", *columns)})
    return pa.table(out)


# ---- statistics per group --------------------------------------------------------------------


@dataclass
class GroupMoments:
    """Per group (index: gid): rows, min, max, mean and sample variance (ddof=1) of a value.

    What the Polars window functions `over(gid)` that the stages used gave, bit for bit
    (tests/curation/test_common.py checks them against Polars): mean = the sum in row order /
    rows (np.bincount adds in row order); var = Welford's running update in row order,
    dp / (rows - 1), NaN for one row (Polars: null); min and max keep the later of equal
    values (0.0 and -0.0); a group of one row has its value as mean (-0.0 stays -0.0). Groups
    without rows: count 0 and NaN elsewhere. Polars itself sometimes sums a window in another
    order (a last-bit difference in ~1 run of 10 on sums that are not exact; never on 0/1
    rewards); these are the same every run.
    """

    count: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    mean: np.ndarray
    var: np.ndarray | None


def group_moments(gid: np.ndarray, values: np.ndarray, n_groups: int, variance: bool = True) -> GroupMoments:
    """GroupMoments of float64 `values` by `gid` (0 <= gid < n_groups); var None unless `variance`.

    Welford is sequential within a group, so its loop runs over positions in the group (0, 1,
    ...) and each step updates every group that long at once: (largest group) steps of numpy
    over n_groups values, O(rows) in all. Groups are taken longest first so that the groups a
    step updates are a prefix of the state arrays (slices, no masks).
    """
    count = np.bincount(gid, minlength=n_groups)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.bincount(gid, weights=values, minlength=n_groups) / count
    lo, hi = np.full(n_groups, np.inf), np.full(n_groups, -np.inf)
    var = np.full(n_groups, np.nan) if variance else None
    if not variance or len(values) == 0:
        np.minimum.at(lo, gid, values)  # in row order: np.minimum(a, b) is b when a == b, the later value
        np.maximum.at(hi, gid, values)
    else:
        order = np.argsort(gid, kind="stable") if (np.diff(gid) < 0).any() else None  # rows group by group
        start = np.cumsum(count) - count
        by_size = np.argsort(-count, kind="stable")  # identity when every group has the same size
        longest = int(count[by_size[0]])
        same_size = int(count[by_size[-1]]) == longest
        first = start if same_size else start[by_size]
        going = n_groups - np.cumsum(np.bincount(count, minlength=longest + 1))  # groups with count > k
        running, dp = np.zeros(n_groups), np.zeros(n_groups)
        for k in range(longest):
            a = int(going[k])
            at = first[:a] + k
            x = values[at if order is None else order[at]]
            m, d2, low, high = running[:a], dp[:a], lo[:a], hi[:a]
            delta = x - m  # Welford: Polars' VarState.add_one
            m += delta / (k + 1)
            d2 += delta * (x - m)
            np.minimum(low, x, out=low)
            np.maximum(high, x, out=high)
        if not same_size:  # back to gid order
            for state in (dp, lo, hi):
                state[by_size] = state.copy()
        with np.errstate(divide="ignore", invalid="ignore"):
            var = np.maximum(dp / (count - 1), 0.0)
        var[count <= 1] = np.nan
    one = count == 1
    if one.any():
        mean[one] = lo[one]
    empty = count == 0
    lo[empty] = hi[empty] = np.nan
    return GroupMoments(count, lo, hi, mean, var)


def nullable_indices(at: np.ndarray) -> pa.Array:
    """`at` as an int64 Arrow array, null where `at` < 0 (for take: a null result); pa.array(mask=)
    is ~50x slower."""
    missing = at < 0
    validity = pa.py_buffer(np.packbits(~missing, bitorder="little")) if missing.any() else None
    return pa.Array.from_buffers(pa.int64(), len(at), [validity, pa.py_buffer(np.where(missing, 0, at))])


def _same_keys(a: pa.Table, b: pa.Table) -> bool:
    return a.num_rows == b.num_rows and all(a.column(k).equals(b.column(k)) for k in KEYS)
