"""The round loop end to end on the toy: kill -9 mid-round, resume, extend with --rounds +K,
pick up a new prompt file, and keep a second job off the run. On the transformers engine (the
loop's work is the same on each; vLLM in the loop: test_real_model.py, and on Ray, resumed after
a kill on fresh engines: test_run_ray.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from curation.generate.base import load_prompts
from store.faults import FAULT_ENV
from store.run_store import RunStore
from tests.helpers import E2E_SPEC, REPO, check_tables, groupforge_in_process, round_records

pytestmark = pytest.mark.slow


def _spec(tmp_path, toy_dir, train_files):
    path = tmp_path / "spec.toml"
    text = E2E_SPEC.format(toy=toy_dir, train=", ".join(f'"{f}"' for f in train_files))
    path.write_text(text.replace('backend = "vllm"', 'backend = "hf"'))
    return path


def _run(spec, run_dir, *args, env=None, child=False):
    """`groupforge run`: in this process, or in a child with `env` (a fault point that kills it)
    or `child` (a second job, refused by the lock this process holds)."""
    if env is None and not child:
        return groupforge_in_process("run", spec, "--run-dir", run_dir, *args)
    cmd = [sys.executable, "-m", "pipelines.cli", "run", str(spec), "--run-dir", str(run_dir), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_kill_mid_round_resume_extend_and_lock(toy_dir, tmp_path):
    spec = _spec(tmp_path, toy_dir, [toy_dir / "train.parquet"])
    run_dir = tmp_path / "run"

    # Round 1 trains steps 1-2; the kill lands after step 3 is logged, in round 2's training,
    # after round 2's samples and curation were committed and before its checkpoint.
    crash = _run(spec, run_dir, env={FAULT_ENV: "train.step_logged:3"})
    assert crash.returncode == -9, crash.stderr[-2000:]
    assert [r["round"] for r in round_records(run_dir)] == [0, 1]
    assert RunStore(run_dir).rounds("samples") == [1, 2]

    done = _run(spec, run_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    records = round_records(run_dir)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert [r["policy_version"] for r in records] == [0, 2, 4]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in steps if r["event"] == "step") == [1, 2, 3, 4]  # step 3 not duplicated
    for r in records[1:]:
        assert r["samples"] == 24 * 4 and 0 <= r["eval_accuracy"] <= 1 and r["reward_mean"] is not None
    assert "eval acc" in done.stdout and (run_dir / "report" / "progress.png").is_file()
    summary = (run_dir / "report" / "summary.md").read_text()  # counts from the tables too
    assert "## Tables" in summary and "| 2 | 96 | 96 |" in summary
    check_tables(run_dir)

    # Rerunning a finished run does nothing.
    again = _run(spec, run_dir)
    assert again.returncode == 0 and [r["round"] for r in round_records(run_dir)] == [0, 1, 2]

    # Scheduled refresh: a new prompt file in the spec, then --rounds +1. Its prompts were never
    # used, so round 3 takes them first.
    extra = tmp_path / "more.parquet"
    pq.write_table(pq.read_table(toy_dir / "eval.parquet").slice(100, 30), extra)
    spec = _spec(tmp_path, toy_dir, [toy_dir / "train.parquet", extra])
    more = _run(spec, run_dir, "--rounds", "+1")
    assert more.returncode == 0, more.stderr[-2000:]
    assert [r["round"] for r in round_records(run_dir)] == [0, 1, 2, 3]
    new_ids = set(load_prompts(extra).column("prompt_id").to_pylist())
    round3 = set(pq.read_table(run_dir / "_rounds" / "round=3" / "prompts.parquet").column("prompt_id").to_pylist())
    assert len(round3 & new_ids) == 24  # 24 per round, all from the 30 unused new prompts
    check_tables(run_dir)

    # A second job on a locked run exits with a distinct code when told not to wait.
    with RunStore(run_dir).lock():
        busy = _run(spec, run_dir, "--rounds", "+1", "--no-wait", child=True)
    assert busy.returncode == 3 and "lock" in busy.stderr.lower()
    assert [r["round"] for r in round_records(run_dir)] == [0, 1, 2, 3]
