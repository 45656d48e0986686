"""Readers beside a writer, and two writers, as real processes on real files and on an object store.

The writer is held half way through its commit (its part files written under their final names,
its commit log entry not yet) by `GROUPFORGE_PAUSE=commit.files_published:<n>:DIR`
(store/faults.py): it writes DIR/paused and waits for DIR/resume. No sleep decides when a
reader runs.

On local disk the writer is `groupforge generate`. While it waits: a bare glob over the table
folder already sees the new rows (the state every reader would meet at that moment), while
readers of the commit log (`RunStore.snapshot`, `duckdb_views`, and `groupforge inspect` /
`export` / `verify`) and of the Delta tables see the round not at all; a second writer is refused.
Once resumed, both see the round whole.

On S3 (moto's server over HTTP) the writers are `groupforge run` jobs on one `s3://` run, started
together as if on two machines (two node caches): the one that opened the run last goes on, the
other stops with exit 3 ("run taken over"); a third job on the survivor's machine is refused by
that machine's lock (exit 3, "locked"). A reader process polls the run's Delta table and commit
log over the endpoint throughout, every Delta version included: each round it sees has all its
samples, and while the survivor is held inside round 2's commit, round 2 is not there at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from store.faults import PAUSE_ENV
from store.location import CACHE_ENV
from tests.helpers import FAULTS_SPEC, REPO, check_invariants, cli, cli_env

PROMPTS, G = 24, 4

READER = """
import sys, duckdb
from store.run_store import RunStore
con = RunStore(sys.argv[1]).snapshot().duckdb_views(duckdb.connect())
print(*(con.sql(f"SELECT count(*) FROM {table}").fetchall()[0][0] for table in ("samples", "prompts")))
"""


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _snapshot_counts(run: Path) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", READER, str(run)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    samples, prompts = map(int, done.stdout.split())
    return samples, prompts


def test_readers_see_a_commit_whole_or_not_at_all_and_a_second_writer_is_refused(toy_dir, tmp_path):
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / "train.parquet").slice(0, PROMPTS), prompts)
    run, barrier = tmp_path / "run", tmp_path / "barrier"
    barrier.mkdir()
    command = ["generate", "--model", str(toy_dir / "model"), "--prompts", str(prompts), "--out", str(run),
               "--backend", "hf", "-G", str(G), "--max-tokens", "4"]
    writer = subprocess.Popen([sys.executable, "-m", "pipelines.cli", *command], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, PAUSE_ENV: f"commit.files_published:1:{barrier}"})
    try:
        deadline = time.monotonic() + 240
        while not (barrier / "paused").exists():  # the barrier: the writer is inside its commit
            assert writer.poll() is None, writer.communicate()
            assert time.monotonic() < deadline, "the writer never reached its commit"
            time.sleep(0.05)

        bare = duckdb.sql(f"SELECT count(*) FROM read_parquet('{run}/samples/**/*.parquet')").fetchall()[0][0]
        assert bare == PROMPTS * G  # the files are in place: a bare glob reads a commit not yet made
        assert _snapshot_counts(run) == (0, 0)
        inspect = _cli("inspect", str(run))
        assert inspect.returncode == 0 and "no tables yet" in " ".join(inspect.stdout.split()), inspect.stdout
        export = _cli("export", str(run), "--format", "prompt_only")
        assert export.returncode == 2 and "the prompts table is empty" in export.stderr, export.stderr[-2000:]
        verify = _cli("verify", str(run))
        assert verify.returncode == 0 and "of killed commits, listed by no commit" in " ".join(verify.stdout.split()), \
            verify.stdout
        assert not (run / "samples" / "_delta_log").exists()  # nor does a Delta reader
        second = _cli(*command, "--no-wait")
        assert second.returncode == 3, second.stderr[-2000:]  # the writer lock: two writers never interleave

        (barrier / "resume").touch()
        out, err = writer.communicate(timeout=240)
        assert writer.returncode == 0, err[-3000:]
    finally:
        if writer.poll() is None:
            writer.kill()
    assert _snapshot_counts(run) == (PROMPTS * G, PROMPTS)
    assert DeltaTable(str(run / "samples")).to_pyarrow_table().num_rows == PROMPTS * G
    inspect = _cli("inspect", str(run))
    assert inspect.returncode == 0 and str(PROMPTS * G) in inspect.stdout and "no tables" not in inspect.stdout


# ---- on an object store ---------------------------------------------------------------------------

RUN_PROMPTS, RUN_G = 16, 4  # FAULTS_SPEC: per_round, group_size

S3_READER = """
import json, os, sys, time
from pathlib import Path
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from store.run_store import RunStore

