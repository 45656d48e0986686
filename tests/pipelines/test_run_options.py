"""The round loop's options on the real toy (transformers backend, small rounds): eval every K,
checkpoint every K with a replay after a restart, refill (DAPO dynamic sampling, resumed
after kill -9), the per-phase seconds of every round, and output that never cuts numbers."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import duckdb
import pyarrow.parquet as pq
import pytest

from pipelines.loop.refill import refill_size
from pipelines.loop.run import run_pipeline
from pipelines.reports.run_report import report_run
from pipelines.spec import load_spec
from store.faults import FAULT_ENV
from store.run_files import PHASES, MetricsLog
from store.run_store import RunStore
from tests.helpers import OPTIONS_SPEC, REPO, groupforge_in_process, logged_files, parquet_sql
from training import checkpoint as ckpt


def _spec(tmp_path, toy_dir, rounds=5, checkpoint_every=1, eval_every=1, refill=""):
    path = tmp_path / "spec.toml"
    path.write_text(OPTIONS_SPEC.format(toy=toy_dir, rounds=rounds, checkpoint_every=checkpoint_every,
                                eval_every=eval_every, refill=refill))
    return path


def _steps(run_dir):
    return {s["step"]: s for s in MetricsLog(run_dir).steps()}


class Stop(Exception):
    pass


def test_eval_every_checkpoint_every_replay_and_the_breakdown(tmp_path, toy_dir):
    spec = load_spec(_spec(tmp_path, toy_dir, rounds=5, checkpoint_every=2, eval_every=2))
    run_dir = tmp_path / "run"

    def stop_after_round_3(record):
        if record["round"] == 3:
            raise Stop  # a restart after round 3, whose weights (steps 5-6) no checkpoint holds

    with pytest.raises(Stop):
        run_pipeline(spec, run_dir, log=lambda msg: None, on_round=stop_after_round_3)
    assert ckpt.checkpoint_steps(run_dir) == [4]
    before = _steps(run_dir)
    assert sorted(before) == [1, 2, 3, 4, 5, 6]

    logged = []
    records = run_pipeline(spec, run_dir, log=logged.append)
    assert any("replaying round 3" in line for line in logged)
    after = _steps(run_dir)
    assert sorted(after) == list(range(1, 11))  # each step once
    for step in (5, 6):  # replayed from checkpoint 4: the same rows and weights, the same loss
        assert after[step]["loss"] == before[step]["loss"] and after[step]["grad_norm"] == before[step]["grad_norm"]

    # eval in rounds 0, 2, 4 and the last (5); checkpoints after rounds 2, 4 and the last
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["eval_accuracy"] is not None for r in records] == [True, False, True, False, True, True]
    assert [r["policy_version"] for r in records] == [0, 2, 4, 6, 8, 10]
    assert ckpt.checkpoint_steps(run_dir) == [4, 8, 10]

    # every record says where its time went: the phases sum to the wall seconds
    for r in records:
        assert set(r["phase_seconds"]) == set(PHASES)
        assert sum(r["phase_seconds"].values()) == pytest.approx(r["wall_seconds"], abs=0.02)
        assert 0 < r["model_seconds"] <= r["wall_seconds"]
    assert records[0]["phase_seconds"]["startup"] > 0 and records[0]["phase_seconds"]["eval"] > 0
    for r in records[1:]:
        assert r["phase_seconds"]["generate"] > 0 and r["phase_seconds"]["train"] > 0
        assert r["phase_seconds"]["score"] > 0
        assert r["phase_seconds"]["pair"] == 0 and r["pairs"] is None  # grpo trains on groups: no pair stage
        assert (r["phase_seconds"]["eval"] > 0) == (r["eval_accuracy"] is not None)
    assert records[4]["phase_seconds"]["checkpoint"] > 0 and records[3]["phase_seconds"]["checkpoint"] == 0

    summary = (report_run(run_dir) / "summary.md").read_text()
    assert "## Time" in summary and "| model work |" in summary
    round_1 = next(line for line in summary.splitlines() if line.startswith("| 1 |"))
    assert round_1.split(" | ")[1] == "—"  # no eval in round 1


def test_decay_rounds_holds_the_cosine_floor_after_that_round(tmp_path, toy_dir):
    """[run] decay_rounds = 2 of 4 rounds (2 steps each): the lr falls along the cosine to
    min_lr_ratio x lr by step 4 and stays there; a run shorter than decay_rounds decays over
    all of its rounds, as without the option."""
    import math

    from pipelines.loop.steps import cosine_horizon

    lr, floor = 1e-4, 0.1
    cosine = ["train.lr_schedule=cosine", f"train.min_lr_ratio={floor}", "run.decay_rounds=2"]
    spec = load_spec(_spec(tmp_path, toy_dir, rounds=4, eval_every=4), overrides=cosine)
    run_pipeline(spec, tmp_path / "run", log=lambda msg: None)
    got = {step: record["lr"] for step, record in _steps(tmp_path / "run").items()}
    want = {step: lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, 4) / 4)))
            for step in range(1, 9)}
    assert got == pytest.approx(want, rel=1e-9)
    assert got[4] == got[8] == pytest.approx(lr * floor)

    assert cosine_horizon(spec, 4) == 4  # 2 rounds x 2 steps
    assert cosine_horizon(spec, 1) == 2  # a 1-round run decays over its own round
    assert cosine_horizon(load_spec(_spec(tmp_path, toy_dir), overrides=["train.decay_steps=7"]), 4) == 7


def test_the_loop_pairs_every_round_when_asked_and_groupforge_pair_does_it_afterwards(tmp_path, toy_dir):
    spec_file = _spec(tmp_path, toy_dir, rounds=2)
    every = run_pipeline(load_spec(spec_file, overrides=["run.pairs=every_round"]), tmp_path / "every",
                         log=lambda msg: None)
    store = RunStore(tmp_path / "every")
    for r in every[1:]:
        assert r["phase_seconds"]["pair"] > 0 and r["pairs"] == store.read("pairs", r["round"]).num_rows > 0

    auto = run_pipeline(load_spec(spec_file), tmp_path / "auto", log=lambda msg: None)
    assert [r["pairs"] for r in auto[1:]] == [None, None] and not (tmp_path / "auto" / "pairs").exists()
    done = groupforge_in_process("pair", tmp_path / "auto")
    assert done.returncode == 0, done.stderr
    later = RunStore(tmp_path / "auto")
    assert later.rounds("pairs") == [1, 2]
    assert later.read("pairs").equals(store.read("pairs"))  # same seed, same samples: the same pairs


def test_refill_samples_more_prompts_and_resumes_after_kill(tmp_path, toy_dir):
    # More kept groups than 16 prompts can give: refill twice, at most 12 extra prompts.
    spec = _spec(tmp_path, toy_dir, rounds=1, refill="refill = {min_kept_groups = 40, max_extra_prompts = 12, "
                                                       "max_calls = 2}")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipelines.cli", "run", str(spec), "--run-dir", str(run_dir)]
    env = {**os.environ, "COLUMNS": "60"}  # a narrow, non-terminal stdout
    crash = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**env, FAULT_ENV: "train.step_logged:1"})  # killed in round 1's training
    assert crash.returncode == -9, crash.stderr[-2000:]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]

    (record,) = [r for r in MetricsLog(run_dir).rounds() if r["round"] == 1]
    refills = sorted(p.name for p in (run_dir / "_rounds" / "round=1").glob("refill-*.parquet"))
    extra = sum(pq.read_metadata(run_dir / "_rounds" / "round=1" / name).num_rows for name in refills)
    assert refills and len(refills) <= 2 and 0 < extra <= 12 and record["refill_prompts"] == extra
    assert record["samples"] == (16 + extra) * 4
    parts = sorted(re.fullmatch(r"part-(.+)-[0-9a-f]{16}\.parquet", p.name)[1]
                   for p in logged_files(run_dir, "samples", [1]))
    assert parts == ["generate"] + [name.removesuffix(".parquet") for name in refills]
    glob = lambda t: parquet_sql(run_dir, t, [1])  # noqa: E731
    counts = duckdb.sql(f"SELECT count(*), count(DISTINCT prompt_id), count(DISTINCT (prompt_id, sample_idx)) "
                        f"FROM {glob('samples')}").fetchall()[0]
    assert counts == (record["samples"], 16 + extra, record["samples"])  # no prompt sampled twice, no row twice
    labelled = duckdb.sql(f"SELECT count(*) FROM {glob('groups')}").fetchall()[0][0]
    rejected = duckdb.sql(f"SELECT count(*) FROM {glob('rejects')} WHERE stage = 'filter'").fetchall()
    assert labelled + rejected[0][0] == record["samples"]  # the refilled samples were curated too
    assert record["kept_groups"] == duckdb.sql(f"SELECT count(DISTINCT prompt_id) FROM {glob('groups')} "
                                               "WHERE group_kept").fetchall()[0][0]

    # Narrow stdout: plain text, every number whole; one breakdown line per round.
    for r in MetricsLog(run_dir).rounds():
        assert f"{r['gen_tokens_per_s']:,.0f}" in done.stdout and f"{r['train_tokens_per_s']:,.0f}" in done.stdout
    assert "…" not in done.stdout
    assert done.stdout.count("model work") == 1  # the round finished by this process
    assert RunStore(run_dir).load_manifest("refill-1", 1)["rows_in"] > 0


def test_refill_size_divides_the_missing_groups_by_the_kept_rate():
    assert refill_size(missing=10, kept=20, sampled=64, budget=100) == 32
    assert refill_size(missing=10, kept=20, sampled=64, budget=16) == 16  # bounded by the budget
    assert refill_size(missing=5, kept=0, sampled=64, budget=40) == 40  # nothing kept yet: the whole budget
    assert refill_size(missing=1, kept=64, sampled=64, budget=40) == 1


def test_a_refresh_picks_up_a_new_partition_and_appends_a_dataset_version(tmp_path, toy_dir):
    """Two `groupforge run` invocations of a spec whose train prompts are a partition glob and
    whose [export] append_to is a Delta table: the second (--rounds +1) finds the partition
    added in between, samples its prompts first, and appends only its new round, as version 1
    of the table, whose provenance names the new partition."""
    from deltalake import DeltaTable

    from curation.generate.base import load_prompts

    train = pq.read_table(toy_dir / "train.parquet")
    for day, start in (("2031-01-05", 0), ("2031-01-06", 40)):
        (tmp_path / "prompts" / f"date={day}").mkdir(parents=True)
        pq.write_table(train.slice(start, 40), tmp_path / "prompts" / f"date={day}" / "part-0.parquet")
    text = _spec(tmp_path, toy_dir, rounds=1).read_text()
    text = text.replace(f'train = ["{toy_dir}/train.parquet"]', f'train = ["{tmp_path}/prompts/date=*/"]')
    spec = tmp_path / "refresh.toml"
    spec.write_text(text + f'\n[export]\nappend_to = "{tmp_path}/pairs"\n')
    run_dir = tmp_path / "run"
    first = run_pipeline(load_spec(spec), run_dir, log=lambda msg: None)
    assert first[-1]["pairs"] > 0  # the loop pairs: the spec appends preference pairs

    later = tmp_path / "prompts" / "date=2031-01-07" / "part-0.parquet"
    later.parent.mkdir()
    pq.write_table(train.slice(80, 16), later)
    run_pipeline(load_spec(spec), run_dir, extra_rounds=1, log=lambda msg: None)
    round_2 = set(pq.read_table(run_dir / "_rounds" / "round=2" / "prompts.parquet").column("prompt_id").to_pylist())
    assert round_2 == set(load_prompts(later).column("prompt_id").to_pylist())  # the 16 new prompts first

    table = DeltaTable(str(tmp_path / "pairs"))
    assert table.version() == 1
    history = {h["version"]: h["groupforge"] for h in table.history()}
    assert [history[0]["rounds"], history[1]["rounds"]] == [[1], [2]]
    assert history[1]["prompt_files"][-1] == str(later) and len(history[0]["prompt_files"]) == 2
    assert history[1]["spec_sha256"] == hashlib.sha256((run_dir / "spec.toml").read_bytes()).hexdigest()
    rounds = table.to_pyarrow_table().column("round").to_pylist()
    assert set(rounds) == {1, 2} and rounds.count(2) == MetricsLog(run_dir).round_record(2)["pairs"]
    run_pipeline(load_spec(spec), run_dir, log=lambda msg: None)  # a rerun: nothing new to append
    assert DeltaTable(str(tmp_path / "pairs")).version() == 1
