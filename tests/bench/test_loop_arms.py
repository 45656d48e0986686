"""bench/loop_arms.py: every arm is a valid spec on top of the chosen recipe, runs only on the held-out
families, is read against `base` of the same sitting, and refuses to start without a selection."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, bench_script, flat_curve

SPEC = REPO / "pipelines/specs/toy-family-grpo.toml"


@pytest.fixture(scope="module")
def arms():
    return bench_script("loop_arms")


def test_every_arm_is_a_valid_spec_with_the_setting_it_names(arms, tmp_path):
    import _gf_run

    recipe = ["run.rounds=1000", 'train.lr_schedule="constant"', "train.lr=6e-5"]
    specs = {name: _gf_run.loop_spec(SPEC, tmp_path, "x", 0, [*recipe, *overrides])
             for name, overrides in arms.ARMS.items()}
    assert all(s.train.lr == 6e-5 and s.train.lr_schedule == "constant" for s in specs.values())
    assert (specs["dr_grpo"].label.scale_rewards, specs["dr_grpo"].train.agg) == ("none", "seq-mean-token-sum-norm")
    assert (specs["dapo"].train.agg, specs["dapo"].train.eps_high) == ("token-mean", 0.28)
    assert specs["cispo"].train.objective == "cispo" and specs["batch"].label.scale_rewards == "batch"
    assert specs["curriculum"].prompts.curriculum and not specs["base"].prompts.curriculum


def test_arms_run_on_the_held_out_cells_against_base_of_the_same_sitting(arms, tmp_path, monkeypatch, capsys):
    loop = arms.loop
    monkeypatch.setattr(loop, "OUT", tmp_path)
    monkeypatch.setattr(loop, "LOOP", tmp_path / "loop")
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "selection.json").write_text(json.dumps({
        "trl": {"lr": 3e-5}, "groupforge": {"candidate": "lr6e-5", "overrides": ["train.lr=6e-5"]}}))
    (tmp_path / "loop" / "sort-512").mkdir()
    (tmp_path / "loop" / "sort-512" / "trl-lr3e-05-3min-seed0.json").write_text(
        json.dumps(flat_curve("trl", 0.8, "sort-512").to_dict()))
    monkeypatch.setattr(loop, "build_toys", lambda families, sizes, build: {(f, s): tmp_path for f in families
                                                                             for s in sizes})
    jobs = []
    levels = {"arm-base": 0.9, "arm-cispo": 0.85}

    def fake_runs(items, reuse, at_once):
        jobs.extend(items)
        return [flat_curve("groupforge", levels[job["candidate"]], job["variant"]) for _, job in items]

    monkeypatch.setattr(loop, "run_jobs", fake_runs)
    arms.main(["--arms", "cispo", "--families", "reverse,sort"])

    assert [job["candidate"] for _, job in jobs] == ["arm-base"] * 2 + ["arm-cispo"] * 2  # base added, first
    assert {job["variant"] for _, job in jobs} == {"reverse-512", "sort-512"}
    assert all(job["set"][:2] == ["eval.every=1", "train.lr=6e-5"] for _, job in jobs)
    assert jobs[-1][1]["set"][2:] == ['train.objective="cispo"']
    report = (tmp_path / "loop-arms.md").read_text()
    assert "| base | `-` | 0.900 | 0.900 |  |" in report
    assert "| cispo | `train.objective=\"cispo\"` | 0.850 (-0.050) | 0.850 (-0.050) | -0.050 |" in report
    assert "| TRL (saved) | chosen lr | - | 0.800 | |" in report


def test_without_a_selection_or_with_an_unknown_arm_it_says_what_to_do(arms, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(arms.loop, "LOOP", tmp_path / "loop")
    with pytest.raises(SystemExit, match="selection.json is missing: run `bench/loop.py` first"):
        arms.main(["--arms", "base"])
    with pytest.raises(SystemExit):
        arms.parse_args(["--arms", "base,nope"])
    assert "unknown arm(s) nope" in capsys.readouterr().err
