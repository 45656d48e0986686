"""The run's log (store/run_log.py) on local disk and over S3 (moto), read back by
readers that are not groupforge's (delta-rs, Polars): commits fold into the live files and
manifests, each table's Delta versions carry the commit, an earlier version of the run reads as
it was, a job that opened the run after another stops the older one, processes committing at
once: exactly one wins, a killed commit's table versions are restored away."""

from __future__ import annotations

import io
import subprocess
import sys

import deltalake
import polars as pl
import pyarrow.parquet as pq
import pytest

from store.run_log import COMMITS, LoggedFile, RunLog, RunTakenOver, delta_location
from tests.helpers import REPO
from tests.store.test_store import samples


@pytest.fixture
def storage(run_storage):
    return run_storage


def _part(storage, rel: str, round: int, rows: int) -> LoggedFile:
    """A samples part of `rows` rows written at `rel`."""
    buf = io.BytesIO()
    table = samples(round, n_prompts=rows, group_size=1)
    pq.write_table(table, buf)
    storage.write(rel, buf.getvalue())
    return LoggedFile(sha256="0" * 64, size=len(buf.getvalue()), rows=rows)


def _commit(log: RunLog, storage, stage: str, round: int, outputs: list[str]) -> list[str]:
    files = {rel: _part(storage, rel, round, 1 + i) for i, rel in enumerate(outputs)}
    return log.commit(stage, round, {"stage": stage, "round": round, "outputs": outputs,
                                     "output_files": {rel: {"sha256": f.sha256, "size": f.size}
                                                      for rel, f in files.items()}}, files)


def _table(storage, table: str, version: int | None = None) -> deltalake.DeltaTable:
    uri, options = delta_location(storage, table)
    return deltalake.DeltaTable(uri, version=version, storage_options=options)


