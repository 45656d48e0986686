"""The `groupforge` CLI: wrong tables and flags, inspect and the rerun after a kill, run in this
process; the kill and a lock held by another process through the installed console script in a
child process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store.faults import FAULT_ENV
from store.run_log import COMMITS
from store.run_store import RunStore
from tests.helpers import ENV, GROUPFORGE, commit_rows, error_line, groupforge, groupforge_in_process, make_toy_run


def write_bad_prompt_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of wrong prompts table -> (file, a phrase the error must contain)."""
    folder.mkdir(parents=True, exist_ok=True)
    missing = folder / "missing_column.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "reference": ["2"]}), missing)
    wrong_type = folder / "wrong_type.parquet"
    pq.write_table(pa.table({"prompt": [11, 12], "reference": ["2", "3"]}), wrong_type)
    empty = folder / "empty.parquet"
    empty.write_bytes(b"")
    not_parquet = folder / "not_parquet.parquet"
    not_parquet.write_text("prompt,reference\n1+1=,2\n")
    return {
        "missing column": (missing, "missing column 'prompt'"),
        "wrong type": (wrong_type, "column 'prompt' has type int64, expected string"),
        "empty file": (empty, "file is empty"),
        "not parquet": (not_parquet, "not a readable Parquet file"),
    }


@pytest.mark.parametrize("kind", ["missing column", "wrong type", "empty file", "not parquet"])
def test_generate_rejects_wrong_prompt_tables(tmp_path, toy_dir, kind):
    path, phrase = write_bad_prompt_files(tmp_path / "bad")[kind]
    proc = groupforge_in_process("generate", "--model", toy_dir / "model", "--prompts", path,
                                 "--out", tmp_path / "run", "--backend", "hf", "-G", 2)
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert phrase in line and str(path) in line
    assert not list((tmp_path / "run").rglob("*.parquet")) and not (tmp_path / "run" / COMMITS).exists()


def test_inspect_rejects_wrong_run_tables(tmp_path):
    """A samples partition with a wrong column type, a missing column, an empty or non-Parquet file."""
    good = {
        "run_id": ["r"], "round": pa.array([0], pa.int32()), "prompt_id": ["p"],
        "sample_idx": pa.array([0], pa.int32()),
        "group_size": pa.array([1], pa.int32()), "prompt_token_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
        "response": ["3"], "response_token_ids": pa.array([[5, 2]], pa.list_(pa.int32())),
        "behavior_logprobs": pa.array([[-0.1, -0.2]], pa.list_(pa.float32())), "finish_reason": ["stop"],
        "policy_version": pa.array([0], pa.int64()), "generator": ["g"], "seed": pa.array([1], pa.int64()),
    }
    cases = {
        "wrong type": ({**good, "behavior_logprobs": ["oops"]}, "column 'behavior_logprobs' has type string"),
        "missing column": ({k: v for k, v in good.items() if k != "response"}, "missing column 'response'"),
    }
    for kind, (columns, phrase) in cases.items():
        run = tmp_path / kind.replace(" ", "_")
        part = run / "samples" / "round=0" / "part-generate.parquet"
        part.parent.mkdir(parents=True)
        pq.write_table(pa.table(columns), part)
        proc = groupforge_in_process("inspect", run)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert phrase in error_line(proc)
    for kind, content in {"empty": b"", "not parquet": b"this is not parquet at all"}.items():
        run = tmp_path / kind.replace(" ", "_")
        part = run / "samples" / "round=0" / "part-generate.parquet"
        part.parent.mkdir(parents=True)
        part.write_bytes(content)
        proc = groupforge_in_process("inspect", run)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "part-generate.parquet" in error_line(proc)


