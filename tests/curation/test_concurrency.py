"""Readers beside a writer, and two writers, as real processes on real files.

The writer is `groupforge generate`, held half way through its commit (its part files written
under their final names, its commit log entry not yet) by
`GROUPFORGE_PAUSE=commit.files_published:1:DIR` (curation/faults.py): it writes DIR/paused and
waits for DIR/resume. No sleep decides when a reader runs. While it waits: a bare glob over the
table folder already sees the new rows (the state every reader would meet at that moment), while
readers of the commit log (`RunStore.snapshot`, `duckdb_views`, and `groupforge inspect` /
`export` / `verify`) and of the Delta tables see the round not at all; a second writer is refused.
Once resumed, both see the round whole."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
from deltalake import DeltaTable

from curation.faults import PAUSE_ENV
from tests.helpers import REPO

PROMPTS, G = 24, 4

READER = """
import sys, duckdb
from curation.store.run_store import RunStore
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
