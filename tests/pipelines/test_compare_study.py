"""The comparison study (pipelines/studies/study.py, pipelines/studies/study_report.py): the validation split, the
choice by validation, the statistics, the write-up, and one tiny `groupforge compare` on the toy."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.studies.compare_spec import load_compare, load_compare_section
from pipelines.studies.ratio_spread import pooled_spread
from pipelines.studies.study import Setting, grid, pick_setting, split_prompts, validation_ids, validation_score
from pipelines.studies.study_stats import (
    Interval,
    at,
    band,
    common_grid,
    interpolate,
    mean_ci,
    pooled_snr,
    seed_curves,
    step_bands,
    t_975,
)
from pipelines.studies.study_text import edge_note, lead_sentence, ranking_sentence, spread_sentence, tie_note
from store.run_files import MetricsLog
from store.storage import write_atomic
from tests.helpers import REPO, groupforge_in_process, parquet_sql

# ---------------------------------------------------------------------------------------------
# The validation split
# ---------------------------------------------------------------------------------------------

def _ids(path: Path) -> list[str]:
    from curation.generate.base import load_prompts

    return load_prompts(path).column("prompt_id").to_pylist()


def test_validation_split_is_deterministic_disjoint_and_never_the_eval_set(toy_dir, tmp_path):
    train, evals = pq.read_table(toy_dir / "train.parquet"), pq.read_table(toy_dir / "eval.parquet")
    # a train file that also holds 40 eval prompts: none of them may become validation
    mixed = pa.concat_tables([train.slice(0, 300), evals.slice(0, 40)])
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    pq.write_table(mixed.take(list(range(mixed.num_rows - 1, -1, -1))), tmp_path / "reversed.parquet")
    eval_file = str(toy_dir / "eval.parquet")

    first = split_prompts([str(tmp_path / "mixed.parquet")], eval_file, 60, tmp_path / "a")
    again = split_prompts([str(tmp_path / "reversed.parquet")], eval_file, 60, tmp_path / "b")
    held, kept, eval_ids = set(_ids(first.validation)), set(_ids(first.train)), set(_ids(toy_dir / "eval.parquet"))
    assert len(held) == 60 and len(kept) == 340 - 60
    assert held == set(_ids(again.validation))  # by a hash of the prompt, not by file order
    assert not held & kept and not held & eval_ids
    assert held != eval_ids and len(kept & eval_ids) == 40  # eval prompts in the train file stay train prompts
    assert first.record["validation_rows"] == 60 and first.record["train_rows"] == 280
    # the validation rows keep their references (they are evaluated)
    assert all(r for r in pq.read_table(first.validation).column("reference").to_pylist())

    before = first.validation.stat().st_mtime_ns
    kept_split = split_prompts([str(tmp_path / "mixed.parquet")], eval_file, 60, tmp_path / "a")
    assert kept_split.validation == first.validation
    assert first.validation.stat().st_mtime_ns == before  # the same split is kept, not rewritten
    with pytest.raises(ValueError, match="another validation_size"):
        split_prompts([str(tmp_path / "mixed.parquet")], eval_file, 61, tmp_path / "a")


def test_validation_ids_rank_by_hash_and_skip_the_excluded():
    import hashlib

    ids = [f"p{i}" for i in range(10)]
    ranked = sorted(ids, key=lambda i: hashlib.sha256(("groupforge-validation:" + i).encode()).hexdigest())
    assert validation_ids(ids, 3) == set(ranked[:3])
    assert validation_ids(reversed(ids), 3) == set(ranked[:3])
    assert validation_ids(ids, 3, exclude=[ranked[0]]) == set(ranked[1:4])
    with pytest.raises(ValueError, match="leave none to train on"):
        validation_ids(ids, 9, exclude=["p0"])


def test_grid_is_every_combination_in_order():
    settings = grid({"train.lr": [1e-4, 2e-4], "train.beta": [0.1, 0.3]})
    assert [s.values for s in settings] == [{"train.lr": lr, "train.beta": beta}
                                            for lr, beta in [(1e-4, 0.1), (1e-4, 0.3), (2e-4, 0.1), (2e-4, 0.3)]]
    assert settings[0].slug == "train.lr-0.0001_train.beta-0.1"
    assert settings[0].overrides == ["train.lr=0.0001", "train.beta=0.1"]
    assert Setting({}).label == "the spec's own" and grid({}) == [Setting({})]


# ---------------------------------------------------------------------------------------------
# Choosing by validation, never by eval
# ---------------------------------------------------------------------------------------------

def _finished_run(folder: Path, evaluated_on: Path, accuracies: list[float]) -> Path:
    """A run folder as the round loop leaves it, as far as the choice reads it: RUN/spec.toml
    (which file it evaluated on) and one round record per accuracy."""
    write_atomic(folder / "spec.toml", f'[prompts]\neval = "{evaluated_on}"\n')
    log = MetricsLog(folder)
    for round, accuracy in enumerate(accuracies):
        log.append({"event": "round", "round": round, "eval_accuracy": accuracy})
    return folder


def test_the_sweep_picks_by_validation_even_where_eval_would_pick_otherwise(tmp_path):
    validation, evals = tmp_path / "validation.parquet", tmp_path / "eval.parquet"
    # lr A is better on validation (mean of the last 3: 0.60 vs 0.52); B would win on eval
    # and has the best round 0, which no setting owes to its training
    sweep = {"A": _finished_run(tmp_path / "sweep-a", validation, [0.30, 0.40, 0.58, 0.60, 0.62]),
             "B": _finished_run(tmp_path / "sweep-b", validation, [0.90, 0.65, 0.55, 0.50, 0.51])}
    on_eval = {"A": _finished_run(tmp_path / "eval-a", evals, [0.30, 0.40, 0.41, 0.42, 0.40]),
               "B": _finished_run(tmp_path / "eval-b", evals, [0.30, 0.60, 0.61, 0.62, 0.63])}

    chosen, scores = pick_setting(sweep, validation, last=3)
    assert chosen == "A"
    assert scores == pytest.approx({"A": (0.58 + 0.60 + 0.62) / 3, "B": (0.55 + 0.50 + 0.51) / 3})
    assert pick_setting(on_eval, evals, last=3)[0] == "B"  # the eval set would have chosen otherwise
    with pytest.raises(ValueError, match="chosen by validation only"):
        pick_setting({"A": sweep["A"], "B": on_eval["B"]}, validation, last=3)


def test_validation_score_and_ties():
    rounds = [{"round": 0, "eval_accuracy": 0.9}, {"round": 1, "eval_accuracy": 0.2},
              {"round": 2, "eval_accuracy": None}, {"round": 3, "eval_accuracy": 0.4}]
    assert validation_score(rounds, last=3) == pytest.approx(0.3)  # round 0 and a round without eval left out
    assert validation_score(rounds[:1], last=3) is None


def test_ties_go_to_the_first_listed_setting(tmp_path):
    validation = tmp_path / "v.parquet"
    runs = {"first": _finished_run(tmp_path / "x", validation, [0.1, 0.5]),
            "second": _finished_run(tmp_path / "y", validation, [0.1, 0.5])}
    assert pick_setting(runs, validation, last=3)[0] == "first"


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------

def test_mean_ci_against_a_hand_computation():
    values = [0.60, 0.64, 0.71]
    mean = (0.60 + 0.64 + 0.71) / 3                                          # 0.65
    s = math.sqrt(((0.60 - mean) ** 2 + (0.64 - mean) ** 2 + (0.71 - mean) ** 2) / 2)  # sqrt(0.0031)
    half = 4.302653 * s / math.sqrt(3)                                       # t_{0.975, 2}
    iv = mean_ci(values)
    assert iv.mean == pytest.approx(0.65) and iv.half == pytest.approx(half)
    assert iv.half == pytest.approx(0.138311, rel=1e-5)
    assert (iv.low, iv.high, iv.n) == (pytest.approx(0.65 - half), pytest.approx(0.65 + half), 3)
    assert mean_ci([0.5]) == Interval(0.5, None, 1)
    assert mean_ci([0.4, 0.4, 0.4]).half == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("df, t", [(1, 12.706205), (2, 4.302653), (4, 2.776445), (9, 2.262157), (30, 2.042272),
                                   (31, 2.039513), (40, 2.021075), (60, 2.000298), (120, 1.979930)])
def test_t_quantiles(df, t):
    assert t_975(df) == pytest.approx(t, abs=2e-5)


def test_interpolation_and_the_common_grid():
    xs, ys = [0.0, 10.0, 30.0], [0.2, 0.4, 0.8]
    assert interpolate(xs, ys, 5) == pytest.approx(0.3)
    assert interpolate(xs, ys, 20) == pytest.approx(0.6)
    assert interpolate(xs, ys, 30) == pytest.approx(0.8) and interpolate(xs, ys, 0) == pytest.approx(0.2)
    assert interpolate(xs, ys, 31) is None and interpolate(xs, ys, -1) is None  # never extrapolated
    # the same x everywhere (samples, steps): those points; else evenly spaced where all are defined
    assert common_grid([[0, 8, 16], [0, 8, 16]]) == [0, 8, 16]
    assert common_grid([[1, 5, 9], [2, 6, 8]], points=4) == pytest.approx([2, 4, 6, 8])
    seed1, seed2 = ([1.0, 3.0], [0.2, 0.6]), ([2.0, 4.0], [0.4, 0.4])       # two seeds' accuracy vs wall seconds
    x, intervals = band([seed1, seed2], points=3)
    assert x == pytest.approx([2.0, 2.5, 3.0])
    assert [iv.mean for iv in intervals] == pytest.approx([0.4, 0.45, 0.5])
    assert intervals[2].half == pytest.approx(12.706205 * math.sqrt(0.02) / math.sqrt(2))  # values 0.6 and 0.4
    assert at([seed1, seed2], 1.5) is None  # seed 2 starts at 2 s


def test_gradient_snr_averages_signal_and_noise_before_the_ratio():
    steps = [{"step": 1, "grad_signal": 2.0, "grad_noise": 40.0, "rows": 10, "rounds": [1]},
             {"step": 2, "grad_signal": -1.0, "grad_noise": 20.0, "rows": 10, "rounds": [1]},
             {"step": 3, "grad_norm": 1.5, "rounds": [2]}]
    assert pooled_snr(steps) == pytest.approx(0.5 / 3.0)  # mean signal 0.5 / mean(noise / B) 3; not mean(2/4, 0)
    seed2 = [{"step": 1, "grad_signal": 4.0, "grad_noise": 20.0, "rows": 10, "rounds": [1], "clip_frac_low": 0.1,
              "clip_frac_high": 0.2}]
    bands = step_bands([steps, seed2])
    assert bands["grad_signal"][0] == [1.0, 2.0]
    assert bands["grad_signal"][1][0].mean == pytest.approx(3.0) and bands["grad_signal"][1][1].half is None
    assert bands["grad_snr"][0] == [1.0]  # per round: round 1's three steps of both seeds
    assert bands["grad_snr"][1][0].mean == pytest.approx((5.0 / 3) / ((4 + 2 + 2) / 3))
    assert bands["clip_frac"][1][0].mean == pytest.approx(0.3) and "zero_adv_frac" not in bands


# ---------------------------------------------------------------------------------------------
# The write-up
# ---------------------------------------------------------------------------------------------

def test_lead_sentence_when_the_intervals_overlap():
    text = lead_sentence("At equal samples (100 per run)", {"grpo": Interval(0.66, 0.04, 3),
                                                           "gspo": Interval(0.70, 0.05, 3)})
    assert text == ("At equal samples (100 per run), gspo led with 70.0% (95% CI 65.0–75.0), 4.0 points above grpo "
                    "(66.0%, 95% CI 62.0–70.0). Its interval overlaps that of grpo: not distinguishable at this "
                    "number of seeds (3).")


def test_lead_sentence_for_a_clear_lead():
    text = lead_sentence("At equal steps (40)", {"a": Interval(0.80, 0.02, 5), "b": Interval(0.70, 0.03, 5),
                                                "c": Interval(0.60, 0.05, 5)})
    assert text == ("At equal steps (40), a led with 80.0% (95% CI 78.0–82.0), 10.0 points above b (70.0%, 95% CI "
                    "67.0–73.0). The intervals do not overlap: a clear lead over every other objective at 5 seeds.")


def test_lead_sentence_names_a_wide_interval_below_the_runner_up():
    text = lead_sentence("Here", {"a": Interval(0.80, 0.02, 3), "b": Interval(0.75, 0.01, 3),
                                  "c": Interval(0.70, 0.15, 3)})
    assert text.endswith("Its interval overlaps that of c: not distinguishable at this number of seeds (3).")
    assert lead_sentence("Here", {"a": Interval(0.5, 0.1, 3), "b": None}) == \
        "Here: only a has a value, 50.0% (95% CI 40.0–60.0)."


def test_ranking_and_edge_notes():
    assert ranking_sentence({"equal samples": "sft", "equal wall time": "sft"}) == \
        "The same objective, sft, has the highest mean on every axis (equal samples, equal wall time)."
    assert ranking_sentence({"equal samples": "sft", "equal steps": "grpo"}) == \
        "The objective with the highest mean depends on the axis: equal samples: sft; equal steps: grpo."
    assert "largest train.lr" in edge_note("grpo", [1e-4, 2e-4, 5e-4], 5e-4, "train.lr")
    assert edge_note("grpo", [1e-4, 2e-4, 5e-4], 2e-4, "train.lr") is None
    assert edge_note("grpo", [1e-4, 2e-4], 2e-4, "train.lr") is None  # two values: every choice is an edge
    assert tie_note("pairwise", {"beta=0.05": 0.34, "beta=0.1": 0.34, "beta=0.3": 0.2}, "beta=0.05") == (
        "pairwise: beta=0.1 tied with beta=0.05 on validation (34.0%); the first listed was kept, so the sweep did "
        "not tell these settings apart.")
    assert tie_note("pairwise", {"beta=0.05": 0.35, "beta=0.1": 0.34}, "beta=0.05") is None


def test_the_wall_curve_starts_at_zero_with_the_start_model():
    rounds = [{"round": 0, "eval_accuracy": 0.3, "elapsed_seconds": 4.0, "samples_total": 0, "policy_version": 0},
              {"round": 1, "eval_accuracy": None, "elapsed_seconds": 9.0, "samples_total": 64, "policy_version": 2},
              {"round": 2, "eval_accuracy": 0.5, "elapsed_seconds": 14.0, "samples_total": 128, "policy_version": 4}]
    curves = seed_curves(rounds)
    assert curves["seconds"] == ([0.0, 4.0, 14.0], [0.3, 0.3, 0.5])
    assert curves["samples"] == ([0.0, 128.0], [0.3, 0.5]) and curves["steps"] == ([0.0, 4.0], [0.3, 0.5])


# ---------------------------------------------------------------------------------------------
# The compare file
# ---------------------------------------------------------------------------------------------

def test_the_shipped_compare_file_is_a_study_with_a_quick_one(toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    path = REPO / "pipelines/specs/compare.toml"
    full, quick = load_compare_section(path), load_compare_section(path, quick=True)
    assert full.study and len(full.seeds) >= 3 and full.sweep_rounds < full.rounds
    assert set(full.sweep) == {"toy-grpo", "toy-gspo", "toy-pairwise", "toy-sft"}
    assert quick.out == "runs/compare-quick" and quick.rounds < full.rounds and len(quick.seeds) >= 3
    assert all(len(grid(g)) == 2 for g in quick.sweep.values())
    specs, out = load_compare([path], quick=True)
    assert {s.prompts.per_round for s in specs.values()} == {64} and out == Path("runs/compare-quick")


@pytest.mark.parametrize("text, error", [
    ('sweep = {"toy-grpo" = {"train.lr" = [1e-4]}}', "sweep needs seeds"),
    ('seeds = [0, 1, 2]\nsweep = {"toy-grpo" = {"train.lr" = [1e-4]}}', "sweep needs sweep_rounds"),
    ("seeds = [0, 1]", "at least 3"),
    ("seeds = [0, 1, 1]", "listed twice"),
    ('seeds = [0, 1, 2]\nsweep_rounds = 1\nsweep = {"toy-grpo" = {"lr" = [1e-4]}}', "not a section.key"),
    ("seeds = [0, 1, 2]\nunknown = 1", "compare.unknown"),
])
def test_bad_compare_files_are_refused(tmp_path, text, error):
    path = tmp_path / "c.toml"
    path.write_text(f'[compare]\nspecs = ["a.toml", "b.toml"]\n{text}\n')
    with pytest.raises(ValueError, match=error):
        load_compare_section(path)


def test_a_sweep_that_changes_the_sample_budget_is_refused_before_any_run(toy_dir, tmp_path, monkeypatch):
    from pipelines.studies.study import run_study

    monkeypatch.chdir(REPO)
    path = tmp_path / "compare.toml"
    tiny = TINY.format(out=tmp_path / "study")
    path.write_text(tiny + '[compare.sweep."toy-gspo"]\n"prompts.per_round" = [8, 16]\n')
    with pytest.raises(ValueError, match=r"compare.sweep: toy-gspo is no spec's run.name \(toy-grpo, toy-sft\)"):
        run_study(load_compare_section(path), tmp_path / "study")
    path.write_text(tiny.replace("toy-sft", "toy-gspo") + '"prompts.per_round" = [8, 16]\n')
    # per_round = 8 is the budget every run has (the overrides); 16 is not
    with pytest.raises(ValueError, match=r"toy-gspo with train.lr=0.0001, prompts.per_round=16 differs from "
                                         r"toy-grpo in prompts.per_round"):
        run_study(load_compare_section(path), tmp_path / "study")
    assert not (tmp_path / "study" / "sweep").exists() and not (tmp_path / "study" / "final").exists()


def test_a_run_folder_made_from_another_spec_is_refused(toy_dir, tmp_path, monkeypatch):
    from pipelines.spec import load_spec, resolved_toml
    from pipelines.studies.study import RunPlan, finished

    monkeypatch.chdir(REPO)
    spec = load_spec(REPO / "pipelines/specs/toy-grpo.toml")
    plan = RunPlan("final toy-grpo seed 0", spec, tmp_path / "run")
    assert not finished(plan)
    write_atomic(tmp_path / "run" / "spec.toml", resolved_toml(spec))
    MetricsLog(tmp_path / "run").append({"event": "round", "round": spec.run.rounds, "eval_accuracy": 0.5})
    assert finished(plan)
    other = load_spec(REPO / "pipelines/specs/toy-grpo.toml", overrides=["train.lr=0.001"])
    with pytest.raises(ValueError, match="made from another spec"):
        finished(RunPlan("final toy-grpo seed 0", other, tmp_path / "run"))


def _bucket(round, lo, hi, samples, tokens, token_std, within, seq_std, token_clip=0.0, seq_clip=0.0):
    return {"round": round, "length_lo": lo, "length_hi": hi, "samples": samples, "tokens": tokens,
            "token_ratio_std": token_std, "token_ratio_within_std": within, "seq_ratio_std": seq_std,
            "token_clip_frac": token_clip, "seq_clip_frac": seq_clip}


def test_ratio_spread_pools_rounds_by_bucket_with_token_and_sample_weights():
    rows = [_bucket(10, 2, 3, 30, 90, 0.10, 0.05, 0.04, 0.2, 0.5),
            _bucket(20, 2, 3, 10, 20, 0.20, 0.07, 0.08, 0.4, 1.0),
            _bucket(20, 4, None, 25, 125, 0.06, 0.03, 0.02)]
    pooled = pooled_spread(rows)
    assert [(b["length_lo"], b["length_hi"], b["samples"], b["tokens"], b["rounds"]) for b in pooled] == \
        [(2, 3, 40, 110, [10, 20]), (4, None, 25, 125, [20])]
    short = pooled[0]
    assert short["mean_length"] == pytest.approx(110 / 40)
    assert short["token_ratio_std"] == pytest.approx((0.10 * 90 + 0.20 * 20) / 110)  # by tokens
    assert short["token_clip_frac"] == pytest.approx((0.2 * 90 + 0.4 * 20) / 110)
    assert short["seq_ratio_std"] == pytest.approx((0.04 * 30 + 0.08 * 10) / 40)  # by samples
    assert short["token_ratio_within_std"] == pytest.approx((0.05 * 30 + 0.07 * 10) / 40)
    assert short["seq_clip_frac"] == pytest.approx((0.5 * 30 + 1.0 * 10) / 40)


def test_ratio_spread_sentences():
    pooled = pooled_spread([_bucket(1, 2, 3, 40, 100, 0.10, 0.05, 0.05), _bucket(1, 4, 7, 50, 250, 0.15, 0.06, 0.03),
                            _bucket(1, 8, None, 5, 45, 0.90, 0.5, 0.8)])  # 5 samples: left out
    assert spread_sentence("grpo", pooled) == (
        "grpo: the sequence ratios' std was 0.030-0.050 against the token ratios' 0.100-0.150 (mean response "
        "lengths 2.5-5.0 tokens); lower in 2 of 2 length buckets. From the shortest to the longest bucket the "
        "token spread rose and the sequence spread fell.")
    assert spread_sentence("gspo", pooled[2:]) == "gspo: too few samples per length bucket to read the ratio spread."
    assert spread_sentence("sft", pooled[1:]) == (
        "sft: the sequence ratios' std was 0.030 against the token ratios' 0.150 (mean response lengths 5.0 "
        "tokens); lower in 1 of 1 length bucket.")


# ---------------------------------------------------------------------------------------------
# End to end: `groupforge compare` on the toy
# ---------------------------------------------------------------------------------------------

TINY = """
[compare]
specs = ["pipelines/specs/toy-grpo.toml", "pipelines/specs/toy-sft.toml"]
out = "{out}"
rounds = 2
seeds = [0, 1, 2]
validation_size = 16
sweep_rounds = 2
overrides = ["prompts.per_round=8", "generator.group_size=4", "prompts.eval_limit=24", "eval.every=1",
             "train.grad_noise=true", "train.token_budget=256", "train.batch_size=32", "run.checkpoint_every=5"]
