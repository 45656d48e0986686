"""store/run_store.py on real Parquet files, DuckDB, Polars and real second processes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset
import pyarrow.parquet as pq
import pytest

from store.fingerprints import code_version, config_hash, fingerprint_file, fingerprint_path
from store.lock import RunLockedError
from store.run_log import LoggedFile
from store.run_store import RunStore
from store.schema import SCHEMAS, SchemaError
from store.verify import check_run

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"temperature": 1.0, "group_size": 2}
INPUTS = {"prompts": "f" * 64}


def samples(round: int, n_prompts: int = 2, group_size: int = 2, tag: str = "") -> pa.Table:
    rows = [
        {"run_id": "r", "round": round, "prompt_id": f"p{p}", "sample_idx": i, "group_size": group_size,
         "prompt_token_ids": [1, 2, 3], "response": f"{tag}{p}-{i}", "response_token_ids": [4, 5],
         "behavior_logprobs": [-0.5, -1.25], "finish_reason": "stop", "policy_version": 0,
         "generator": "test", "seed": 7}
        for p in range(n_prompts) for i in range(group_size)
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["samples"])


def rejects(round: int, stage: str, n: int = 1) -> pa.Table:
    rows = [{"run_id": "r", "round": round, "prompt_id": f"p{i}", "sample_idx": None, "stage": stage,
             "reason": "zero_variance", "detail": None} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["rejects"])


def parquet_files(root: Path) -> list[str]:
    """Every Parquet file in the table folders (what a reader that globs them would see; the
    Delta logs left out), relative to root."""
    return sorted(p.relative_to(root).as_posix() for t in SCHEMAS for p in (root / t).rglob("*.parquet")
                  if "_delta_log" not in p.parts)


PART = re.compile(r"part-(?P<part>.+)-(?P<sha>[0-9a-f]{16})\.parquet")


def unhashed(rels: list[str]) -> list[str]:
    """Part file paths with their hash left out: 'samples/round=0/part-generate'."""
    return sorted(f"{rel.rpartition('/')[0]}/part-{PART.fullmatch(rel.rpartition('/')[2])['part']}" for rel in rels)


def delta_rows(root: Path, table: str) -> int:
    """Rows of the table as a Delta Lake reader sees it."""
    from deltalake import DeltaTable

    return DeltaTable(str(root / table)).to_pyarrow_table().num_rows


def run_python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


# ---- commit and manifest -------------------------------------------------------------


def test_commit_writes_parts_and_manifest(tmp_path):
    store = RunStore(tmp_path / "run")
    assert not store.root.exists()  # nothing is created until written
    store.staging("generate", 0).write("shard-0.jsonl", b"{}")
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0))
        c.write("rejects", rejects(0, "generate", n=3))
        c.record(rows_in=2, rows_out=4, drops={"too_long": 3}, seconds=1.5)

    files = parquet_files(store.root)
    assert unhashed(files) == ["rejects/round=0/part-generate", "samples/round=0/part-generate"]
    m = store.load_manifest("generate", 0)
    assert m["stage"] == "generate" and m["round"] == 0
    assert m["inputs"] == INPUTS and m["config"] == CONFIG and m["config_hash"] == config_hash(CONFIG)
    assert m["outputs"] == files == store.files("rejects") + store.files("samples")
    assert m["output_rows"] == dict(zip(files, (3, 4)))
    for rel in files:  # named after the first 16 hex digits of their sha256
        assert m["output_files"][rel]["sha256"][:16] == PART.fullmatch(rel.rsplit("/", 1)[1])["sha"]
    assert (m["rows_in"], m["rows_out"], m["drops"], m["seconds"]) == (2, 4, {"too_long": 3}, 1.5)
    assert m["code_version"] == code_version() and m["created_at"].endswith("+00:00")
    # the manifest is in the commit's row of _commits (after the writer's "open"), and each
    # table's Delta version names the commit; no other folder
    from deltalake import DeltaTable

    rows = DeltaTable(str(store.root / "_commits")).to_pyarrow_table().sort_by("seq").to_pylist()
    assert [(r["seq"], r["kind"]) for r in rows] == [(0, "open"), (1, "commit")]
    assert json.loads(rows[1]["manifest"]) == m and json.loads(rows[1]["versions"]) == {"rejects": 1, "samples": 1}
    for table in ("samples", "rejects"):
        history = DeltaTable(str(store.root / table)).history()
        assert history[0]["groupforge"] == {"stage": "generate", "round": 0, "seq": 1}
        assert DeltaTable(str(store.root / table)).transaction_version("generate@round=0") == 1
    assert sorted(p.name for p in store.root.iterdir()) == ["_commits", "_staging", "rejects", "samples"]
    # the staging folder is emptied; written files are zstd Parquet; each table is a Delta table
    assert store.staging("generate", 0).list() == []
    meta = pq.read_metadata(store.root / m["outputs"][1])
    assert meta.row_group(0).column(0).compression == "ZSTD"
    assert (delta_rows(store.root, "samples"), delta_rows(store.root, "rejects")) == (4, 3)


def test_read_across_rounds_has_the_right_round_values(tmp_path):
    store = RunStore(tmp_path)
    for r in (0, 1, 10):  # 10 sorts before 2 as text: rounds must be numeric
        with store.commit("generate", r, INPUTS, CONFIG) as c:
            c.write("samples", samples(r, n_prompts=r + 1))
    expected = {0: 2, 1: 4, 10: 22}

    assert store.rounds("samples") == [0, 1, 10]
    table = store.read("samples")
    assert table.schema.field("round").type == pa.int32()
    assert table.schema.equals(SCHEMAS["samples"])
    counts = {r: table["round"].to_pylist().count(r) for r in expected}
    assert counts == expected
    assert table["round"].to_pylist() == sorted(table["round"].to_pylist())  # round order
    assert store.read("samples", rounds=1)["round"].to_pylist() == [1] * 4
    assert set(store.read("samples", rounds=[10, 0])["round"].to_pylist()) == {0, 10}
    assert store.read("samples", rounds=[5]).num_rows == 0

    # readers outside groupforge: the live files (hive paths), or the table as a Delta table
    paths = [str(store.root / rel) for rel in store.files("samples")]
    assert [p.rsplit("/", 2)[1] for p in paths] == ["round=0", "round=1", "round=10"]
    for hive in ("true", "false"):  # the path (BIGINT) or the file column (INTEGER) — same values
        got = duckdb.sql(f"SELECT round, count(*) FROM read_parquet({paths}, hive_partitioning={hive})"
                         " GROUP BY round ORDER BY round").fetchall()
        assert dict(got) == expected
    assert duckdb.sql(f"SELECT DISTINCT typeof(round) FROM read_parquet({paths}, hive_partitioning=true)"
                      ).fetchall() == [("BIGINT",)]
    for frame in (pl.scan_parquet(paths), pl.scan_parquet(paths, hive_partitioning=True),
                  pl.scan_delta(str(tmp_path / "samples"))):
        got = frame.group_by("round").len().collect()
        assert dict(zip(got["round"].to_list(), got["len"].to_list())) == expected
        assert frame.collect_schema()["round"] == pl.Int32
    assert pl.scan_delta(str(tmp_path / "samples")).filter(pl.col("round") == 1).select(pl.len()).collect().item() == 4
    dataset = pyarrow.dataset.dataset(paths, partitioning="hive", partition_base_dir=str(tmp_path / "samples"))
    assert sorted(set(dataset.to_table()["round"].to_pylist())) == [0, 1, 10] and dataset.count_rows() == 28
    assert delta_rows(tmp_path, "samples") == 28


def test_read_missing_table_is_empty_with_the_schema(tmp_path):
    store = RunStore(tmp_path / "nothing-here")
    for table in SCHEMAS:
        got = store.read(table)
        assert got.num_rows == 0 and got.schema.equals(SCHEMAS[table])
    assert store.rounds("pairs") == []
    assert not store.root.exists()


def test_several_stages_share_a_table_and_round(tmp_path):
    store = RunStore(tmp_path)
    for stage, n in (("generate", 1), ("score", 2), ("filter", 3)):
        with store.commit(stage, 0, INPUTS, CONFIG) as c:
            c.write("rejects", rejects(0, stage, n=n))
    with store.commit("score", 0, INPUTS, {"changed": True}) as c:  # a rerun touches only its own part
        c.write("rejects", rejects(0, "score", n=5))
    stages = store.read("rejects")["stage"].to_pylist()
    assert sorted(stages) == ["filter"] * 3 + ["generate"] + ["score"] * 5
    with store.commit("pair", 0, INPUTS, CONFIG) as c:
        with pytest.raises(ValueError, match="belongs to stage 'filter'"):
            c.write("rejects", rejects(0, "pair"), part="filter")


def test_prompts_are_not_partitioned(tmp_path):
    store = RunStore(tmp_path)
    prompts = pa.table({"prompt_id": ["a", "b"], "prompt": ["1+1=", "2+2="], "reference": ["2", "4"]})
    with store.commit("ingest", 0, {}, {}) as c:
        c.write("prompts", prompts)
        with pytest.raises(ValueError, match="not partitioned"):
            c.write("prompts", prompts, part="again", round=3)
    assert unhashed(parquet_files(tmp_path)) == ["prompts/part-ingest"]
    assert store.files("prompts") == parquet_files(tmp_path)
    assert store.read("prompts")["prompt"].to_pylist() == ["1+1=", "2+2="]
    assert delta_rows(tmp_path, "prompts") == 2


def test_a_polars_frame_is_written_with_canonical_types(tmp_path):
    store = RunStore(tmp_path)
    frame = pl.from_arrow(samples(0))  # large lists, string views
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", frame)
    written = pq.read_schema(tmp_path / store.files("samples")[0])
    assert written.equals(SCHEMAS["samples"])
    assert store.read("samples").equals(samples(0))


# ---- failures leave nothing behind ---------------------------------------------------


def test_exception_inside_commit_writes_nothing(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with store.commit("generate", 0, INPUTS, CONFIG) as c:
            c.write("samples", samples(0))
            raise RuntimeError("boom")
    assert parquet_files(tmp_path) == []  # the files it wrote are deleted
    assert store.load_manifest("generate", 0) is None
    assert [e.kind for e in store.log.entries()] == ["open"]  # no commit entry
    assert store.read("samples").num_rows == 0
    with pytest.raises(RuntimeError, match="inside `with store.commit"):
        c.write("samples", samples(0))  # a finished commit takes no more writes
    assert parquet_files(tmp_path) == []


def test_invalid_data_is_rejected_before_anything_is_written(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(SchemaError, match=r"samples table \(samples/round=0/part-generate, written by stage "
                                          r"'generate'.*behavior_logprobs"):
        with store.commit("generate", 0, INPUTS, CONFIG) as c:
            c.write("samples", samples(0).drop_columns(["behavior_logprobs"]))
    with pytest.raises(SchemaError, match="column 'round' holds 3..3, but it is written to round=0"):
        with store.commit("generate", 0, INPUTS, CONFIG) as c:
            c.write("samples", samples(3))
    assert parquet_files(tmp_path) == [] and store.load_manifest("generate", 0) is None


def test_recommit_replaces_the_stage_outputs_without_duplicates(tmp_path):
    store = RunStore(tmp_path)
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0, tag="old-a"), part="generate-shard0")
        c.write("samples", samples(0, tag="old-b"), part="generate-shard1")
        c.write("rejects", rejects(0, "generate"))
    assert store.read("samples").num_rows == 8
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0, tag="new"))
    assert unhashed(store.files("samples")) == ["samples/round=0/part-generate"]
    # the replaced parts leave the live files and stay on disk for earlier versions of the run
    assert sorted(store.state.retired) == sorted(set(parquet_files(tmp_path)) - set(store.files("samples")))
    assert len(store.state.retired) == 3
    got = store.read("samples")["response"].to_pylist()
    assert len(got) == 4 and all(s.startswith("new") for s in got)
    new = store.files("samples")
    with store.commit("generate", 0, INPUTS, CONFIG) as c:  # same part again: replaced
        c.write("samples", samples(0, tag="newer"))
    assert store.read("samples").num_rows == 4
    assert len(store.files("samples")) == 1 and store.files("samples") != new and new[0] in store.state.retired
    newer = store.files("samples")
    with store.commit("generate", 0, INPUTS, {"same": "bytes"}) as c:  # the same bytes: the file stays live
        c.write("samples", samples(0, tag="newer"))
    assert store.files("samples") == newer and store.read("samples").num_rows == 4
    assert newer[0] not in store.state.retired
    assert store.read("rejects").num_rows == 0 and store.rounds("rejects") == []
    assert (delta_rows(tmp_path, "samples"), delta_rows(tmp_path, "rejects")) == (4, 0)


def test_the_files_of_an_interrupted_commit_are_swept_by_the_next_writer(tmp_path):
    """A part file a killed commit wrote (named as groupforge names them, listed by no log
    entry) is not read, and the next job that writes the run removes it."""
    store = RunStore(tmp_path)
    with store.commit("generate", 1, INPUTS, CONFIG) as c:
        c.write("samples", samples(1))
    sink = pa.BufferOutputStream()
    pq.write_table(samples(0, tag="stray"), sink)
    data = sink.getvalue().to_pybytes()
    stray = tmp_path / "samples" / "round=0" / f"part-generate-shard7-{hashlib.sha256(data).hexdigest()[:16]}.parquet"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(data)
    later = RunStore(tmp_path)
    assert later.read("samples", 0).num_rows == 0 and not later.is_up_to_date("generate", 0, INPUTS, CONFIG)
    with later.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0, tag="good"))
    assert not stray.exists()
    assert unhashed(parquet_files(tmp_path)) == ["samples/round=0/part-generate", "samples/round=1/part-generate"]
    assert later.is_up_to_date("generate", 0, INPUTS, CONFIG)
    assert set(later.read("samples", 0)["response"].to_pylist()) == {"good0-0", "good0-1", "good1-0", "good1-1"}


KILLED_COMMIT = """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_store import rejects, samples
    from store.run_store import RunStore
    store = RunStore(sys.argv[1])
    with store.commit("generate", 0, {{}}, {{"attempt": 2}}) as c:
        c.write("samples", samples(0, n_prompts=50, tag="killed"))
        c.write("rejects", rejects(0, "generate"))
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("committed_before", [False, True])
def test_a_killed_commit_leaves_no_partial_data(tmp_path, committed_before):
    store = RunStore(tmp_path)
    if committed_before:
        with store.commit("generate", 0, {}, {"attempt": 1}) as c:
            c.write("samples", samples(0, tag="first"))
    first = parquet_files(tmp_path)
    proc = run_python(KILLED_COMMIT.format(tests=str(Path(__file__).parent)), str(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    killed = sorted(set(parquet_files(tmp_path)) - set(first))
    assert unhashed(killed) == ["rejects/round=0/part-generate", "samples/round=0/part-generate"]  # it did write
    assert check_run(tmp_path).orphans == 2
    for reader in (store, RunStore(tmp_path), RunStore(tmp_path).snapshot()):  # no reader sees its files
        if committed_before:
            assert set(reader.read("samples")["response"].to_pylist()) == {"first0-0", "first0-1", "first1-0",
                                                                           "first1-1"}
            assert reader.load_manifest("generate", 0)["config"] == {"attempt": 1}
        else:
            assert reader.load_manifest("generate", 0) is None
        assert reader.read("samples").num_rows == (4 if committed_before else 0)
        assert reader.read("rejects").num_rows == 0 and reader.files("samples") == first
    if committed_before:  # nor does a Delta reader
        assert delta_rows(tmp_path, "samples") == 4
    else:
        assert not (tmp_path / "samples" / "_delta_log").exists()
    with RunStore(tmp_path).lock():  # the next writer sweeps its files
        pass
    assert parquet_files(tmp_path) == first and check_run(tmp_path).orphans == 0


# ---- reading bad folders -------------------------------------------------------------


def test_a_corrupt_part_file_is_named(tmp_path):
    store = RunStore(tmp_path)
    for round in (0, 1):
        with store.commit("generate", round, INPUTS, CONFIG) as c:
            c.write("samples", samples(round))
    bad = tmp_path / store.files("samples", 1)[0]
    bad.write_bytes(b"PAR1 this is not parquet")  # a live file damaged after its commit
    with pytest.raises(SchemaError, match=rf"samples table \({bad}\): not a readable Parquet file"):
        store.read("samples")
    assert store.read("samples", rounds=0).num_rows == 4
    bad.unlink()
    with pytest.raises(SchemaError, match=rf"samples table \({bad}\): file not found \(listed by the run's log\)"):
        store.read("samples")


def test_a_part_file_with_a_wrong_column_is_named(tmp_path):
    """Tables written by another tool (a run without a commit log) are checked as they are read."""
    good = tmp_path / "samples" / "round=0" / "part-manual.parquet"
    good.parent.mkdir(parents=True)
    pq.write_table(samples(0), good)
    store = RunStore(tmp_path)
    assert store.read("samples").num_rows == 4
    for round, table in ((1, samples(1).set_column(8, "behavior_logprobs", pa.array(["oops"] * 4))),
                         (2, samples(2).drop_columns(["response"]))):
        bad = tmp_path / "samples" / f"round={round}" / "part-manual.parquet"
        bad.parent.mkdir()
        pq.write_table(table, bad)
        with pytest.raises(SchemaError, match=rf"samples table \({bad}\): (column 'behavior_logprobs' has "
                                              r"type string|missing column 'response')"):
            RunStore(tmp_path).read("samples")
        bad.unlink()
    assert not (tmp_path / "_log").exists()  # reading wrote nothing


def test_a_file_in_the_wrong_round_folder_is_refused(tmp_path):
    store = RunStore(tmp_path)
    wrong = tmp_path / "samples" / "round=2" / "part-manual.parquet"
    wrong.parent.mkdir(parents=True)
    pq.write_table(samples(1), wrong)
    with pytest.raises(SchemaError, match=r"column 'round' holds 1..1, but the file is in folder round=2"):
        store.read("samples")
    assert store.read("samples", validate=False).num_rows == 4


# ---- idempotence ---------------------------------------------------------------------


def test_is_up_to_date(tmp_path):
    store = RunStore(tmp_path)
    assert not store.is_up_to_date("generate", 0, INPUTS, CONFIG)
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0))
    assert store.is_up_to_date("generate", 0, INPUTS, CONFIG)
    assert store.is_up_to_date("generate", 0, dict(INPUTS), {"group_size": 2, "temperature": 1.0})
    assert not store.is_up_to_date("generate", 0, {"prompts": "0" * 64}, CONFIG)
    assert not store.is_up_to_date("generate", 0, {**INPUTS, "checkpoint": "a" * 64}, CONFIG)
    assert not store.is_up_to_date("generate", 0, INPUTS, {**CONFIG, "temperature": 0.7})
    assert not store.is_up_to_date("generate", 1, INPUTS, CONFIG)
    lost = tmp_path / store.files("samples", 0)[0]
    lost.unlink()  # an output lost since its commit: the stage runs again and writes it
    assert not store.is_up_to_date("generate", 0, INPUTS, CONFIG)
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0))
    assert lost.exists() and store.is_up_to_date("generate", 0, INPUTS, CONFIG)
    assert store.read("samples").num_rows == 4