def test_commits_fold_into_live_files_manifests_and_delta_versions(storage):
    log = RunLog(storage)
    log.open()
    _commit(log, storage, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    _commit(log, storage, "score", 1, ["scores/round=1/part-score-a.parquet"][:0])
    _commit(log, storage, "generate", 2, ["samples/round=2/part-generate-a.parquet"])
    assert _commit(log, storage, "generate", 1, ["samples/round=1/part-generate-b.parquet"]) == [
        "samples/round=1/part-generate-a.parquet"]
    reader = RunLog(storage)
    state = reader.refresh()
    assert state.seq == 4 and state.commits[("generate", 1)] == 4
    assert sorted(state.files) == ["samples/round=1/part-generate-b.parquet", "samples/round=2/part-generate-a.parquet"]
    assert [e.kind for e in reader.entries()] == ["open"] + ["commit"] * 4
    assert state.retired == {"samples/round=1/part-generate-a.parquet"}
    # an earlier version of the run: as it was after row 3
    assert "samples/round=1/part-generate-a.parquet" in reader.state_as_of(3).files
    # the samples table as Delta readers see it: one version per commit that changed it, with the commit
    table = _table(storage, "samples")
    assert table.version() == 3 == state.versions["samples"]
    history = {h["version"]: h.get("groupforge") for h in table.history()}
    assert history[3] == {"stage": "generate", "round": 1, "seq": 4}
    assert table.transaction_version("generate@round=2") == 3
    # every version's log file stays (no expired-log cleanup at commit), a checkpoint every 10
    config = table.metadata().configuration
    assert config["delta.checkpointInterval"] == "10" and config["delta.enableExpiredLogCleanup"] == "false"
    assert _table(storage, "samples", 2).to_pyarrow_table().num_rows == 2  # rounds 1 (a) and 2
    uri, options = delta_location(storage, "samples")
    assert pl.scan_delta(uri, storage_options=options).filter(pl.col("round") == 1).collect().height == 1
    assert pl.read_delta(uri, version=1, storage_options=options).height == 1
    rows = pl.read_delta(*delta_location(storage, COMMITS)[:1],
                         storage_options=delta_location(storage, COMMITS)[1]).sort("seq")
    assert rows["kind"].to_list() == ["open"] + ["commit"] * 4


def test_the_older_of_two_writers_stops_at_its_next_commit(storage):
    first, second = RunLog(storage), RunLog(storage)
    first.open()
    _commit(first, storage, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    second.open(claim=True)  # a second job opens the run and claims it: it writes from now on
    with pytest.raises(RunTakenOver, match="wrote to this run after this job"):
        _commit(first, storage, "generate", 2, ["samples/round=2/part-generate-a.parquet"])
    _commit(second, storage, "generate", 2, ["samples/round=2/part-generate-b.parquet"])
    state = RunLog(storage).refresh()
    assert sorted(state.files) == ["samples/round=1/part-generate-a.parquet", "samples/round=2/part-generate-b.parquet"]


def test_check_writer_passes_the_job_s_own_rows_and_stops_it_after_a_newer_open(storage):
    first, second = RunLog(storage), RunLog(storage)
    first.open()
    _commit(first, storage, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    first.check_writer()  # its own rows only
    second.open()
    first.check_writer()  # a job that opened the run and wrote nothing has not taken it over
    second.open(claim=True)  # it claims the run (as a job on an object store does when it opens it)
    with pytest.raises(RunTakenOver, match=r"run taken over: job \S+ \(open at "):
        first.check_writer()
    second.check_writer()


def test_a_killed_commit_s_table_versions_are_restored_away_by_the_next_writer(storage):
    log = RunLog(storage)
    log.open()
    _commit(log, storage, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    # a commit killed after its table's version, before its row
    rel = "samples/round=2/part-generate-k.parquet"
    log._commit_table("samples", {rel: _part(storage, rel, 2, 3)}, [], {"stage": "generate"}, "generate@round=2", 2)
    assert _table(storage, "samples").to_pyarrow_table().num_rows == 4  # a Delta reader sees it
    assert sorted(RunLog(storage).refresh().files) == ["samples/round=1/part-generate-a.parquet"]  # groupforge not
    nxt = RunLog(storage)
    nxt.open()
    assert nxt.restore_tables() == ["samples"]
    assert _table(storage, "samples").to_pyarrow_table().num_rows == 1
    _commit(nxt, storage, "generate", 2, ["samples/round=2/part-generate-b.parquet"])
    assert _table(storage, "samples").to_pyarrow_table().num_rows == 2


def test_a_fenced_object_store_refuses_every_write_of_the_older_job(s3_server):
    """On an object store, `RunStore.lock` fences the storage: once a newer job has opened the
    run, the older one's next write of any kind (a metrics line, a checkpoint file, a delete)
    stops it, with nothing written."""
    from store.run_store import RunStore
    from store.storage import open_storage

    url = f"s3://{s3_server.bucket()}/runs/x"
    older = RunStore(url)
    with older.lock():
        older.storage.write("metrics.jsonl", b"{}\n")
        with RunStore(url).lock():  # a newer job (elsewhere: its own storage and cache lock)
            pass
        for write in (lambda: older.storage.write("metrics.jsonl", b"{}\n{}\n"),
                      lambda: older.storage.upload("checkpoints/step-2/config.json", REPO / "pyproject.toml"),
                      lambda: older.storage.delete("metrics.jsonl")):
            with pytest.raises(RunTakenOver, match="run taken over"):
                write()
    reader = open_storage(url)
    assert reader.read("metrics.jsonl") == b"{}\n" and not reader.exists("checkpoints/step-2/config.json")


RACE = """
import sys
from store.run_log import LoggedFile, RunLog, RunTakenOver
from store.storage import open_storage
log = RunLog(open_storage(sys.argv[1]))
log.refresh()
log.writer = sys.argv[2]
print("ready", flush=True)
sys.stdin.readline()
try:
    rel = "samples/round=1/part-generate-" + sys.argv[2] + ".parquet"
    log.commit("generate", 1, {"outputs": [rel]}, {rel: LoggedFile("0" * 64, 1, 1)})
    print("won")
except RunTakenOver:
    print("lost")
"""


def test_processes_committing_at_once_exactly_one_wins(storage):
    RunLog(storage).open()
    procs = [subprocess.Popen([sys.executable, "-c", RACE, storage.url, name], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for name in ("a", "b", "c")]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3  # each has read the log
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outcomes = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(outcomes) == ["lost", "lost", "won"], outcomes
    state = RunLog(storage).refresh()
    assert list(state.files) == [f"samples/round=1/part-generate-{'abc'[outcomes.index('won')]}.parquet"]
