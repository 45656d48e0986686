"""The round loop with `[prompts] curriculum` and `[run] keep_best` on the toy (transformers
generator): SIGKILLed mid-run and resumed, it chooses every round's prompts as a run nobody
killed, commits the same prompt_stats table (which an independent DuckDB count of its scores
tables gives), and keeps the checkpoint of its best evaluated round, which loads and answers
the eval prompts with the recorded accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import duckdb
import pyarrow.parquet as pq

from curation.generate.stage import make_generator
from curation.rewards.registry import get_reward
from pipelines.loop.run import run_pipeline
from pipelines.loop.steps import eval_set
from pipelines.spec import load_spec
from store.faults import FAULT_ENV
from store.run_store import RunStore
from tests.helpers import FAULTS_SPEC, PROMPT_STATS_SQL, REPO, check_tables, groupforge_in_process, round_records

REST_ROUNDS, SOLVED = 2, 0.5  # the toy with 6 tokens passes at most half of a prompt's 4 samples here
SPEC = (FAULTS_SPEC.replace("rounds = 2", "rounds = 4")
        .replace("seed = 3", "seed = 3\nkeep_best = true\ncheckpoint_every = 2")
        .replace("per_round = 16", "per_round = 16\ncurriculum = true")
        + f"keep_last = 1\n\n[prompts.choice]\nrest_rounds = {REST_ROUNDS}\nsolved = {SOLVED}\n\n[eval]\nevery = 2\n")
"""4 rounds of 16 prompts from a pool of 40 (it goes round in 2.5 rounds), solved prompts
(pass rate >= 0.5) resting 2 rounds; eval and a checkpoint in rounds 2 and 4, one checkpoint kept besides the best."""


def _run(spec, run_dir, env=None):
    """`groupforge run`: in this process, or with `env` (a fault point that kills it) in a child."""
    if env is None:
        return groupforge_in_process("run", spec, "--run-dir", run_dir)
    cmd = [sys.executable, "-m", "pipelines.cli", "run", str(spec), "--run-dir", str(run_dir)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def _choices(run_dir, rounds):
    return [pq.read_table(run_dir / "_rounds" / f"round={n}" / "prompts.parquet").column("prompt_id").to_pylist()
            for n in rounds]


def test_a_killed_curriculum_run_chooses_as_an_unkilled_one_and_keeps_its_best(toy_dir, tmp_path):
    train = tmp_path / "train.parquet"
    pq.write_table(pq.read_table(toy_dir / "train.parquet").slice(0, 40), train)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(toy=toy_dir, train=f'"{train}"'))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_pipeline(spec, whole, log=lambda message: None, report=True)

    # Killed after round 3's curation: its prompt_stats rows are not committed; the rerun builds
    # the history again from the tables and chooses round 4 from it.
    crash = _run(spec, killed, env={FAULT_ENV: "loop.after_curate:3"})
    assert crash.returncode == -9, crash.stderr[-2000:]
    assert [r["round"] for r in round_records(killed)] == [0, 1, 2]
    assert RunStore(killed).rounds("prompt_stats") == [1, 2] and RunStore(killed).rounds("scores") == [1, 2, 3]
    done = _run(spec, killed)
    assert done.returncode == 0, done.stderr[-2000:]

    assert _choices(killed, range(1, 5)) == _choices(whole, range(1, 5))
    stats = {run: RunStore(run).read("prompt_stats") for run in (whole, killed)}
    assert stats[killed].equals(stats[whole]) and stats[whole].num_rows == 4 * 16
    for run in (whole, killed):
        check_tables(run)
        scores = RunStore(run).read("scores")  # noqa: F841 (read by the SQL)
        got = stats[run].select(["prompt_id", "round", "rounds_seen", "samples", "passes", "recent_samples",
                                 "recent_passes"]).to_pylist()
        assert [tuple(row.values()) for row in got] == duckdb.sql(PROMPT_STATS_SQL).fetchall()

    # The rule held: a chosen prompt rested only when the prompts not resting ran short.
    history = stats[whole]  # noqa: F841 (read by the SQL)
    rested_sql = """
        SELECT prompt_id FROM history WHERE round < $n
        QUALIFY row_number() OVER (PARTITION BY prompt_id ORDER BY round DESC) = 1
            AND pass_rate >= $solved AND $n - round <= $rest"""
    rested_any = False
    for n, picked in zip(range(2, 5), _choices(whole, range(2, 5))):
        params = {"n": n, "rest": REST_ROUNDS, "solved": SOLVED}
        rested = {row[0] for row in duckdb.sql(rested_sql, params=params).fetchall()}
        rested_any |= bool(rested)
        assert len(set(picked) & rested) <= max(0, 16 - (40 - len(rested)))
    assert rested_any  # the rule had work to do

    # keep_best: the earliest round of the best eval accuracy, the same in both runs, kept by
    # keep_last = 1, named in the summary and the CLI's last lines; it loads and answers as recorded.
    records = {r["round"]: r for r in round_records(whole)}
    assert [n for n in records if records[n]["eval_accuracy"] is not None] == [0, 2, 4]
    best_round = max((2, 4), key=lambda n: (records[n]["eval_accuracy"], -n))
    best = json.loads((whole / "checkpoints" / "best.json").read_text())
    assert best == json.loads((killed / "checkpoints" / "best.json").read_text())
    assert best == {"round": best_round, "policy_version": records[best_round]["policy_version"],
                    "eval_accuracy": records[best_round]["eval_accuracy"],
                    "checkpoint": f"checkpoints/step-{records[best_round]['policy_version']}"}
    assert f"**Best checkpoint** (`[run] keep_best`): round {best_round}," in \
        (whole / "report" / "summary.md").read_text()
    assert f"best checkpoint: round {best_round}, eval accuracy" in done.stdout
    resumed = round_records(killed)  # the CLI's last line: accuracy, time and the process's peak RSS of its rounds
    peak = max(r["peak_rss_mib"] for r in resumed)
    assert f"points) in {resumed[-1]['elapsed_seconds']:.0f} s; peak RSS {peak / 1024:.1f} GiB" in done.stdout
    loaded = load_spec(spec)
    generator = make_generator("hf", whole / best["checkpoint"])
    prompts = eval_set(loaded, generator)
    responses = generator.greedy(prompts.token_ids, loaded.generator.max_tokens)
    values = get_reward(loaded.eval.metric)(prompts.prompts, responses, **prompts.columns)
    assert sum(values) / len(values) == best["eval_accuracy"]
