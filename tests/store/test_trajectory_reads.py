"""A run whose rounds mix single-turn and multi-turn samples reads as one table: through the
run store (single-turn rows as trajectories of one turn) and through the samples Delta log
(the trajectory columns declared once a part carries them, null on single-turn rows),
locally and on S3."""

from __future__ import annotations

import duckdb
import polars as pl
from deltalake import DeltaTable

from store.run_store import RunStore
from store.schema import TRAJECTORY_FIELDS, check_trajectories, one_turn_trajectories
from tests.helpers import trajectory_row, trajectory_table
from tests.store.test_store import samples

TRAJECTORY_NAMES = [field.name for field in TRAJECTORY_FIELDS]


def _multi_turn(round: int):
    return trajectory_table([
        trajectory_row([("assistant", [4, 5, 6]), ("tool", [7, 8]), ("assistant", [9, 2])], sample_idx=i,
                       prompt_id=f"p{p}", round=round, reward=1.0)
        for p in range(2) for i in range(2)])


def test_a_single_turn_row_is_a_trajectory_of_one_turn():
    table = one_turn_trajectories(samples(1))
    check_trajectories(table)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["response_mask"] == [1, 1] and row["turns"] == [{"role": "assistant", "start": 0, "length": 2}]
    assert (row["num_turns"], row["tool_calls"], row["stop_reason"]) == (1, 0, "done")


def test_single_and_multi_turn_rounds_read_together(run_storage):
    store = RunStore(run_storage.url)
    with store.lock():
        with store.commit("generate", 1, {}, {}) as c:
            c.write("samples", samples(1))
        with store.commit("generate", 2, {}, {}) as c:
            c.write("samples", _multi_turn(2))
    table = RunStore(run_storage.url).read("samples")
    assert table.num_rows == 8 and set(TRAJECTORY_NAMES) <= set(table.column_names)
    rows = {(r["round"], r["prompt_id"], r["sample_idx"]): r for r in table.to_pylist()}
    assert rows[(1, "p0", 0)]["num_turns"] == 1 and rows[(2, "p0", 0)]["num_turns"] == 2
    con = RunStore(run_storage.url).snapshot().duckdb_views(duckdb.connect())
    assert con.sql("SELECT round, sum(tool_calls) FROM samples GROUP BY round ORDER BY round").fetchall() == \
        [(1, 0), (2, 4)]
    # the Delta log declares the trajectory columns: readers of the log see them, null on round 1
    from store.run_log import delta_location

    uri, options = delta_location(run_storage, "samples")
    delta = pl.read_delta(uri, storage_options=options)
    assert set(TRAJECTORY_NAMES) <= set(delta.columns)
    by_round = delta.group_by("round").agg(pl.col("num_turns").null_count().alias("nulls")).sort("round")
    assert by_round.rows() == [(1, 4), (2, 0)]
    assert set(TRAJECTORY_NAMES) <= set(DeltaTable(uri, storage_options=options).schema().to_arrow().names)


def test_the_delta_log_declares_the_trajectory_columns_only_once_a_part_carries_them(tmp_path):
    """A single-turn run's samples Delta log keeps the contract's columns; the first commit of a
    multi-turn part declares the trajectory columns (nullable), before the part's version."""
    from store.schema import SCHEMAS

    store, uri = RunStore(tmp_path / "run"), str(tmp_path / "run" / "samples")
    with store.lock():
        with store.commit("generate", 1, {}, {}) as c:
            c.write("samples", samples(1))
    assert DeltaTable(uri).schema().to_arrow().names == SCHEMAS["samples"].names
    with store.lock():
        with store.commit("generate", 2, {}, {}) as c:
            c.write("samples", _multi_turn(2))
    assert set(TRAJECTORY_NAMES) <= set(DeltaTable(uri).schema().to_arrow().names)
    assert pl.read_delta(uri).sort("round")["num_turns"].to_list() == [None] * 4 + [2] * 4