def test_generate_killed_midway_then_resumed_then_noop(tmp_path, toy_dir):
    """kill -9 during generate, after 2 of its 12 chunks are staged: no partial table; the rerun
    completes (reusing finished chunks); a third run is a no-op that names the commit log entry
    it found up to date. The transformers engine: the kill and resume do not depend on it."""
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / "train.parquet").slice(0, 96), prompts)
    run = tmp_path / "run"
    args = ["generate", "--model", toy_dir / "model", "--prompts", prompts, "--out", run, "-G", 4,
            "--max-tokens", 8, "--chunk-prompts", 8, "--seed", 3, "--backend", "hf"]
    crash = subprocess.run([GROUPFORGE, *map(str, args)], env={**ENV, FAULT_ENV: "generate.chunk_staged:2"},
                           capture_output=True, text=True, timeout=600)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-2000:]
    staging = run / "_staging" / "generate-round=0"
    staged = len(list(staging.glob("chunk-*.parquet")))
    assert staged == 2
    assert not list((run / "samples").rglob("*.parquet")) if (run / "samples").exists() else True
    assert RunStore(run).load_manifest("generate", 0) is None

    done = groupforge_in_process(*args)
    assert done.returncode == 0, done.stderr
    store = RunStore(run)
    samples = store.read("samples")
    assert samples.num_rows == 96 * 4
    keys = {(r["prompt_id"], r["sample_idx"]) for r in samples.select(["prompt_id", "sample_idx"]).to_pylist()}
    assert len(keys) == 96 * 4
    manifest = store.load_manifest("generate", 0)
    assert manifest["rows_out"] == 96 * 4 and manifest["resumed_chunks"] >= staged
    assert not staging.exists()

    mtimes = {p: p.stat().st_mtime_ns for p in run.rglob("*.parquet")}
    seq = store.state.commits[("generate", 0)]
    again = groupforge_in_process(*args)
    assert again.returncode == 0 and "up to date" in again.stdout
    # the message names the commit (a long line may wrap)
    assert f"(commit {seq} in {run / COMMITS}," in " ".join(again.stdout.split())
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.parquet")} == mtimes
    row = next(r for r in commit_rows(run) if r["seq"] == seq)
    assert row["manifest"] == json.loads(json.dumps(manifest))
    assert RunStore(run).state.commits[("generate", 0)] == store.state.commits[("generate", 0)]  # no new commit

    shown = groupforge_in_process("inspect", run)
    assert shown.returncode == 0, shown.stderr
    assert "samples" in shown.stdout and "384" in shown.stdout


def test_generate_second_job_on_locked_run_exits_3(tmp_path, toy_dir):
    store = RunStore(tmp_path / "run")
    with store.lock():
        proc = groupforge("generate", "--model", toy_dir / "model", "--prompts", toy_dir / "eval.parquet",
                          "--out", tmp_path / "run", "--no-wait", "--backend", "hf")
    assert proc.returncode == 3, proc.stderr
    assert "locked" in error_line(proc).lower()


def test_generate_bad_sampling_flag_is_one_error_line_naming_the_flag(tmp_path, toy_dir):
    proc = groupforge_in_process("generate", "--model", toy_dir / "model", "--prompts", toy_dir / "eval.parquet",
                                 "--out", tmp_path / "run", "--backend", "hf", "-G", 0, "--top-p", 1.5)
    assert proc.returncode == 2, proc.stderr
    assert error_line(proc) == ("error: --group-size: group_size must be >= 1, got 0; "
                                "--top-p: top_p must be in (0, 1], got 1.5")
    assert not (tmp_path / "run").exists()


def test_inspect_stages_prints_the_stage_graph(tmp_path, toy_dir):
    from pipelines.reports import inspect_run as inspect_module

    if not hasattr(inspect_module, "print_stage_graph"):
        pytest.skip("pipelines.reports.inspect_run.print_stage_graph is not written yet")
    run = make_toy_run(toy_dir, tmp_path, "eval", n_prompts=4, group_size=2, max_tokens=4, rounds=(0,))
    shown = groupforge_in_process("inspect", run, "--stages")
    assert shown.returncode == 0, shown.stderr
    for word in ("generate", "score", "filter", "label", "pair", "samples", "rejects", "prompts file"):
        assert word in shown.stdout, word


@pytest.mark.parametrize("columns", ["200", "40"])
def test_tables_never_cut_numbers_on_a_narrow_stdout(columns):
    code = ("from pipelines.cli.app import show_table\n"
            "show_table('run', ['round', 'train tokens per second', 'generate tokens per second', 'stage'],"
            " [['12', '16,900', '1,234,567', 'score'], ['13', '17,001', '987', 'filter']], left=('stage',))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**ENV, "COLUMNS": columns}).stdout
    for number in ("16,900", "1,234,567", "17,001", "987", "score", "filter", "train tokens per second"):
        assert number in out
    assert "…" not in out
    assert ("┃" in out) == (columns == "200")  # a rich table where it fits, plain text where it does not
