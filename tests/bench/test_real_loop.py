"""bench/real_loop.py: the real model's leave-one-task-out comparison with TRL chooses on the selection
tasks and tests only the chosen settings on the others, TRL's run is given the spec's round, and
its reward reads a conversational completion."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.helpers import flat_curve


@pytest.fixture(scope="module")
def real_loop():
    from tests.helpers import bench_script

    return bench_script("real_loop")


def fake_runs(jobs, reuse, at_once):
    """Curves without training: TRL does best at 3e-5, groupforge at lr1e-5; on a test task both
    reach 0.5, groupforge in a quarter of TRL's seconds."""
    assert at_once == 1  # one run at a time
    curves = []
    for kind, job in jobs:
        if job["variant"] in ("multiply", "max"):
            level = 0.5
        elif kind == "trl":
            level = 0.4 if job["lr"] == 3e-5 else 0.3
        else:
            level = 0.45 if job["candidate"] == "lr1e-5" else 0.35
        every = 7.5 if kind == "groupforge" and job["variant"] in ("multiply", "max") else 30
        c = flat_curve(kind, level, job["variant"], job["seed"], every,
                       **({"lr": job["lr"]} if kind == "trl" else {"set": job["set"]}))
        curves.append(c)
    fake_runs.jobs += jobs
    return curves


def test_selection_then_test_sees_only_the_chosen_settings(real_loop, tmp_path, monkeypatch):
    monkeypatch.setattr(real_loop, "OUT", tmp_path)
    monkeypatch.setattr(real_loop, "RUNS", tmp_path / "real_loop")
    (tmp_path / "real_loop").mkdir()
    monkeypatch.setattr(real_loop, "need_trl", lambda: None)
    monkeypatch.setattr(real_loop, "prepare_task", lambda task, n: tmp_path / task)
    monkeypatch.setattr(real_loop, "run_jobs", fake_runs)
    monkeypatch.setattr(real_loop, "plot_variant", lambda curves, target, path: path)
    fake_runs.jobs = []
    real_loop.main(["--reuse", "--seeds", "0,1"])  # --reuse: no TRL or model needed; run_jobs is faked anyway

    selection, held_out = fake_runs.jobs[:2 * 4], fake_runs.jobs[2 * 4:]
    assert {job["variant"] for _, job in selection} == {"addition", "subtraction"}
    assert {job["seed"] for _, job in selection} == {0}
    assert len(held_out) == 2 * 2 * 2 and {job["variant"] for _, job in held_out} == {"multiply", "max"}
    assert {job["lr"] for kind, job in held_out if kind == "trl"} == {3e-5}
    assert {job["candidate"] for kind, job in held_out if kind == "groupforge"} == {"lr1e-5"}
    trl = next(job for kind, job in held_out if kind == "trl")
    # TRL samples and steps the spec's round: 16 prompts x 8, steps of 64 in micro-batches of 8, an eval a round
    assert (trl["prompts_per_generation"], trl["group_size"], trl["batch_size"], trl["micro_batch"],
            trl["eval_every"], trl["max_tokens"]) == (16, 8, 64, 8, 2, 64)
    assert (trl["column"], trl["metric"]) == ("messages", "math")
    gf = next(job for kind, job in held_out if kind == "groupforge")
    assert gf["set"][:2] == ["eval.every=1", "prompts.eval_limit=64"]

    chosen = json.loads((tmp_path / "real_loop" / "selection.json").read_text())
    assert (chosen["trl"]["lr"], chosen["groupforge"]["candidate"]) == (3e-5, "lr1e-5")
    report = (tmp_path / "real_loop.md").read_text()
    result, _, evidence = report.partition("### Selection tasks (addition, subtraction)")
    assert "addition" not in result.partition("the result")[2] and "multiply" not in evidence
    assert "**4 of 4 test cells pass both checks**" in result


def test_candidates_are_valid_specs(real_loop):
    from pipelines.spec import PipelineSpec, apply_overrides, parse_overrides, read_toml, validate_model

    for candidate in real_loop.parse_candidates(real_loop.CANDIDATES):
        data = apply_overrides(read_toml(real_loop.SPEC), parse_overrides(list(candidate.overrides)))
        spec = validate_model(PipelineSpec, data, real_loop.SPEC)
        assert spec.train.lr_schedule == "constant" and spec.train.lr == float(candidate.name[2:])


@pytest.mark.parametrize("argv, message", [
    (["--test", "addition"], "addition in both --selection and --test"),
    (["--selection", "division"], "--selection: unknown task 'division'"),
    (["--test", "max,max"], "--test: a task is listed twice"),
])
def test_cli_refuses_bad_tasks_in_one_line(real_loop, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        real_loop.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_quick_is_one_task_each_and_one_setting(real_loop):
    args = real_loop.parse_args(["--quick"])
    assert (args.selection, args.test, args.seeds, args.trl_lrs) == (["addition"], ["multiply"], [0], [1e-5])
    assert [c.name for c in args.gf_candidates] == ["lr1e-5"]


def test_task_folder_evaluates_both_sides_on_the_same_rows(real_loop, tmp_path, monkeypatch):
    monkeypatch.setattr(real_loop, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(real_loop, "ROOT", tmp_path)
    folder = real_loop.prepare_task("max", 5)
    assert (folder / "model").resolve() == real_loop.MODEL.resolve()
    assert pq.read_table(folder / "eval.parquet").num_rows == 5
    assert pq.read_table(folder / "train.parquet").num_rows == 512
    assert pq.read_table(folder / "eval.parquet").column("reference").to_pylist() == \
        pq.read_table(tmp_path / "runs" / "chat" / "max" / "eval.parquet").column("reference").to_pylist()[:5]


def test_trl_reward_reads_the_assistant_message(real_loop):
    import _trl_run

    reward = _trl_run.text_reward("math")
    completions = [[{"role": "assistant", "content": "37 + 48 = 85."}], [{"role": "assistant", "content": "84"}],
                   "85"]
    assert reward(prompts=[None] * 3, completions=completions, reference=["85", "85", "85"]) == [1.0, 0.0, 1.0]
