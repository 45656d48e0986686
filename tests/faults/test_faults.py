"""The fault-injection harness: the real CLI on the toy, SIGKILLed at named points
(`GROUPFORGE_FAULT=<point>:<count>`, store/faults.py) in a process of its own, rerun to
completion (in this process: the same `main()`, tests/helpers.py's groupforge_in_process), then checked
by readers of its own (DuckDB and pyarrow over the files, transformers for checkpoints), not
the store's code:

- each (round, prompt_id, sample_idx) once in samples; groups + rejects cover samples exactly
- every file a commit log entry lists exists with the sha256, size and rows the entry records;
  no part file is left that no entry lists (a killed commit's files are swept by the rerun);
  each table's Delta log (read by delta-rs) lists exactly the live files of the commit log
- every checkpoint loads with transformers (and after a kill while a checkpoint is written, the
  newest with vLLM, which answers greedily as transformers does); metrics.jsonl has each round and each step once
- the final weights equal those of a run nobody killed (the toy run is deterministic)

`make test` (and `-m "not slow"`) makes 9 kills one after another on one run (LOCAL_KILLS), 3
on one finished run (export, report, append), and 6 more on a run on S3 (S3_KILLS): every point
of a single-turn run is tried there, but `commit.logged` and `loop.after_curate`, which
tests/store/test_migrate.py and tests/pipelines/test_curriculum_run.py kill and resume.
`make test-exhaustive` adds all 29 kills each alone (a kill, a rerun, the checks) and the two
multi-turn ones (a multi-turn round of the real model killed between turns or in a tool call:
its trajectories checked against those of the same run nobody killed). docs/reliability.md's
"Faults tried" table lists the points and outcomes.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import torch
from deltalake import DeltaTable
from safetensors.torch import load_file

from store.faults import FAULT_ENV, POINTS
from store.location import CACHE_ENV
from store.storage import TEMP_PREFIX
from tests.helpers import (
    FAULTS_SPEC,
    REPO,
    check_invariants,
    commit_rows,
    groupforge_in_process,
    logged_files,
    parquet_sql,
    round_records,
)

# The round loop test's spec, with the transformers generator (fast to start, deterministic)
# and two chunks a round (so a kill can land between them).

# (point, count, command): what each kill interrupts. A round commits generate, score, filter,
# label in that order (commits 1-4 in round 1, 5-8 in round 2); it generates 2 chunks.
CASES = [
    ("generate.chunk_staged", 1, "run"),       # round 1: the first of two chunks staged
    ("generate.chunk_staged", 2, "run"),       # round 1: both chunks staged, not committed
    ("generate.chunk_staged", 3, "run"),       # round 2: the first chunk staged
    ("commit.tables_written", 1, "run"),       # round 1's generate commit: Delta versions, no row
    ("commit.tables_written", 3, "run"),       # round 1's filter commit
    ("commit.tables_written", 8, "run"),       # round 2's label commit
    ("commit.logged", 1, "run"),               # round 1's generate commit: its row written
    ("commit.logged", 8, "run"),               # round 2's label commit
    ("commit.files_published", 2, "run"),      # round 1's score: part files written, no log entry
    ("commit.files_published", 5, "run"),      # round 2's generate
    ("commit.files_published", 7, "run"),      # round 2's filter
    ("stage.before_commit", 1, "run"),         # round 1's score computed, nothing written
    ("stage.before_commit", 3, "run"),         # round 1's label
    ("stage.before_commit", 5, "run"),         # round 2's filter
    ("train.step_logged", 1, "run"),           # round 1, first step logged
    ("train.step_logged", 3, "run"),           # round 2, first step logged
    ("train.step_logged", 4, "run"),           # round 2, last step logged, not checkpointed
    ("checkpoint.weights_written", 1, "run"),  # round 1's checkpoint: weights, no optimizer state
    ("checkpoint.weights_written", 2, "run"),  # round 2's
    ("checkpoint.optimizer_written", 1, "run"),  # round 1's: weights and optimizer state, no trainer_state.json
    ("loop.after_curate", 1, "run"),           # round 1 curated, not trained
    ("loop.after_curate", 2, "run"),           # round 2
    ("loop.reload", 1, "run"),                 # the engine loads round 1's weights
    ("loop.reload", 2, "run"),                 # round 2's
    ("loop.eval", 1, "run"),                   # round 0's evaluation (the start model)
    ("loop.eval", 2, "run"),                   # round 1's
    ("export.before_rename", 1, "export"),
    ("report.before_write", 1, "report"),
    ("dataset.rows_built", 1, "append"),       # export --append-to: the rows built, nothing written
]
# Each kill alone (a kill, a rerun, the checks) is `make test-exhaustive`'s; `make test` makes the
# kills of LOCAL_KILLS and FINISHED_KILLS one after another (below), and S3_KILLS on object storage.
_ALONE = (pytest.mark.slow, pytest.mark.exhaustive)


# vLLM loads the newest checkpoint after these (an engine start costs ~10 s)
ENGINE_CHECKED = {("checkpoint.weights_written", 2), ("checkpoint.weights_written", 1)}


def _cli_env(fault: str | None = None, cache: Path | None = None) -> dict[str, str]:
    """The CLI's environment: `fault` as GROUPFORGE_FAULT; `cache` as its node-local cache for
    object-store runs (GROUPFORGE_CACHE: a fresh folder is a fresh machine)."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    if cache is not None:
        env[CACHE_ENV] = str(cache)
    return {**env, "OMP_NUM_THREADS": "1"}