def test_fingerprints_and_config_hash(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(os.urandom(3 << 20))  # several chunks
    assert fingerprint_file(f) == hashlib.sha256(f.read_bytes()).hexdigest() == fingerprint_path(f)
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "w.bin").write_bytes(b"weights")
    before = fingerprint_path(folder)
    assert fingerprint_path(folder) == before
    (folder / "sub" / "w.bin").write_bytes(b"weightz")
    changed = fingerprint_path(folder)
    (folder / "sub" / "w.bin").rename(folder / "sub" / "v.bin")
    assert len({before, changed, fingerprint_path(folder)}) == 3
    with pytest.raises(FileNotFoundError):
        fingerprint_path(tmp_path / "missing")
    assert config_hash({"a": 1, "b": {"c": [1, 2]}}) == config_hash({"b": {"c": [1, 2]}, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert code_version().startswith("groupforge ")


# ---- the lock ------------------------------------------------------------------------


HOLD_LOCK = """
    import sys
    from store.run_store import RunStore
    with RunStore(sys.argv[1]).lock():
        print("locked", flush=True)
        sys.stdin.readline()
"""


def test_a_second_locker_is_refused_with_the_holder_named(tmp_path):
    store = RunStore(tmp_path / "run")
    holder = run_python(HOLD_LOCK, str(store.root), stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError) as info:
            with store.lock(wait=False):
                pass
        assert str(store.root) in str(info.value) and f"pid {holder.pid}" in str(info.value)
        waits = []
        start = time.monotonic()
        with pytest.raises(RunLockedError, match="gave up after 0.3s"):
            with store.lock(timeout=0.3, on_wait=waits.append):
                pass
        assert time.monotonic() - start >= 0.3
        assert len(waits) == 1 and f"pid {holder.pid}" in waits[0]
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
    with store.lock(wait=False):
        with store.lock(wait=False):  # re-entrant within one process
            assert json.loads((store.root / ".lock").read_text())["pid"] == os.getpid()
    assert (store.root / ".lock").read_text() == ""


def test_a_waiting_locker_gets_the_lock_when_the_holder_exits(tmp_path):
    holder = run_python(HOLD_LOCK, str(tmp_path), stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "locked"
    waits = []

    def release(message: str) -> None:
        waits.append(message)
        holder.stdin.write("\n")
        holder.stdin.flush()

    with RunStore(tmp_path).lock(timeout=30, on_wait=release):
        assert len(waits) == 1
    holder.communicate(timeout=30)


def test_shared_prompts_part_survives_a_rerun_of_another_round(tmp_path):
    """Rounds 0 and 1 both list prompts/part-A; regenerating round 0 from other prompts
    must not delete the part round 1 still lists."""
    store = RunStore(tmp_path / "run")
    prompts_a = pa.table({"prompt_id": ["a"], "prompt": ["1+1="]})
    prompts_b = pa.table({"prompt_id": ["b"], "prompt": ["2+2="]})
    for round, part, table in ((0, "A", prompts_a), (1, "A", prompts_a), (0, "B", prompts_b)):
        with store.commit("generate", round, inputs={"p": part}, config={}) as c:
            c.write("prompts", table, part=part, round=None)
    assert unhashed(parquet_files(store.root)) == ["prompts/part-A", "prompts/part-B"]
    assert store.files("prompts") == parquet_files(store.root)
    assert store.read("prompts")["prompt_id"].to_pylist() == ["a", "b"]
    assert store.load_manifest("generate", 1)["outputs"] == [store.files("prompts")[0]]
    assert delta_rows(store.root, "prompts") == 2


# ---- reading some columns ------------------------------------------------------------


def test_read_columns_gives_the_rows_and_values_of_a_full_read(tmp_path):
    store = RunStore(tmp_path)
    for r in (0, 3):
        with store.commit("generate", r, INPUTS, CONFIG) as c:
            c.write("samples", samples(r, n_prompts=r + 2))
            c.write("rejects", rejects(r, "generate", n=2))
    with store.commit("filter", 0, INPUTS, CONFIG) as c:
        c.write("rejects", rejects(0, "filter").drop_columns(["detail"]))  # an optional column left out
    for table, columns in (("samples", ["prompt_id", "sample_idx", "response", "round"]),
                           ("rejects", ["run_id", "round", "prompt_id", "sample_idx", "stage", "detail"])):
        for rounds in (None, 0, [3]):
            full = store.read(table, rounds)
            got = store.read(table, rounds, columns=columns)
            assert got.equals(full.select(columns)) and got.schema.equals(full.select(columns).schema)
            assert store.read_columns(table, columns, rounds).equals(got)
    mine = store.read_columns("rejects", ["stage"], 0, exclude_parts=("filter",))
    assert mine.column("stage").to_pylist() == ["generate", "generate"]
    assert store.read("pairs", columns=["margin"]).schema == pa.schema([SCHEMAS["pairs"].field("margin")])
    with pytest.raises(ValueError, match="no column"):
        store.read("samples", columns=["prompt_id", "nope"])


def test_read_columns_checks_every_file_as_a_full_read_does(tmp_path):
    store = RunStore(tmp_path)
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0))
    with store.commit("manual", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0))
    bad = tmp_path / store.load_manifest("manual", 0)["outputs"][0]  # a live file, replaced after its commit
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SchemaError, match=rf"samples table \({bad}\): not a readable Parquet file"):
        store.read_columns("samples", ["prompt_id"], 0)
    pq.write_table(samples(0).drop_columns(["response"]), bad)  # a column not read is still checked
    with pytest.raises(SchemaError, match=rf"samples table \({bad}\): missing column 'response'"):
        store.read_columns("samples", ["prompt_id"], 0)
    pq.write_table(samples(1), bad)
    with pytest.raises(SchemaError, match=r"column 'round' holds 1..1, but the file is in folder round=0"):
        store.read_columns("samples", ["prompt_id"], 0)
    assert store.read_columns("samples", ["prompt_id"], 0, validate=False).num_rows == 8
    nullable = pa.schema([f.with_nullable(True) for f in SCHEMAS["samples"]])
    with_null = samples(0).cast(nullable).set_column(2, "prompt_id", pa.array(["p0", None, "p1", "p1"]))
    pq.write_table(with_null, bad)
    with pytest.raises(SchemaError, match="column 'prompt_id' has 1 null value"):
        store.read_columns("samples", ["prompt_id"], 0)


