"""A table folder of Parquet parts made a Delta Lake table by curation/store/delta_log.py, read
back by readers that are not groupforge's (delta-rs, Polars), on local disk and on an
S3-compatible server over HTTP: versions, time travel, statistics, commit metadata, conflicts."""

from __future__ import annotations

import io

import deltalake
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.store import delta_log

SCHEMA = pa.schema([pa.field("round", pa.int32(), nullable=False), pa.field("prompt_id", pa.string(), nullable=False),
                    pa.field("token_ids", pa.list_(pa.int32()))])


@pytest.fixture
def table(run_storage):
    return run_storage.child("samples")


def _part(table, round: int, name: str, rows: int) -> delta_log.DeltaFile:
    data = pa.table({"round": pa.array([round] * rows, pa.int32()), "prompt_id": [f"p{i}" for i in range(rows)],
                     "token_ids": [[i, i + 1] for i in range(rows)]}, schema=SCHEMA)
    buf = io.BytesIO()
    pq.write_table(data, buf)
    path = f"round={round}/part-{name}.parquet"
    table.write(path, buf.getvalue())
    return delta_log.DeltaFile(path, len(buf.getvalue()), rows, {"round": round}, {"round": round})


def test_versions_time_travel_and_metadata_as_other_readers_see_them(table):
    assert delta_log.latest_version(table) is None
    a, b = _part(table, 1, "generate-aaaa", 3), _part(table, 2, "generate-bbbb", 2)
    assert delta_log.commit(table, SCHEMA, add=[a], info={"stage": "generate", "round": 1}) == 0
    assert delta_log.commit(table, SCHEMA, add=[b], info={"stage": "generate", "round": 2}) == 1
    b2 = _part(table, 2, "generate-cccc", 4)  # round 2 redone: one file out, one in
    assert delta_log.commit(table, SCHEMA, add=[b2], remove=[b], info={"stage": "generate", "round": 2}) == 2
    assert delta_log.latest_version(table) == 2

    dt = deltalake.DeltaTable(table.url)
    assert dt.version() == 2
    now = dt.to_pyarrow_table().sort_by([("round", "ascending"), ("prompt_id", "ascending")])
    assert now.column("round").to_pylist() == [1, 1, 1, 2, 2, 2, 2]
    assert now.schema.field("token_ids").type == pa.list_(pa.int32())
    assert deltalake.DeltaTable(table.url, version=1).to_pyarrow_table().num_rows == 5
    history = {h["version"]: h for h in dt.history()}
    assert history[2]["groupforge"] == {"stage": "generate", "round": 2}
    assert pl.read_delta(table.url, version=0).height == 3
    assert pl.scan_delta(table.url).filter(pl.col("round") == 2).collect().height == 4


def test_a_second_writer_of_one_version_loses(table):
    delta_log.commit(table, SCHEMA, add=[_part(table, 1, "x-1", 1)])
    assert delta_log.commit(table, SCHEMA, add=[_part(table, 2, "x-2", 1)], version=1) == 1
    with pytest.raises(delta_log.DeltaConflict, match="another writer wrote version 1 first"):
        delta_log.commit(table, SCHEMA, add=[_part(table, 1, "y-1", 5)], version=1)
    assert deltalake.DeltaTable(table.url).to_pyarrow_table().num_rows == 2