def rounds(table):  # round -> [rows, distinct (prompt_id, sample_idx)]
    rows = table.select(["round", "prompt_id", "sample_idx"]).to_pylist()
    found = {}
    for row in rows:
        found.setdefault(row["round"], set()).add((row["prompt_id"], row["sample_idx"]))
    return {r: [sum(1 for x in rows if x["round"] == r), len(keys)] for r, keys in found.items()}

url, stop, out = sys.argv[1], Path(sys.argv[2]), open(sys.argv[3], "a")
read = -1
while True:
    last = stop.exists()
    try:
        latest = DeltaTable(url + "/samples").version()
    except TableNotFoundError:  # no commit of samples yet
        latest = -1
    for version in range(read + 1, latest + 1):  # every version, the ones between polls by time travel
        table = DeltaTable(url + "/samples", version=version).to_pyarrow_table()
        out.write(json.dumps({"reader": "delta", "version": version, "rounds": rounds(table)}) + "\\n")
    read = max(read, latest)
    snapshot = RunStore(url).snapshot()
    out.write(json.dumps({"reader": "log", "version": snapshot.state.seq,
                          "rounds": rounds(snapshot.read("samples"))}) + "\\n")
    out.flush()
    if last:
        break
    time.sleep(0.1)
out.close()
os._exit(0)  # not the interpreter's exit: a library's native threads abort it ("terminate called ...")
"""


def _wait_for(condition, what: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for proc in procs:
            assert proc.poll() is None or proc.returncode in (0, 3), proc.communicate()[1][-3000:]
        time.sleep(0.1)


def _reads(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_two_writers_on_one_s3_run_one_goes_on_and_readers_see_whole_rounds(toy_dir, s3_server, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(FAULTS_SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"'))
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/runs/two"
    command = [sys.executable, "-m", "pipelines.cli", "run", str(spec), "--run-dir", url, "--no-wait"]
    writers = {}
    for name in ("a", "b"):  # two machines: their own node caches; each held in round 2's generate commit
        (tmp_path / f"barrier-{name}").mkdir()
        env = {CACHE_ENV: str(tmp_path / f"node-{name}"),
               PAUSE_ENV: f"commit.files_published:5:{tmp_path / f'barrier-{name}'}"}
        writers[name] = subprocess.Popen(command, cwd=REPO, env=cli_env(env), text=True, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE)
    stop, reads = tmp_path / "stop-reading", tmp_path / "reads.jsonl"
    reader = subprocess.Popen([sys.executable, "-c", S3_READER, url, str(stop), str(reads)], cwd=REPO,
                              env=cli_env(), stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: any((tmp_path / f"barrier-{n}" / "paused").exists() for n in writers),
                  "a writer to reach round 2's commit", [*writers.values(), reader])
        survivor = next(n for n in writers if (tmp_path / f"barrier-{n}" / "paused").exists())
        loser = writers["b" if survivor == "a" else "a"]
        _, err = loser.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert loser.returncode == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert errors[0].startswith(f"error: {url}: run taken over: job ") and "this job stops" in errors[0]

        # the survivor's round 2 samples are in the bucket, not yet committed: no reader sees them
        keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket, Prefix="runs/two/samples/round=2/")
                .get("Contents", [])]
        assert keys, "round 2's part file is not in the bucket yet"
        during = len(_reads(reads))
        _wait_for(lambda: len(_reads(reads)) >= during + 4, "the reader to read during the commit", [reader])
        assert all(set(read["rounds"]) == {"1"} for read in _reads(reads)[during:]), _reads(reads)[during:]
        # a third job on the survivor's machine: refused by that machine's lock
        third = cli("run", spec, "--run-dir", url, "--no-wait", env={CACHE_ENV: str(tmp_path / f"node-{survivor}")})
        assert third.returncode == 3 and third.stderr.startswith(f"error: run {url} is locked by pid "), third.stderr

        (tmp_path / f"barrier-{survivor}" / "resume").touch()
        _, err = writers[survivor].communicate(timeout=300)
        assert writers[survivor].returncode == 0, err[-3000:]
        stop.touch()
        assert reader.wait(timeout=120) == 0, reader.stderr.read()[-3000:]
    finally:
        for proc in [*writers.values(), reader]:
            if proc.poll() is None:
                proc.kill()
    whole = [RUN_PROMPTS * RUN_G] * 2
    reads_made = _reads(reads)
    assert all(rows == whole for read in reads_made for rows in read["rounds"].values()), reads_made
    versions = {read["version"] for read in reads_made if read["reader"] == "delta"}
    assert versions == set(range(max(versions) + 1)) and {"1", "2"} <= set(reads_made[-1]["rounds"])
    mirror = tmp_path / "mirror"
    s3_server.download(bucket, "runs/two", mirror)
    check_invariants(mirror)
