"""The round loop on 2 engines over Ray (the transformers engine: the vLLM engines on Ray are
tested in tests/curation/test_generate_ray.py) with `[run] overlap = 1`: the engines are started
once per invocation and sample round n+1 while round n trains; kill -9 of the driver in the
middle of a round, rerun: every round has exactly prompts x G samples once, each with the
policy_version of the round before (one round off-policy), and the Ray processes the killed
driver started are gone with it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import duckdb
import pytest

from store.faults import FAULT_ENV
from store.run_store import RunStore
from tests.helpers import E2E_SPEC, REPO, check_tables, parquet_sql, round_records

pytestmark = pytest.mark.slow

RAY = """
[generator]
backend = "hf"
group_size = 4
max_tokens = 6
engines = 2
"""


def _spec(tmp_path, toy_dir):
    text = E2E_SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"')
    text = text.replace('[generator]\nbackend = "vllm"\ngroup_size = 4\nmax_tokens = 6\n', RAY.lstrip())
    text = text.replace("rounds = 2\n", "rounds = 3\noverlap = 1\n")
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def _ray_env() -> Iterator[tuple[str, dict]]:
    """A short Ray temp folder (socket paths are limited) and the environment that puts the
    CLI's private Ray instance there; removed afterwards."""
    ray_tmp = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")
    try:
        yield ray_tmp, {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _cli(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def _ray_processes(ray_tmp: str) -> list[str]:
    """Command lines of live processes that belong to the Ray instance under `ray_tmp`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ray_tmp in cmdline:
            found.append(cmdline[:200])
    return found


def test_overlap_on_two_engines_survives_kill_of_the_driver(toy_dir, tmp_path):
    spec, run_dir = _spec(tmp_path, toy_dir), tmp_path / "run"
    cmd = [sys.executable, "-m", "pipelines.cli", "run", str(spec), "--run-dir", str(run_dir)]
    with _ray_env() as (ray_tmp, env):
        # The kill lands after step 3 is logged: in round 2's training, while the engines
        # sample round 3 (or just after).
        crash = _cli(cmd, {**env, FAULT_ENV: "train.step_logged:3"})
        assert crash.returncode == -9, crash.stderr[-3000:]
        assert [r["round"] for r in round_records(run_dir)] == [0, 1]
        log = crash.stdout + crash.stderr  # progress lines go to stderr
        assert log.count("starting the hf engine") == 1
        assert "round 2: generate 24 prompts x 4 with policy_version 0, while round 1 trains" in log
        deadline = time.monotonic() + 30
        while _ray_processes(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ray_processes(ray_tmp) == []  # engines, raylet and GCS died with the driver
        done = _cli(cmd, env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (done.stdout + done.stderr).count("starting the hf engine") == 1
    records = round_records(run_dir)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert [r["policy_version"] for r in records] == [0, 2, 4, 6]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in steps if r["event"] == "step") == list(range(1, 7))
    assert [r["samples"] for r in records[1:]] == [24 * 4] * 3
    # round n was sampled with the weights round n-1 started from
    versions = duckdb.sql(f"SELECT round, min(policy_version), max(policy_version) FROM "
                          f"{parquet_sql(run_dir, 'samples')} GROUP BY round ORDER BY round").fetchall()
    assert versions == [(1, 0, 0), (2, 0, 0), (3, 2, 2)]
    assert RunStore(run_dir).rounds("samples") == [1, 2, 3]
    check_tables(run_dir)