def _cli(args: list[str], fault: str | None = None, cache: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, run to its end."""
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=_cli_env(fault, cache))


def _rerun(args: list[str], cache: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI run to its end in this process (tests/helpers.py's groupforge_in_process; no fault
    point set), `cache` as its node-local cache: a rerun after a kill, or the run nobody killed."""
    return groupforge_in_process(*args, env={"OMP_NUM_THREADS": "1", **({} if cache is None else {CACHE_ENV: cache})})


def _killed(args: list[str], point: str, count: int, cache: Path | None = None) -> None:
    """The CLI with `args`, SIGKILLed at the `count`th pass of `point` (checked: it was reached)."""
    crash = _cli(args, fault=f"{point}:{count}", cache=cache)
    assert crash.returncode == -9, f"{point}:{count} was not reached ({crash.returncode}): {crash.stderr[-2000:]}"


def _commands(spec: Path, run_dir: Path) -> dict[str, list[str]]:
    return {"run": ["run", str(spec), "--run-dir", str(run_dir)],
            "export": ["export", str(run_dir), "--format", "prompt_only"],
            "report": ["report", str(run_dir)],
            "append": ["export", str(run_dir), "--format", "unpaired", "--append-to", str(run_dir.parent / "dataset")]}


@pytest.fixture(scope="module")
def spec(toy_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "faults.toml"
    path.write_text(FAULTS_SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"'))
    return path


@pytest.fixture(scope="module")
def reference(spec, tmp_path_factory) -> Path:
    """The run nobody killed."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = _rerun(_commands(spec, run_dir)["run"])
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _newest_checkpoint(run_dir: Path) -> Path:
    return max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(_newest_checkpoint(run_dir) / "model.safetensors")


def _check_output(run_dir: Path, command: str) -> None:
    """What an `export`, `report` or `export --append-to` (`_commands`) rerun after its kill wrote."""
    if command == "export":
        out = run_dir / "exports" / "prompt_only-standard.parquet"
        assert pq.read_table(out).num_rows > 0 and not list(out.parent.glob("*.tmp*"))
    if command == "report":
        assert (run_dir / "report" / "summary.md").is_file()
    if command == "append":  # one version with both rounds once; the killed append wrote no file
        dataset = DeltaTable(str(run_dir.parent / "dataset"))
        assert dataset.version() == 0 and sorted(set(dataset.to_pyarrow_table()["round"].to_pylist())) == [1, 2]
        assert len(list((run_dir.parent / "dataset").glob("*.parquet"))) == len(dataset.file_uris())


ENGINE_CHECK = """
import sys
from curation.generate.base import tokenize_prompt
from curation.generate.stage import make_generator
answers = []
for backend in ("vllm", "hf"):
    g = make_generator(backend, sys.argv[1], dtype="float32")
    ids = [tokenize_prompt(g.tokenizer, p, None) for p in ("12+7=", "3+45=", "20+20=", "9+9=")]
    answers.append(g.greedy(ids, max_tokens=4))
    g.close()
assert answers[0] == answers[1], answers
print("ok", answers[0])
"""


def check_engine_loads(folder: Path) -> None:
    """vLLM loads the checkpoint `folder` and answers greedily as transformers does."""
    done = subprocess.run([sys.executable, "-c", ENGINE_CHECK, str(folder)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = done.stdout.strip().splitlines()  # vLLM logs to stdout too
    assert done.returncode == 0 and lines and lines[-1].startswith("ok ["), done.stderr[-3000:]


@pytest.mark.parametrize("point,count,command", [
    pytest.param(*case, marks=_ALONE, id=f"{case[0]}:{case[1]}")
    for case in CASES])
def test_kill_at_a_named_point_then_rerun(point, count, command, spec, reference, tmp_path):
    assert point in POINTS
    run_dir = tmp_path / "run"
    commands = _commands(spec, run_dir)
    if command != "run":  # export and report work on a finished run: a copy of the reference
        shutil.copytree(reference, run_dir, symlinks=True)
    _killed(commands[command], point, count)
    again = _rerun(commands[command])
    assert again.returncode == 0, again.stderr[-3000:]
    if command != "run":
        again = _rerun(commands["run"])  # the run itself is untouched
        assert again.returncode == 0, again.stderr[-3000:]
    check_invariants(run_dir)
    if (point, count) in ENGINE_CHECKED:
        check_engine_loads(_newest_checkpoint(run_dir))
    got, want = _final_weights(run_dir), _final_weights(reference)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), f"{point}: the final weights differ from the reference"
    _check_output(run_dir, command)


# (point, count): one after another on one local run, each count within its own process (a
# process resumes where the one before was killed); the comment says what each interrupts. With
# S3_KILLS, tests/store/test_migrate.py (commit.logged) and tests/pipelines/test_curriculum_run.py
# (loop.after_curate), every point of a single-turn run is tried in `make test`.
LOCAL_KILLS = [
    ("generate.chunk_staged", 1),         # round 1: the first of two chunks staged
    ("commit.files_published", 2),        # round 1's score: part files written, no Delta version
    ("stage.before_commit", 3),           # round 1's label computed, nothing written
    ("checkpoint.optimizer_written", 1),  # round 1's checkpoint: weights and optimizer state, no trainer_state.json
    ("loop.reload", 1),                   # the engine loading round 1's weights
    ("loop.eval", 1),                     # round 1's greedy evaluation
    ("commit.tables_written", 2),         # round 2's score: its Delta versions written, its row in _commits not
    ("train.step_logged", 2),             # round 2's last step logged, not checkpointed
    ("checkpoint.weights_written", 1),    # round 2's checkpoint: weights written, no optimizer state
]
# (point, count, command) on a finished run, one after another, each command then rerun
FINISHED_KILLS = [("export.before_rename", 1, "export"), ("report.before_write", 1, "report"),
                  ("dataset.rows_built", 1, "append")]


def test_a_run_killed_at_every_point_in_turn_ends_as_the_run_nobody_killed(spec, reference, tmp_path):
    """LOCAL_KILLS one after another on one run, then a rerun to its end: the run checks whole
    (check_invariants), vLLM loads its newest checkpoint (rewritten after the last kill) and
    answers greedily as transformers does, and its final weights are the reference's."""
    run_dir = tmp_path / "run"
    command = _commands(spec, run_dir)["run"]
    for point, count in LOCAL_KILLS:
        _killed(command, point, count)
    again = _rerun(command)
    assert again.returncode == 0, again.stderr[-3000:]
    check_invariants(run_dir)
    check_engine_loads(_newest_checkpoint(run_dir))
    got, want = _final_weights(run_dir), _final_weights(reference)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "the final weights differ from the reference"


def test_export_report_and_append_killed_then_rerun(spec, reference, tmp_path):
    """FINISHED_KILLS on a copy of the finished reference run, each command rerun after its kill:
    the outputs are whole, no temp file is left, and the run itself is untouched (a rerun of it
    has nothing to do and the run checks whole)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, symlinks=True)
    commands = _commands(spec, run_dir)
    for point, count, command in FINISHED_KILLS:
        _killed(commands[command], point, count)
        again = _rerun(commands[command])
        assert again.returncode == 0, again.stderr[-3000:]
    again = _rerun(commands["run"])
    assert again.returncode == 0, again.stderr[-3000:]
    check_invariants(run_dir)
    got, want = _final_weights(run_dir), _final_weights(reference)
    assert all(torch.equal(got[k], want[k]) for k in want), "the run's weights changed"
    for _, _, command in FINISHED_KILLS:
        _check_output(run_dir, command)


def test_the_readme_lists_every_point():
    text = (REPO / "docs" / "reliability.md").read_text()
    table = text[text.index("## Faults tried"):].split("\n## ", 1)[0]
    rows = {line.split("`")[1]: line for line in table.splitlines() if line.startswith("| `")}
    tried = {case[0] for case in CASES} | {p for p, _ in S3_KILLS} | set(MULTI_TURN_POINTS)
    assert {p for p, _ in LOCAL_KILLS} | {p for p, _ in S3_KILLS} | {p for p, _, _ in FINISHED_KILLS} == \
        set(POINTS) - set(MULTI_TURN_POINTS) - {"commit.logged", "loop.after_curate"}
    assert list(rows) == list(POINTS) and tried == set(POINTS)
    for point in MULTI_TURN_POINTS:
        assert "multi-turn" in rows[point].split("|")[2], point
    for point, count, _ in CASES:  # each kill tried is in its point's row
        assert f"{count}" in rows[point].split("|")[2], (point, count)
    for point, count in S3_KILLS:
        assert f"S3: {count}" in rows[point].split("|")[2], (point, count)
    for point, count in LOCAL_KILLS:
        assert f"in turn: {count}" in rows[point].split("|")[2], (point, count)


# ---- multi-turn rollouts ----------------------------------------------------------------------

MULTI_TURN_SPEC = """
[run]
name = "multi-turn-faults"
rounds = 1
steps_per_round = 1
seed = 1

[model]
path = "{model}"

[prompts]
train = ["{prompts}/train.parquet"]
eval = "{prompts}/eval.parquet"
per_round = 2
eval_limit = 2

[generator]
backend = "hf"
group_size = 2
max_tokens = 16
temperature = 0.3
chunk_prompts = 1

[env]
name = "tests.env_fixtures:ScriptedCalls"
max_turns = 2
max_tokens = 200

[[score.rewards]]
name = "math"

[filter]
drop_zero_variance = false

[train]
batch_size = 4
lr = 1e-5

[eval]
metric = "math"
max_tokens = 1
"""
"""One round of SmolLM2 (the toy has no chat template, which multi-turn needs) on the transformers
backend, at a temperature where its turns mostly end by themselves: 2 prompts x 2 trajectories
in 2 chunks of one prompt, each assistant turn answered by a call of a slow tool
(tests/env_fixtures.py) in the tools environment's worker process. The greedy eval (multi-turn
too) takes one token a turn: its turns are cut, so it calls no tool and no kill counts it."""

MULTI_TURN_POINTS = ("generate.turn", "env.tool_call")
"""Killed in round 1's second chunk (the first one staged): at its first environment turn that
leaves trajectories to go on (its state staged), and while its first tool call runs (the count:
the passes of the first chunk, + 1, from the run nobody killed)."""

_TRAJECTORY = ["prompt_id", "sample_idx", "response_token_ids", "behavior_logprobs", "response_mask", "turns",
               "messages_out", "tool_calls", "tool_errors", "stop_reason"]


@pytest.fixture(scope="module")
def multi_turn(real_model, tmp_path_factory) -> tuple[Path, Path]:
    """(spec, the run nobody killed) of MULTI_TURN_SPEC."""
    from pipelines.models.chat_tasks import write_task

    folder = tmp_path_factory.mktemp("multi-turn")
    write_task("addition", folder / "prompts", train=8, eval=2)
    spec = folder / "spec.toml"
    spec.write_text(MULTI_TURN_SPEC.format(model=real_model, prompts=folder / "prompts"))
    run_dir = folder / "reference"
    done = _cli(_commands(spec, run_dir)["run"])
    assert done.returncode == 0, done.stderr[-3000:]
    return spec, run_dir


def _trajectories(run_dir: Path) -> list[dict]:
    """The trajectory columns of the run's samples (read with pyarrow), by prompt and sample."""
    rows = [row for path in logged_files(run_dir, "samples") for row in pq.read_table(path, columns=_TRAJECTORY)
            .to_pylist()]
    return sorted(rows, key=lambda row: (row["prompt_id"], row["sample_idx"]))


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("point", MULTI_TURN_POINTS)
def test_a_multi_turn_round_killed_between_turns_or_in_a_tool_call_resumes(point, multi_turn, tmp_path):
    """SIGKILL in round 1's second chunk, between two turns or while a tool call runs in its
    worker: the rerun reuses the staged first chunk (and between turns the second chunk's staged
    turn), commits the round, and its trajectories are those of the run nobody killed."""
    spec, reference = multi_turn
    first = pq.read_table(reference / "_rounds" / "round=1" / "prompts.parquet").column("prompt_id")[0].as_py()
    chunk = [row for row in _trajectories(reference) if row["prompt_id"] == first]
    passes = max(len([t for t in row["turns"] if t["role"] == "assistant"]) for row in chunk) - 1 \
        if point == "generate.turn" else sum(row["tool_calls"] for row in chunk)
    later = [row for row in _trajectories(reference) if row["prompt_id"] != first]
    assert point == "generate.turn" or sum(row["tool_calls"] for row in later) >= 1, \
        "the reference run has no tool call in its second chunk: change the spec's seed"
    run_dir = tmp_path / "run"
    command = _commands(spec, run_dir)["run"]
    _killed(command, point, passes + 1)
    assert not logged_files(run_dir, "samples") and len(list((run_dir / "_staging").rglob("chunk-*.parquet"))) == 1
    if point == "generate.turn":  # the second chunk's trajectories after their first turn, staged
        assert len(list((run_dir / "_staging").rglob("chunk-000001.turn.json"))) == 1
    again = _cli(command)
    assert again.returncode == 0, again.stderr[-3000:]
    check_invariants(run_dir)
    manifest = [row["manifest"] for row in commit_rows(run_dir) if row["stage"] == "generate"][-1]
    assert manifest["resumed_chunks"] == 1
    assert _trajectories(run_dir) == _trajectories(reference)
    records = round_records(run_dir)
    assert [r["round"] for r in records] == [0, 1] and records[1]["stop_reasons"] == round_records(reference)[1][
        "stop_reasons"]


# ---- a run on object storage ------------------------------------------------------------------

S3_KILLS = [  # one after another on one run, each process on a fresh machine (an empty cache)
    ("commit.files_published", 2),      # round 1's score commit: part files on S3, no Delta version
    ("commit.tables_written", 1),       # the rerun's first commit (round 1's score): Delta versions, no row
    ("location.file_uploaded", 3),      # round 1's checkpoint half uploaded (no trainer_state.json)
    ("train.step_logged", 2),           # a step line in S3's metrics.jsonl, no checkpoint after it
    ("checkpoint.weights_written", 1),  # a checkpoint in the cache only, nothing uploaded
    ("loop.reload", 1),                 # the engine loading weights fetched from S3
]


def _kill_at_a_random_moment(command: list[str], cache: Path, keys, rng: random.Random) -> tuple[int, float]:
    """Start the CLI, wait until it has changed the run's objects (`keys()`: their set; it is past
    start-up and working), then SIGKILL it after a random 0-1.5 s. Its exit code and the delay."""
    before = keys()
    process = subprocess.Popen([sys.executable, "-m", "pipelines.cli", *command], cwd=REPO, env=_cli_env(cache=cache),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while process.poll() is None and keys() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    delay = rng.uniform(0.0, 1.5)
    time.sleep(delay)
    process.kill()
    process.communicate(timeout=60)
    return process.returncode, delay


def test_a_run_on_s3_resumes_after_kills_on_fresh_machines(spec, reference, s3_server, tmp_path):
    """The toy loop with --run-dir s3://... on moto's S3 server, SIGKILLed at each of S3_KILLS
    in turn and then at a random moment of its last round, each rerun with an empty node cache
    (it resumes from the bucket alone); then the
    bucket, read by boto3, DuckDB, pyarrow, delta-rs and Polars (not by groupforge), holds a
    whole run with the weights of the run nobody killed, and no local run folder was made."""
    import polars as pl

    bucket = s3_server.bucket()
    url = f"s3://{bucket}/runs/faults"
    command = ["run", str(spec), "--run-dir", url]
    for i, (point, count) in enumerate(S3_KILLS):
        _killed(command, point, count, cache=tmp_path / f"node-{i}")
    client = s3_server.client()
    pages = client.get_paginator("list_objects_v2")

    def keys() -> set[str]:
        return {item["Key"] for page in pages.paginate(Bucket=bucket, Prefix="runs/faults/")
                for item in page.get("Contents", [])}

    seed = random.randrange(2**32)
    code, delay = _kill_at_a_random_moment(command, tmp_path / "node-random", keys, random.Random(seed))
    assert code == -9, f"the kill {delay:.2f} s into round 2's work (seed {seed}) came after the run ended ({code})"
    done = _rerun(command, cache=tmp_path / "node-last")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (REPO / "runs" / "faults").exists() and not (tmp_path / "runs").exists()

    mirror = tmp_path / "mirror"
    keys = s3_server.download(bucket, "runs/faults", mirror)
    assert "metrics.jsonl" in keys and any(k.startswith("samples/_delta_log/") for k in keys)
    check_invariants(mirror)
    got, want = _final_weights(mirror), _final_weights(reference)
    assert all(torch.equal(got[k], want[k]) for k in want), "the final weights differ from the local reference"
    rows = duckdb.sql(f"SELECT count(*) FROM {parquet_sql(mirror, 'samples')}").fetchall()[0][0]
    assert pl.scan_delta(f"{url}/samples").select(pl.len()).collect().item() == rows  # over the endpoint
    con = duckdb.connect()  # docs/object-storage.md's DuckDB query of the pyarrow dataset over the endpoint
    con.register("samples", DeltaTable(f"{url}/samples").to_pyarrow_dataset())
    by_round = con.sql("SELECT round, count(*) FROM samples GROUP BY round ORDER BY round").fetchall()
    assert [r for r, _ in by_round] == [1, 2] and sum(n for _, n in by_round) == rows
    assert DeltaTable(f"{url}/groups").to_pyarrow_table().num_rows == \
        duckdb.sql(f"SELECT count(*) FROM {parquet_sql(mirror, 'groups')}").fetchall()[0][0]


# ---- a full disk ------------------------------------------------------------------------------

def _usage(folder: Path) -> int:
    """Bytes `folder` takes on a tmpfs: every file rounded up to 4 KiB pages, plus a page per folder."""
    pages = sum(-(-p.stat().st_size // 4096) if p.is_file() else 1 for p in folder.rglob("*"))
    return (pages + 1) * 4096


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted at tmp_path/disk; `resize(bytes)` changes its size (frees or takes space)."""
    mount = tmp_path / "disk"
    mount.mkdir()

    def resize(size: int) -> None:
        options = f"size={size}" if not os.path.ismount(mount) else f"remount,size={size}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")

    yield mount, resize
    if os.path.ismount(mount):
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("fraction", [pytest.param(0.02, id="early"),
                                      pytest.param(0.93, id="late", marks=(pytest.mark.slow,
                                                                           pytest.mark.exhaustive))])
def test_a_full_disk_is_one_error_line_and_the_rerun_resumes(fraction, spec, reference, small_disk):
    """The run folder sits on a tmpfs that holds `fraction` of what the finished run needs: the run
    stops with exit 4 and one line naming a folder of the run, a rerun while still full does the
    same, and once the space is freed the rerun completes to the uninterrupted run's weights."""
    mount, resize = small_disk
    resize(max(64 * 1024, int(_usage(reference) * fraction)))
    run_dir = mount / "run"
    for attempt in ("full", "still full"):
        crash = _cli(_commands(spec, run_dir)["run"])
        assert crash.returncode == 4, f"{attempt}: exit {crash.returncode}: {crash.stderr[-3000:]}"
        errors = [line for line in crash.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in crash.stderr, crash.stderr[-3000:]
        assert "no space left on device in " + str(run_dir) in errors[0], errors[0]
        assert "rerun the same command" in errors[0]
        left = [p for p in run_dir.rglob("*") if p.name.endswith(".tmp") or ".tmp-step-" in p.name
                or p.name.startswith(TEMP_PREFIX)]
        assert not left, f"temporary files left on the full disk: {left}"
    resize(4 * _usage(reference))
    again = _rerun(_commands(spec, run_dir)["run"])
    assert again.returncode == 0, again.stderr[-3000:]
    check_invariants(run_dir)
    got, want = _final_weights(run_dir), _final_weights(reference)
    assert all(torch.equal(got[k], want[k]) for k in want), "the final weights differ from the reference"


def test_debug_shows_the_traceback(spec, small_disk):
    mount, resize = small_disk
    resize(64 * 1024)
    crash = _cli(["--debug", *_commands(spec, mount / "run")["run"]])
    assert crash.returncode == 1 and "Traceback" in crash.stderr, crash.stderr[-2000:]
    assert "NoSpaceError" in crash.stderr, crash.stderr[-2000:]
