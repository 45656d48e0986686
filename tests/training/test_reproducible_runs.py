"""The shipped recipe reproduces: two runs of pipelines/specs/toy-grpo.toml (share_prompts on,
its default) with the same seed, each in its own process, write the same step records and
byte-identical checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib

import pytest

from tests.helpers import REPO

VARYING = {"seconds", "tokens_per_s"}
"""Wall-clock fields of a step record."""


def run_recipe(run_dir) -> None:
    cmd = [sys.executable, "-m", "pipelines.cli", "run", "pipelines/specs/toy-grpo.toml", "--run-dir", str(run_dir),
           "--set", "run.rounds=2", "--set", "prompts.per_round=16", "--set", "run.steps_per_round=3",
           "--set", "eval.every=100"]
    # two torch threads: a parallel scatter-add's order shows only with more than one
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def step_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if json.loads(line).get("event") == "step"]
    return [{k: v for k, v in record.items() if k not in VARYING} for record in steps]


def checkpoint_digests(run_dir) -> dict[str, str]:
    return {str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(run_dir.glob("checkpoints/*/*.safetensors"))}


@pytest.mark.slow
def test_two_runs_of_the_shipped_grpo_recipe_are_identical(toy_dir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_recipe(first)
    run_recipe(second)
    assert tomllib.loads((first / "spec.toml").read_text())["train"]["share_prompts"] is True
    records = step_records(first)
    assert len(records) == 6 and {r["step"] for r in records} == set(range(1, 7))
    assert records == step_records(second)
    digests = checkpoint_digests(first)
    assert digests and digests == checkpoint_digests(second)