[compare.sweep."toy-grpo"]
"train.lr" = [1e-4, 1e-3]
[compare.sweep."toy-sft"]
"train.lr" = [1e-4, 1e-3]
"""


def _md_rows(markdown: str, column: str) -> list[dict[str, str]]:
    """The rows of the markdown table that has `column`, as {header: cell}."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and f"| {column} |" in line)
    headers = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(headers, [c.strip() for c in line.strip("|").split("|")])))
    return rows


@pytest.mark.slow
def test_compare_runs_a_tiny_study_and_a_rerun_skips_every_run(toy_dir, tmp_path):
    compare_file = tmp_path / "compare.toml"
    out = tmp_path / "study"
    compare_file.write_text(TINY.format(out=out))
    done = groupforge_in_process("compare", compare_file)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]

    markdown = (out / "report" / "compare.md").read_text()
    for heading in ("## Sweep (validation split)", "## Final runs (eval set)", "## What this shows",
                    "## What it does not show", "**Equal axis: generated samples**"):
        assert heading in markdown
    assert (out / "report" / "compare.png").stat().st_size > 0 and (out / "report" / "measurements.png").is_file()

    # the chosen setting is the argmax of the validation scores, read here from the sweep runs
    study = json.loads((out / "study.json").read_text())
    sweep_rows = _md_rows(markdown, "validation score (%)")
    for name in ("toy-grpo", "toy-sft"):
        scores = {}
        for lr in ("0.0001", "0.001"):
            run = out / "sweep" / name / f"train.lr-{lr}"
            assert f'eval = "{out / "data" / "validation.parquet"}"' in (run / "spec.toml").read_text()
            accs = [r["eval_accuracy"] for r in MetricsLog(run).rounds() if r["round"] >= 1]
            assert len(accs) == 2  # sweep_rounds, every round evaluated
            scores[lr] = sum(accs[-3:]) / len(accs[-3:])
        best = max(scores, key=scores.__getitem__)  # first listed among ties, as the study does
        assert study["objectives"][name]["chosen"] == {"train.lr": float(best)}
        chosen_rows = [r for r in sweep_rows if r["objective"] == name and r["choice"] == "**chosen**"]
        assert [r["setting"] for r in chosen_rows] == [f"train.lr={best}"]
        assert {r["validation score (%)"] for r in sweep_rows if r["objective"] == name} == \
            {f"{100 * s:.1f}" for s in scores.values()}

    # final runs: 3 seeds each, trained without the validation prompts, evaluated on the eval set
    validation = set(_ids(out / "data" / "validation.parquet"))
    for name in ("toy-grpo", "toy-sft"):
        for seed in (0, 1, 2):
            run = out / "final" / name / f"seed-{seed}"
            spec = (run / "spec.toml").read_text()
            assert 'eval = "runs/toy/eval.parquet"' in spec and f"seed = {seed}" in spec
            assert f'train = ["{out / "data" / "train.parquet"}"]' in spec
            sampled = {row[0] for row in duckdb.sql(
                f"SELECT DISTINCT prompt_id FROM {parquet_sql(run, 'samples')}").fetchall()}
            assert sampled and not sampled & validation
    final_rows = {r["objective"]: r for r in _md_rows(markdown, "final eval acc (%)")}
    assert set(final_rows) == {"toy-grpo", "toy-sft"}
    for name, row in final_rows.items():
        finals = [MetricsLog(out / "final" / name / f"seed-{s}").rounds()[-1]["eval_accuracy"] for s in (0, 1, 2)]
        expected = mean_ci(finals)
        assert row["final eval acc (%)"] == f"{100 * expected.mean:.1f} ± {100 * expected.half:.1f}"
        assert row["setting"] == study["objectives"][name]["chosen_label"]
    assert re.search(r"At equal samples \(64 per run: 2 rounds x 8 prompts x 4\), toy-(grpo|sft) (led|and)", markdown)

    # the ratio spread of the grpo run (sft weighs no ratios): round 2, the one its checkpoint trained on
    spread_rows = _md_rows(markdown, "sequence ratio std")
    assert {r["objective"] for r in spread_rows} == {"toy-grpo"}
    assert sum(int(r["samples"]) for r in spread_rows) == 8 * 4
    assert (out / "report" / "ratio_spread.png").stat().st_size > 0 and "\n- toy-grpo: " in markdown

    # a rerun skips every finished run and writes the same tables
    again = groupforge_in_process("compare", compare_file)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished, skipped") == 4 + 6
    assert (out / "report" / "compare.md").read_text() == markdown
