"""`groupforge tune` (pipelines/studies/tune.py, pipelines/studies/spec_text.py): the seeded
validation split, the ranking by plateau, the budget, the spec edited as text, and the command
end to end on the toy."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.generate.base import load_prompts
from pipelines.spec import load_spec
from pipelines.studies.spec_text import format_float, put_comment_block, set_key
from pipelines.studies.study import split_prompts
from pipelines.studies.tune import (
    OVERRUN,
    Budget,
    Trial,
    default_lrs,
    fit_rounds,
    parse_lrs,
    rank,
    validation_size,
)
from store.run_files import MetricsLog
from tests.helpers import REPO, cli, error_line
from tests.helpers import groupforge_in_process as groupforge

TOY_GRPO = REPO / "pipelines" / "specs" / "toy-grpo.toml"


def _ids(path: Path) -> set[str]:
    return set(load_prompts(path).column("prompt_id").to_pylist())


# ---------------------------------------------------------------------------------------------
# The split
# ---------------------------------------------------------------------------------------------

def test_seeded_split_is_disjoint_deterministic_and_of_the_asked_size(toy_dir, tmp_path):
    train_file, eval_file = str(toy_dir / "train.parquet"), str(toy_dir / "eval.parquet")
    train = pq.read_table(train_file).slice(0, 500)
    pq.write_table(train, tmp_path / "train.parquet")
    pq.write_table(train.take(list(range(499, -1, -1))), tmp_path / "reversed.parquet")

    first = split_prompts([str(tmp_path / "train.parquet")], eval_file, 64, tmp_path / "a", seed=3)
    again = split_prompts([str(tmp_path / "reversed.parquet")], eval_file, 64, tmp_path / "b", seed=3)
    other = split_prompts([str(tmp_path / "train.parquet")], eval_file, 64, tmp_path / "c", seed=4)
    unseeded = split_prompts([str(tmp_path / "train.parquet")], eval_file, 64, tmp_path / "d")
    held, kept = _ids(first.validation), _ids(first.train)
    assert len(held) == 64 and len(kept) == 500 - 64 and not held & kept
    assert held | kept == _ids(tmp_path / "train.parquet") and not held & _ids(eval_file)
    assert held == _ids(again.validation)                      # by seed and prompt_id, not by file order
    assert held != _ids(other.validation) and held != _ids(unseeded.validation)  # another seed, other prompts
    assert first.record["seed"] == 3 and "seed" not in unseeded.record  # a study's split record is unchanged
    with pytest.raises(ValueError, match="another validation_size"):  # the same folder, another seed
        split_prompts([str(tmp_path / "train.parquet")], eval_file, 64, tmp_path / "a", seed=4)


def test_validation_size_defaults_and_refusals():
    spec = Path("s.toml")
    assert validation_size(spec, 7700, None) == 256
    assert validation_size(spec, 500, None) == 100          # a fifth of a small prompt set
    assert validation_size(spec, 500, 40) == 40
    assert validation_size(spec, 64, 32) == 32              # half may be held out, not more
    with pytest.raises(ValueError, match="--val-prompts 33: holding out 33 of 64"):
        validation_size(spec, 64, 33)
    with pytest.raises(ValueError, match="--val-prompts 8: too few"):
        validation_size(spec, 500, 8)
    with pytest.raises(ValueError, match="s.toml: 60 train prompts: too few .* 80 needed"):
        validation_size(spec, 60, None)
    with pytest.raises(ValueError, match="no prompts outside the eval set"):
        validation_size(spec, 0, None)


# ---------------------------------------------------------------------------------------------
# Candidates, ranking and the budget
# ---------------------------------------------------------------------------------------------

def test_parse_lrs_and_the_default_grid():
    assert parse_lrs("3e-4,1e-3") == [3e-4, 1e-3]
    assert parse_lrs(" 1e-4 , 2e-4") == [1e-4, 2e-4]
    for text, message in [("3e-4,fast", "comma-separated"), ("3e-4,,1e-3", "comma-separated"),
                          ("3e-4,-1e-3", "positive"), ("0", "positive"), ("nan", "positive"),
                          ("1e-4,1e-4", "listed twice")]:
        with pytest.raises(ValueError, match=f"--lrs '{re.escape(text)}': .*{message}"):
            parse_lrs(text)
    assert default_lrs(2e-4) == [2e-4, 6.67e-5, 6e-4]    # the spec's own first


def _trial(lr: float, accuracies: list[float]) -> Trial:
    return Trial(lr, rounds=len(accuracies) - 1, curve=list(enumerate(accuracies)), tried=True)


def test_rank_takes_the_best_plateau_not_the_luckiest_eval():
    lucky = _trial(1e-3, [0.30, 0.40, 0.90, 0.40, 0.41, 0.42])   # one high eval, plateau 0.41
    steady = _trial(3e-4, [0.30, 0.50, 0.55, 0.60, 0.61, 0.62])  # plateau 0.61
    slow = _trial(1e-4, [0.30, 0.35, 0.40, 0.45, 0.50, 0.55])    # plateau 0.50
    assert [t.lr for t in rank([lucky, slow, steady])] == [3e-4, 1e-4, 1e-3]
    assert steady.score == pytest.approx((0.60 + 0.61 + 0.62) / 3)
    # round 0 (the start model, the same for all) never counts, even when it is all there is
    assert _trial(1e-4, [0.9]).score is None
    assert _trial(1e-4, [0.9, 0.2]).score == pytest.approx(0.2)


def test_rank_breaks_ties_to_the_smaller_lr_and_puts_unscored_last():
    # the same evals in another order: equal plateaus up to float rounding
    a = _trial(6e-4, [0.3, 0.1, 0.7, 0.2])
    b = _trial(2e-4, [0.3, 0.7, 0.2, 0.1])
    unscored = Trial(1e-5, tried=True, curve=[(0, 0.3)])
    assert [t.lr for t in rank([a, unscored, b])] == [2e-4, 6e-4, 1e-5]
    assert [t.lr for t in rank([b, a])] == [2e-4, 6e-4]


def test_budget_stops_starting_trials_once_spent_or_when_one_would_overrun():
    now = [100.0]
    budget = Budget(60.0, clock=lambda: now[0])
    assert budget.allows(None) and budget.allows(50.0)
    now[0] = 130.0                                         # 30 s spent
    assert budget.allows(OVERRUN * 60 - 30) and not budget.allows(OVERRUN * 60 - 29)
    now[0] = 160.0                                         # spent: nothing starts, estimate or not
    assert not budget.allows(None) and not budget.allows(0.0)


def test_fit_rounds_fills_the_budget_and_stays_within_the_spec():
    assert fit_rounds(300, trials=3, jobs=1, per_round=2.0, start_up=10, cap=180) == 45
    assert fit_rounds(300, trials=3, jobs=3, per_round=2.0, start_up=10, cap=180) == 45   # 3 at once, ~3x slower
    assert fit_rounds(300, trials=3, jobs=1, per_round=2.0, start_up=10, cap=20) == 20
    assert fit_rounds(5, trials=3, jobs=1, per_round=2.0, start_up=10, cap=180) == 1


# ---------------------------------------------------------------------------------------------
# The spec edited as text
# ---------------------------------------------------------------------------------------------

def test_set_key_changes_only_lr_and_keeps_comments_and_layout(toy_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the spec's paths are relative to the repository root
    text = TOY_GRPO.read_text()
    edited = set_key(text, "train", "lr", 6.67e-5, "toy-grpo.toml")
    changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines()) if a != b]
    assert len(text.splitlines()) == len(edited.splitlines()) and len(changed) == 1
    before, after = changed[0]
    assert before.startswith("lr = 2e-4 ") and after.startswith("lr = 6.67e-5 ")
    assert after.index("#") == before.index("#")            # the comment stays in its column
    assert after[after.index("#"):] == before[before.index("#"):]
    expected = tomllib.loads(text)
    expected["train"]["lr"] = 6.67e-5
    assert tomllib.loads(edited) == expected
    (tmp_path / "tuned.toml").write_text(put_comment_block(edited, "train", ["chosen: 6.67e-5", "  why"], "# tune: "))
    spec = load_spec(tmp_path / "tuned.toml")
    assert spec.train.lr == 6.67e-5 and spec.train.batch_size == 256 and spec.run.decay_rounds == 90


def test_set_key_adds_a_missing_key_or_section_and_refuses_what_it_cannot_edit():
    assert tomllib.loads(set_key("[train]\nobjective = \"grpo\"\n", "train", "lr", 1e-3, "x"))["train"] == {
        "objective": "grpo", "lr": 1e-3}
    added = set_key("# my run\n[run]\nname = \"a\"  # keep\n", "train", "lr", 1e-3, "x")
    assert added.startswith("# my run\n[run]\nname = \"a\"  # keep\n") and tomllib.loads(added)["train"] == {
        "lr": 1e-3}
    # a [train.lora] subtable's lr is not [train] lr
    nested = set_key("[train]\nbatch_size = 8\n[train.lora]\nlr = 5.0\n", "train", "lr", 2e-4, "x")
    assert tomllib.loads(nested)["train"] == {"batch_size": 8, "lr": 2e-4, "lora": {"lr": 5.0}}
    with pytest.raises(ValueError, match=r"x: cannot set train.lr .* set train.lr = 2e-4 there by hand"):
        set_key("train = {lr = 1e-3}\n", "train", "lr", 2e-4, "x")
    assert format_float(2e-4) == "2e-4" and format_float(6.666666666666667e-05) == "6.666666666666667e-5"


def test_comment_block_replaces_an_earlier_one_and_keeps_the_users_comments():
    text = "[run]\nname = \"a\"\n\n# the user's note on training\n[train]\nlr = 1e-3\n"
    once = put_comment_block(text, "train", ["first"], "# tune: ")
    twice = put_comment_block(once, "train", ["second", "  more"], "# tune: ")
    assert twice == ("[run]\nname = \"a\"\n\n# the user's note on training\n"
                     "# tune: second\n# tune:   more\n[train]\nlr = 1e-3\n")


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def _small_spec(toy_dir: Path, path: Path) -> Path:
    """toy-grpo.toml with rounds small enough for a test: 32 prompts a round, 2 steps of 64."""
    text = TOY_GRPO.read_text()
    for key, value in [("per_round", "32"), ("steps_per_round", "2"), ("batch_size", "64"),
                       ("checkpoint_every", "1")]:
        text, count = re.subn(rf"(?m)^{key} = \d+", f"{key} = {value}", text)
        assert count == 1, key
    text = text.replace('"runs/toy/', f'"{toy_dir}/')
    path.write_text(text)
    return path


@pytest.mark.slow
def test_tune_cli_runs_each_candidate_and_writes_the_tuned_spec_and_evidence(toy_dir, tmp_path):
    spec = _small_spec(toy_dir, tmp_path / "small.toml")
    out, work = tmp_path / "tuned.toml", tmp_path / "work"
    proc = groupforge("tune", spec, "--out", out, "--work", work, "--lrs", "2e-4,6e-4", "--rounds", "2",
                      "--val-prompts", "32", "--seed", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trial 1/2 lr 2e-4: validation" in proc.stdout and "trial 2/2 lr 6e-4: validation" in proc.stdout

    evidence = json.loads(out.with_suffix(".tune.json").read_text())
    candidates = {c["lr"]: c for c in evidence["candidates"]}
    assert set(candidates) == {2e-4, 6e-4} and evidence["not_tried"] == []
    for lr, candidate in candidates.items():
        assert candidate["tried"] and candidate["rounds"] == 2
        assert [r for r, _ in candidate["curve"]] == [0, 1, 2]
        assert candidate["validation_score"] == pytest.approx((candidate["curve"][1][1] + candidate["curve"][2][1]) / 2)
        run_spec = load_spec(Path(candidate["run"]) / "spec.toml", check_files=False)
        assert run_spec.train.lr == lr and run_spec.run.rounds == 2 and run_spec.run.seed == 1
        assert run_spec.prompts.eval == str(work / "data" / "validation.parquet")   # never the eval set
        assert run_spec.prompts.train == [str(work / "data" / "train.parquet")]
    best = max(candidates.values(), key=lambda c: (c["validation_score"], -c["lr"]))
    assert evidence["chosen_lr"] == best["lr"] == evidence["candidates"][0]["lr"]
    assert evidence["split"]["validation_rows"] == 32 and evidence["split"]["seed"] == 1
    assert _ids(work / "data" / "validation.parquet").isdisjoint(_ids(work / "data" / "train.parquet"))

    tuned, original = out.read_text(), spec.read_text()
    tuned_spec = load_spec(out)
    assert tuned_spec.train.lr == best["lr"]
    assert tuned_spec.prompts.eval == str(toy_dir / "eval.parquet")        # the user's own eval set
    expected = tomllib.loads(original)
    expected["train"]["lr"] = best["lr"]
    assert tomllib.loads(tuned) == expected
    assert "# tune: lr = " in tuned and f"{out.with_suffix('.tune.json').name}" in tuned
    kept = [line for line in tuned.splitlines() if not line.startswith("# tune: ") and not line.startswith("lr = ")]
    assert kept == [line for line in original.splitlines() if not line.startswith("lr = ")]  # comments kept


@pytest.mark.slow
def test_tune_cli_with_a_budget_spent_by_the_probe_starts_no_trial_and_exits_2(toy_dir, tmp_path):
    spec = _small_spec(toy_dir, tmp_path / "small.toml")
    out, work = tmp_path / "tuned.toml", tmp_path / "work"
    # in a child: its start-up counts against the budget, as a user's does (in this process the probe fits 3 s)
    proc = cli("tune", spec, "--out", out, "--work", work, "--lrs", "2e-4,6e-4", "--val-prompts", "32",
               "--budget-minutes", "0.05", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]  # stderr also has the runs' logs
    assert len(errors) == 1 and "--budget-minutes 0.05: spent before the first trial" in errors[0]
    probe = next(work.glob("probe-lr-2e-4-seed0"))
    assert [r["round"] for r in MetricsLog(probe).rounds()] == [0, 1, 2]   # the probe ran, on the split
    assert load_spec(probe / "spec.toml", check_files=False).prompts.eval == str(work / "data" / "validation.parquet")
    assert not (work / "trials").exists() and not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--lrs", "1e-4,abc"], "--lrs '1e-4,abc': expected comma-separated"),
    (["--val-prompts", "5000"], "--val-prompts 5000: holding out 5000 of 7700"),
    (["--budget-minutes", "0"], "--budget-minutes 0: must be more than 0"),
])
def test_tune_bad_input_is_one_error_line_and_exit_2(toy_dir, tmp_path, args, message):
    spec = _small_spec(toy_dir, tmp_path / "small.toml")
    proc = groupforge("tune", spec, "--work", tmp_path / "work", *args)
    assert proc.returncode == 2 and message in error_line(proc)
    assert not (tmp_path / "work" / "trials").exists()


@pytest.mark.parametrize("train, message", [
    ("[]", "prompts.train: List should have at least 1 item"),
    ('["EMPTY"]', "has no rows"),
])
def test_tune_refuses_a_spec_without_train_prompts(toy_dir, tmp_path, train, message):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "reference": pa.array([], pa.string())}), empty)
    spec = _small_spec(toy_dir, tmp_path / "small.toml")
    spec.write_text(spec.read_text().replace(f'train = ["{toy_dir}/train.parquet"]',
                                             f"train = {train.replace('EMPTY', str(empty))}"))
    proc = groupforge("tune", spec, "--work", tmp_path / "work")
    assert proc.returncode == 2 and message in error_line(proc)
