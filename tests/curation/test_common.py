"""curation/stages/common.py: group ids, SampleIndex and group_moments against plain-Python references."""

from __future__ import annotations

import math
import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from curation.stages.common import DuplicateKeys, SampleIndex, group_ids, group_moments, unrejected
from store.schema import KEYS

GROUPS = [("r", 0, "p"), ("r", 0, "q"), ("r", 1, "p"), ("s", 0, "p"), ("r", 0, "x" * 64)]


def keys_table(rows: list[tuple], extra: dict | None = None) -> pa.Table:
    columns = list(zip(*rows)) if rows else [[], [], [], []]
    table = pa.table({"run_id": pa.array(columns[0], pa.string()), "round": pa.array(columns[1], pa.int32()),
                      "prompt_id": pa.array(columns[2], pa.string()), "sample_idx": pa.array(columns[3], pa.int32())})
    for name, values in (extra or {}).items():
        table = table.append_column(name, values)
    return table


@st.composite
def samples_keys(draw) -> list[tuple]:
    """Samples keys in one of the layouts the stages meet: as generate writes them (groups in
    runs, sample_idx 0, 1, ...), with gaps, shuffled, or with repeated keys."""
    groups = draw(st.lists(st.sampled_from(GROUPS), unique=True, max_size=len(GROUPS)))
    rows = [(*g, i) for g in groups for i in range(draw(st.integers(1, 4)))]
    layout = draw(st.sampled_from(["standard", "gaps", "shuffled", "repeats"]))
    if layout == "gaps":
        rows = [r for r in rows if draw(st.booleans()) or r[3] == 0]
    elif layout == "shuffled":
        rows = draw(st.permutations(rows))
    elif layout == "repeats" and rows:
        rows = rows + draw(st.lists(st.sampled_from(rows), max_size=3))
    return rows


def other_keys(draw, samples: list[tuple], null_idx: bool) -> list[tuple]:
    """Keys of samples, of their groups with other sample_idx, and of other groups, in any order."""
    pool = sorted(set(samples)) + [(*g, i) for g in GROUPS for i in (0, 1, 7)]
    rows = draw(st.lists(st.sampled_from(pool), max_size=12))
    if null_idx:
        rows += [(*g, None) for g in draw(st.lists(st.sampled_from(GROUPS), max_size=2))]
    return draw(st.permutations(rows))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_match_and_named_are_the_plain_left_join_and_anti_join(data):
    samples = data.draw(samples_keys())
    index = SampleIndex(keys_table(samples))
    scores = other_keys(data.draw, samples, null_idx=False)
    groups = {s[:3] for s in samples}
    in_groups = [k for k in scores if k[:3] in groups]
    if len(set(in_groups)) < len(in_groups):
        with pytest.raises(DuplicateKeys):
            index.match(keys_table(scores))
    else:
        assert index.match(keys_table(scores)).tolist() == [scores.index(s) if s in scores else -1 for s in samples]
    rejects = other_keys(data.draw, samples, null_idx=True)
    named = [s in rejects or (*s[:3], None) in rejects for s in samples]
    assert index.named(keys_table(rejects)).tolist() == named
    gid = index.gid.tolist()
    assert sorted(set(gid)) == list(range(len(groups)))  # dense
    assert all((gid[a] == gid[b]) == (samples[a][:3] == samples[b][:3])
               for a in range(len(samples)) for b in range(len(samples)))


def test_unrejected_keeps_samples_order_and_takes_rewards_by_key():
    samples = [("r", 0, "p", 0), ("r", 0, "p", 1), ("r", 0, "q", 0), ("r", 0, "q", 1), ("r", 0, "q", 2)]
    scores = keys_table([samples[4], samples[0], samples[2], samples[3]],
                        {"reward": pa.array([4.0, 0.0, 2.0, None])})
    rejects = keys_table([("r", 0, "q", 0), ("r", 0, "z", None), ("r", 1, "p", 1)])
    rows = unrejected(keys_table(samples, {"response": pa.array(list("abcde"))}), scores, rejects, ("response",))
    assert rows.column("row").to_pylist() == [0, 1, 3, 4]
    assert rows.column("reward").to_pylist() == [0.0, None, None, 4.0]
    assert rows.column("response").to_pylist() == ["a", "b", "d", "e"]
    assert rows.column("gid").to_pylist() == [0, 0, 1, 1]
    whole = keys_table([("r", 0, "p", None)])
    assert unrejected(keys_table(samples), scores, whole).column("row").to_pylist() == [2, 3, 4]


def test_group_ids_of_an_empty_table():
    assert group_ids(keys_table([])).to_list() == []
    assert SampleIndex(keys_table([])).match(keys_table([("r", 0, "p", 0)])).tolist() == []
    assert list(KEYS) == keys_table([]).column_names


def reference_moments(gid: list[int], values: list[float], n_groups: int) -> list[tuple]:
    """Per group, in plain Python: (rows, min, max, mean, var) as GroupMoments defines them."""
    out = []
    for g in range(n_groups):
        xs = [x for i, x in zip(gid, values) if i == g]
        if not xs:
            out.append((0, None, None, None, None))
            continue
        total, n, mean, dp, lo, hi = 0.0, 0, 0.0, 0.0, math.inf, -math.inf
        for x in xs:  # row order: the sum, Welford's update, and the later of equal values for min/max
            total += x
            n += 1
            delta = x - mean
            mean += delta / n
            dp += delta * (x - mean)
            lo = x if x <= lo else lo
            hi = x if x >= hi else hi
        out.append((n, lo, hi, xs[0] if n == 1 else total / n, max(dp / (n - 1), 0.0) if n > 1 else None))
    return out


def same_bits(a, b) -> bool:
    return (a is None and math.isnan(b)) or (a is not None and struct.pack("<d", a) == struct.pack("<d", float(b)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, -0.0, 1.0, 0.1, 0.7, 1e-9, 3.3, -2.5, 1e6])),
                max_size=60),
       st.booleans())
def test_group_moments_are_the_row_order_sum_welford_and_later_min_max(rows, variance):
    gid = np.array([g for g, _ in rows], dtype=np.int64)
    values = np.array([x for _, x in rows], dtype=np.float64)
    got = group_moments(gid, values, 7, variance=variance)
    for g, (n, lo, hi, mean, var) in enumerate(reference_moments(gid.tolist(), values.tolist(), 7)):
        assert got.count[g] == n
        assert same_bits(lo, got.lo[g]) and same_bits(hi, got.hi[g]) and same_bits(mean, got.mean[g])
        assert got.var is None if not variance else same_bits(var if n else None, got.var[g])


def test_group_moments_of_groups_of_one_size_in_runs_and_of_nothing():
    gid = np.repeat(np.arange(3), 4)
    values = np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0], dtype=np.float64)
    got = group_moments(gid, values, 3)
    assert got.count.tolist() == [4, 4, 4] and got.mean.tolist() == [0.5, 1.0, 0.25]
    assert got.var.tolist() == pytest.approx([1 / 3, 0.0, 0.25])
    assert got.lo.tolist() == [0, 1, 0] and got.hi.tolist() == [1, 1, 1]
    none = group_moments(np.zeros(0, dtype=np.int64), np.zeros(0), 2)
    assert none.count.tolist() == [0, 0] and np.isnan(none.mean).all() and np.isnan(none.var).all()
