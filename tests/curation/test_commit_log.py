"""The run's commit log on local disk and over S3 (moto): commits fold into the live files and
manifests, another reader sees them, state files shorten the replay, a job that opened the run
after another stops the older one at its next commit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from curation.store.commit_log import CommitLog, LoggedFile, RunTakenOver
from tests.helpers import REPO


@pytest.fixture
def storage(run_storage):
    return run_storage


def _file(n: int) -> LoggedFile:
    return LoggedFile(sha256=f"{n:064x}", size=100 + n, rows=n)


def _commit(log: CommitLog, stage: str, round: int, outputs: list[str]) -> list[str]:
    return log.commit(stage, round, {"stage": stage, "round": round, "outputs": outputs},
                      {rel: _file(i) for i, rel in enumerate(outputs)})


def test_commits_fold_into_live_files_and_manifests(storage):
    log = CommitLog(storage, state_every=3)
    log.open()
    _commit(log, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    _commit(log, "score", 1, ["scores/round=1/part-score-a.parquet"])
    _commit(log, "generate", 2, ["samples/round=2/part-generate-a.parquet"])
    prompts = "prompts/part-p.parquet"  # listed by two commits: live while one lists it
    _commit(log, "refill-1", 1, [prompts])
    assert _commit(log, "generate", 1, ["samples/round=1/part-generate-b.parquet", prompts]) == [
        "samples/round=1/part-generate-a.parquet"]
    assert _commit(log, "refill-1", 1, []) == []
    reader = CommitLog(storage)
    state = reader.refresh()
    assert state.seq == 6
    assert sorted(state.files) == ["prompts/part-p.parquet", "samples/round=1/part-generate-b.parquet",
                                   "samples/round=2/part-generate-a.parquet", "scores/round=1/part-score-a.parquet"]
    assert state.commits[("generate", 1)] == 5
    assert [e.kind for e in reader.entries()] == ["open"] + ["commit"] * 6
    # an earlier version of the run, and the state file written after entry 3
    assert "samples/round=1/part-generate-a.parquet" in reader.state_as_of(3).files
    assert storage.exists("_log/00000000000000000003.state.json")
    assert storage.exists("_log/00000000000000000006.state.json")
    fresh = CommitLog(storage)
    assert fresh.state_as_of(6).files == state.files and fresh.refresh().manifests == state.manifests
    assert fresh.state_as_of(6).refs == state.refs and state.refs["prompts/part-p.parquet"] == 1


def test_the_older_of_two_writers_stops_at_its_next_commit(storage):
    first, second = CommitLog(storage), CommitLog(storage)
    first.open()
    _commit(first, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    second.open()  # a second job opens the run: it writes from now on
    with pytest.raises(RunTakenOver, match="wrote to this run's log after this job"):
        _commit(first, "score", 1, ["scores/round=1/part-score-a.parquet"])
    _commit(second, "score", 1, ["scores/round=1/part-score-b.parquet"])
    state = CommitLog(storage).refresh()
    assert sorted(state.files) == ["samples/round=1/part-generate-a.parquet", "scores/round=1/part-score-b.parquet"]



def test_check_writer_passes_the_job_s_own_entries_and_stops_it_after_a_newer_open(storage):
    first, second = CommitLog(storage), CommitLog(storage)
    first.open()
    _commit(first, "generate", 1, ["samples/round=1/part-generate-a.parquet"])
    first.check_writer()  # its own entries only
    second.open()
    with pytest.raises(RunTakenOver, match=r"run taken over: job \S+ \(open at .*\(entry 2\)"):
        first.check_writer()
    second.check_writer()


def test_a_fenced_object_store_refuses_every_write_of_the_older_job(s3_server):
    """On an object store, `RunStore.lock` fences the storage: once a newer job has opened the
    run, the older one's next write of any kind (a metrics line, a checkpoint file, a delete)
    stops it, with nothing written."""
    from curation.store.run_store import RunStore
    from curation.store.storage import open_storage

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
from curation.store.commit_log import CommitLog, LoggedFile, RunTakenOver
from curation.store.storage import open_storage
log = CommitLog(open_storage(sys.argv[1]))
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
    CommitLog(storage).open()
    procs = [subprocess.Popen([sys.executable, "-c", RACE, storage.url, name], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for name in ("a", "b", "c")]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3  # each has read the log
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outcomes = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(outcomes) == ["lost", "lost", "won"], outcomes
    state = CommitLog(storage).refresh()
    assert list(state.files) == [f"samples/round=1/part-generate-{'abc'[outcomes.index('won')]}.parquet"]
