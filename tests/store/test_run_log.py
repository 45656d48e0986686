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

from store.run_log import COMMITS, Entry, LoggedFile, RunLog, RunTakenOver, delta_location
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
    assert {key: history[3][key] for key in ("stage", "round", "seq")} == {"stage": "generate", "round": 1, "seq": 4}
    assert history[3]["row"]["seq"] == 4 and history[3]["row"]["kind"] == "commit"  # its commit point
    assert table.transaction_version("generate@round=2") == 3
    # every version's log file stays (no expired-log cleanup at commit), a checkpoint every 10
    config = table.metadata().configuration
    assert config["delta.checkpointInterval"] == "10" and config["delta.enableExpiredLogCleanup"] == "false"
    assert _table(storage, "samples", 2).to_pyarrow_table().num_rows == 2  # rounds 1 (a) and 2
    uri, options = delta_location(storage, "samples")
    assert pl.scan_delta(uri, storage_options=options).filter(pl.col("round") == 1).collect().height == 1
    assert pl.read_delta(uri, version=1, storage_options=options).height == 1
    def rows():
        return pl.read_delta(*delta_location(storage, COMMITS)[:1],
                             storage_options=delta_location(storage, COMMITS)[1]).sort("seq")["seq"].to_list()

    assert rows() == [0, 1, 2]  # the last two one-table commits' rows are not written yet: their versions are
    log.flush()
    assert rows() == [0, 1, 2, 3, 4]
    assert [e.kind for e in RunLog(storage).entries()] == ["open"] + ["commit"] * 4


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


def test_a_version_an_older_job_writes_after_a_newer_job_opened_is_not_the_run_s(storage):
    """The moment between the older job's last read of `_commits` and its table's version: the
    version carries a row of the older job, which is not the job that opened the run last."""
    first, second = RunLog(storage), RunLog(storage)
    first.open()
    a, b, c = (f"samples/round={r}/part-generate-{x}.parquet" for r, x in ((1, "a"), (2, "b"), (2, "c")))
    _commit(first, storage, "generate", 1, [a])  # a one-table commit: its row not appended yet
    second.open(claim=True)  # takes first's commit in, then its own "open" row
    late = Entry(first.state.seq + 1, "commit", first.writer, "2026-01-01T00:00:00.000+00:00", "generate", 2,
                 {"outputs": [b]}, dict(first.state.versions))
    first._commit_table("samples", {b: _part(storage, b, 2, 3)}, [], {"stage": "generate"}, "generate@round=2",
                        late.seq, row=late)
    assert _table(storage, "samples").to_pyarrow_table().num_rows == 4  # a Delta reader sees it
    assert sorted(RunLog(storage).refresh().files) == [a]  # groupforge does not
    with pytest.raises(RunTakenOver):
        first.check_writer()
    _commit(second, storage, "generate", 2, [c])  # restores the table first
    assert sorted(RunLog(storage).refresh().files) == [a, c]
    assert _table(storage, "samples").to_pyarrow_table().num_rows == 2  # b restored away


def test_a_reader_that_took_a_version_a_newer_row_contradicts_reads_the_run_again(storage):
    """A reader took an unappended commit from a table's log; then a job that had not seen it
    appended another row at its seq (it opened the run first): the reader, and the older job,
    learn it at their next read."""
    first = RunLog(storage)
    first.open()
    a = "samples/round=1/part-generate-a.parquet"
    _commit(first, storage, "generate", 1, [a])
    reader = RunLog(storage)
    assert sorted(reader.refresh().files) == [a] and reader.state.seq == 1
    newer = RunLog(storage)  # read the rows before first's commit, then appends its "open" row
    newer._read_rows()
    newer._apply(newer._pending())
    newer.writer, newer.opened = "newer", True
    newer._append(Entry(1, "open", "newer", "2026-01-01T00:00:00.000+00:00", versions=dict(newer.state.versions)))
    state = reader.refresh()
    assert state.files == {} and [e.kind for e in reader.entries()] == ["open", "open"]
    with pytest.raises(RunTakenOver, match="job newer"):
        first.check_writer()


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