# ---- recorded fingerprints -----------------------------------------------------------


def test_a_commit_records_each_output_hash_size_and_rows(tmp_path):
    store = RunStore(tmp_path)
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("samples", samples(0))
        c.write("rejects", rejects(0, "generate"))
    manifest = store.load_manifest("generate", 0)
    assert sorted(manifest["output_files"]) == manifest["outputs"]
    for rel, entry in manifest["output_files"].items():
        expected = LoggedFile(fingerprint_file(tmp_path / rel), (tmp_path / rel).stat().st_size,
                              pq.read_metadata(tmp_path / rel).num_rows)
        assert entry == {"sha256": expected.sha256, "size": expected.size}
        assert manifest["output_rows"][rel] == expected.rows
        assert store.file_record(rel) == RunStore(tmp_path).file_record(rel) == expected
        assert store.row_count(rel) == expected.rows
    with pytest.raises(KeyError):
        store.file_record("samples/round=1/part-generate-0000000000000000.parquet")


def test_known_fingerprint_trusts_a_record_only_while_size_and_mtime_match(tmp_path):
    from store import fingerprints

    path = tmp_path / "part.parquet"
    path.write_bytes(b"12345678")
    stat = os.stat(path)
    recorded = {"sha256": "r" * 64, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    assert fingerprints.known_fingerprint(path, recorded) == "r" * 64  # vouched for: not read
    assert fingerprints.known_fingerprint(path) == hashlib.sha256(b"12345678").hexdigest()  # nothing vouches: read
    path.write_bytes(b"87654321")  # same size, new mtime: the record no longer holds
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprints.known_fingerprint(path, recorded) == hashlib.sha256(b"87654321").hexdigest()
    assert fingerprints.known_fingerprint(path, {"size": stat.st_size}) == hashlib.sha256(b"87654321").hexdigest()


def test_a_rounds_prompts_are_the_parts_committed_with_its_samples(tmp_path):
    """Score reads the prompts parts its round's samples came from, not the whole prompts
    table (one part more every round), and falls back to the whole table when some samples
    part of the round was written without a manifest."""
    from curation.stages import score as score_stage
    from curation.stages.runner import run_stage

    store = RunStore(tmp_path)

    def prompts(ids):
        return pa.table({"prompt_id": ids, "prompt": [f"{i}=" for i in ids], "reference": ["0-0"] * len(ids)})

    for round, part in ((0, "A"), (1, "B")):
        with store.commit("generate", round, INPUTS, CONFIG) as c:
            c.write("samples", samples(round))
            c.write("prompts", prompts(["p0", "p1"]), part=part, round=None)
    with store.commit("refill-1", 1, INPUTS, CONFIG) as c:
        c.write("samples", samples(1, n_prompts=3).slice(4), part="refill-1")  # prompt p2
        c.write("prompts", prompts(["p2"]), part="refill-1-C", round=None)
    a, b, c = store.files("prompts")
    assert unhashed([a, b, c]) == ["prompts/part-A", "prompts/part-B", "prompts/part-refill-1-C"]
    assert store.round_prompts(0) == [a]
    assert store.round_prompts(1) == [b, c]

    report = run_stage(score_stage, tmp_path, 1)
    assert report.rows_out == 6
    store.refresh()  # the commits of the stage's own store
    inputs = store.load_manifest("score", 1)["inputs"]
    assert sorted(rel for rel in inputs if rel.startswith("prompts/")) == [b, c]

    with store.commit("other", 0, INPUTS, CONFIG) as commit:  # samples listed with no prompts part
        commit.write("samples", samples(0, n_prompts=3).slice(4))
    assert store.round_prompts(0) is None  # then the whole table
    run_stage(score_stage, tmp_path, 0)
    store.refresh()
    inputs = store.load_manifest("score", 0)["inputs"]
    assert sorted(rel for rel in inputs if rel.startswith("prompts/")) == [a, b, c]


def test_a_prompts_part_claimed_by_another_stage_is_refused(tmp_path):
    store = RunStore(tmp_path)
    prompts = pa.table({"prompt_id": ["a"], "prompt": ["1+1="]})
    with store.commit("generate", 0, INPUTS, CONFIG) as c:
        c.write("prompts", prompts, part="A", round=None)
    with pytest.raises(ValueError, match="belongs to stage 'generate'"):
        with store.commit("refill-1", 3, INPUTS, CONFIG) as c:
            c.write("prompts", prompts, part="A", round=None)


def test_a_table_folder_linked_outside_the_run_is_refused(tmp_path):
    """No write escapes the run folder: a table folder that is a symlink to elsewhere."""
    store = RunStore(tmp_path / "run")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    store.root.mkdir()
    (store.root / "samples").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=f"a symlink to {outside}, outside the run folder {store.root}"):
        with store.commit("generate", 0, {}, {}) as commit:
            commit.write("samples", samples(0))
    assert list(outside.rglob("*")) == [] and store.load_manifest("generate", 0) is None
    (store.root / "samples").unlink()
    with store.commit("generate", 0, {}, {}) as commit:  # a link made after the run's first commit
        commit.write("samples", samples(0))
    shutil.rmtree(store.root / "samples" / "round=0")
    (store.root / "samples" / "round=0").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="outside the run folder"):
        with store.commit("generate", 0, {}, {"again": True}) as commit:
            commit.write("samples", samples(0, tag="again"))
    assert list(outside.rglob("*")) == [] and "again" not in store.load_manifest("generate", 0)["config"]
