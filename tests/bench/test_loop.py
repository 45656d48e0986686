"""bench/loop.py: its pieces import without TRL, the leave-one-family-out protocol chooses on the selection
families and tests only the chosen settings on the others, and its checks are right on hand-made curves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO, bench_curve, bench_script, flat_curve

SPEC = REPO / "pipelines/specs/toy-family-grpo.toml"


@pytest.fixture(scope="module")
def loop():
    return bench_script("loop")


# ---- the pieces ---------------------------------------------------------------------------------

def test_helpers_import_without_trl(loop):
    import _gf_run
    import _report
    import _trl_run

    assert callable(_trl_run.run_trl) and callable(_gf_run.run_groupforge) and callable(_report.plot_variant)


def test_smoothing_time_to_best_plateau(loop):
    import _curves

    c = bench_curve("trl", [0, 10, 20, 30, 40, 50], [0.30, 0.60, 0.30, 0.60, 0.66, 0.72], samples=[0, 512, 1024, 1536,
                                                                                           2048, 2560])
    assert _curves.smoothed(c.accuracy, 3) == pytest.approx([0.30, 0.45, 0.40, 0.50, 0.52, 0.66])
    assert _curves.time_to(c, 0.5, window=3) == (30.0, 1536)  # the raw 0.60 at 10 s is one lucky eval
    assert _curves.time_to(c, 0.7, window=3) is None
    assert _curves.best(c, 3) == pytest.approx(0.66)
    assert _curves.plateau(c, last=3) == pytest.approx((0.60 + 0.66 + 0.72) / 3)
    assert _curves.Curve.from_dict(c.to_dict()) == c


def test_cell_toys_share_one_warm_start_per_family(loop):
    import _families

    assert "scratchpad" not in _families.BENCH_FAMILIES
    assert {"addition", "multiply", "reverse", "sort", "max"} <= set(_families.BENCH_FAMILIES)
    for family in ("addition", "reverse"):
        small, large = _families.toy_config(family, 512), _families.toy_config(family, 4096)
        assert (small.task, small.n_train, large.n_train) == (family, 512, 4096)
        assert small.warm_start_prompts == large.warm_start_prompts
    assert _families.toy_config("addition", 512).warm_start_prompts == 90 * 90 - 400  # all its train prompts
    assert _families.toy_config("reverse", 512).warm_start_prompts == 8192  # the family's own


def test_default_candidates_are_valid_specs(loop, tmp_path):
    import _families
    import _gf_run

    candidates = _families.parse_candidates(_families.DEFAULT_CANDIDATES)
    assert [c.name for c in candidates] == ["lr6e-5", "lr3e-5"]
    specs = {c.name: _gf_run.loop_spec(SPEC, tmp_path, "x", 0, list(c.overrides)) for c in candidates}
    assert [(s.run.rounds, s.train.lr_schedule, s.train.lr) for s in specs.values()] == [(1000, "constant", 6e-5),
                                                                                       (1000, "constant", 3e-5)]


def test_candidates_parse_and_refuse(loop):
    import _families

    (c,) = _families.parse_candidates('lr1e-4=train.lr=1e-4;train.lr_schedule="constant"')
    assert c == _families.Candidate("lr1e-4", ("train.lr=1e-4", 'train.lr_schedule="constant"'))
    for text, message in (("a=train.lr=1,a=", "share a name"), ("a=lr=1", "not section.key=value"),
                          ("b c=train.lr=1", "expected NAME="), (",", "no candidate")):
        with pytest.raises(ValueError, match=message):
            _families.parse_candidates(text)


def test_runs_evaluate_every_round_before_the_candidates_overrides(loop, tmp_path):
    import _families
    import _gf_run

    args = loop.parse_args(["--quick"])
    candidate = _families.Candidate("rare", ("eval.every=2",))
    job = loop.gf_job(args, ("reverse", 512), tmp_path, 1, candidate, 1.5)
    assert job["set"] == ["eval.every=1", "eval.every=2"] and job["candidate"] == "rare"
    assert job["result"].endswith("loop/reverse-512/gf-rare-1.5min-seed1.json")
    assert _gf_run.loop_spec(job["spec"], tmp_path, "x", 1, job["set"]).eval.every == 2
    trl = loop.trl_job(args, ("reverse", 512), tmp_path, 1, 1e-4, 1.5)
    assert (trl["max_tokens"], trl["group_size"], trl["temperature"]) == (12, 8, 1.0)  # as the spec samples
    assert trl["result"].endswith("loop/reverse-512/trl-lr0.0001-1.5min-seed1.json")


# ---- selection ----------------------------------------------------------------------------------

def test_choose_by_plateau_averaged_over_selection_cells(loop):
    import _families

    runs = {"peaky": [flat_curve("groupforge", 0.90, "addition-512"), flat_curve("groupforge", 0.40, "multiply-512")],
            "steady": [flat_curve("groupforge", 0.70, "addition-512"), flat_curve("groupforge", 0.70, "multiply-512")]}
    chosen, scores = _families.choose(runs, last=5, window=1)
    assert chosen == "steady"  # best on one cell, worse on average: not chosen
    assert scores == pytest.approx({"peaky": 0.65, "steady": 0.70})

    # equal plateaus: the higher best wins
    late = bench_curve("trl", [0, 30, 60], [0.3, 0.5, 0.7], "addition-512")
    early = bench_curve("trl", [0, 30, 60], [0.3, 0.8, 0.4], "addition-512")
    assert _families.choose({"late": [late], "early": [early]}, last=2, window=1)[0] == "early"
    with pytest.raises(ValueError, match="different cells"):
        _families.choose({"a": [flat_curve("trl", 0.5, "addition-512")], "b": [flat_curve("trl", 0.5, "sort-512")]},
                         5, 1)


# ---- the test cells' checks ---------------------------------------------------------------------

TRL = ([0, 60, 120, 180, 240, 300], [0.3, 0.5, 0.6, 0.7, 0.7, 0.7])  # best 0.7 at 180 s, plateau 0.64


@pytest.mark.parametrize("seconds, accuracy, plateau_pass, ratio, time_pass", [
    ([0, 20, 40, 60, 80, 100], [0.3, 0.6, 0.7, 0.75, 0.8, 0.8], True, 40 / 180, True),
    ([0, 30, 60, 90, 120, 150], [0.3, 0.5, 0.6, 0.7, 0.65, 0.6], False, 0.5, True),  # at 1/2 exactly: passes
    ([0, 30, 60, 100, 120, 150], [0.3, 0.6, 0.65, 0.7, 0.7, 0.7], True, 100 / 180, False),
    ([0, 30, 60, 90, 120, 150], [0.3, 0.5, 0.6, 0.6, 0.6, 0.6], False, None, False),  # never reaches TRL's best
])
def test_verdict_pass_and_fail(loop, seconds, accuracy, plateau_pass, ratio, time_pass):
    import _families

    v = _families.verdict(bench_curve("trl", *TRL), bench_curve("groupforge", seconds, accuracy), last=5, window=1)
    assert v["target"] == pytest.approx(0.7) and v["trl_seconds"] == 180.0
    assert v["trl_plateau"] == pytest.approx(0.64)
    assert v["plateau_pass"] is plateau_pass and v["time_pass"] is time_pass
    assert v["ratio"] == (None if ratio is None else pytest.approx(ratio))


def test_verdict_pairs_one_cell_and_counts_passes(loop):
    import _families

    with pytest.raises(ValueError, match="not the same cell"):
        _families.verdict(bench_curve("trl", *TRL), bench_curve("groupforge", *TRL, seed=1), 5, 1)
    good = _families.verdict(bench_curve("trl", *TRL), bench_curve("groupforge", [0, 20, 40], [0.3, 0.7, 0.8]), 5, 1)
    bad = _families.verdict(bench_curve("trl", *TRL, seed=1),
                            bench_curve("groupforge", [0, 200], [0.3, 0.4], seed=1), 5, 1)
    text = "\n".join(_families.result_tables([good, bad]))
    assert "| reverse-512 | 0 | 0.640 | 0.750 | PASS | 0.700 | 180 | 20 | 0.11 | PASS |" in text
    assert "| reverse-512 | 1 | 0.640 | 0.400 | **FAIL** | 0.700 | 180 | never | never | **FAIL** |" in text
    assert "| reverse-512 | 2 | 0.640 | 0.575 | never | 1/2 | 1/2 |" in text
    assert "**1 of 2 test cells pass both checks**" in text


# ---- the command line and the two phases together -----------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--selection", "addition,reverse", "--test", "reverse,sort"], "reverse in both --selection and --test"),
    (["--test", "reverse,divide"], "--test: unknown family 'divide'"),
    (["--selection", "scratchpad"], "--selection: scratchpad has long responses"),
    (["--test", "sort,sort"], "listed twice"),
    (["--selection-sizes", "9000"], "--selection-sizes 9000: addition: n_train=9000 is more than the 7700"),
    (["--selection", "multiply", "--test", "addition", "--sizes", "9000"], "--sizes 9000: addition: n_train=9000"),
    (["--gf-candidates", "x=lr"], "'lr' is not section.key=value"),
])
def test_cli_refuses_bad_families_in_one_line(loop, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        loop.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and message in err[-1] and err[-1].startswith("usage:") is False
    assert sum(line.startswith("loop.py: error") or "error:" in line for line in err) == 1


def test_quick_fills_only_what_was_not_given(loop):
    quick = loop.parse_args(["--quick", "--minutes", "2"])
    assert (quick.selection, quick.test, quick.sizes, quick.seeds) == (["addition"], ["reverse"], [512], [0])
    assert (quick.minutes, quick.selection_minutes, quick.trl_lrs) == (2.0, 1.0, [1e-4, 3e-4])
    full = loop.parse_args([])
    assert (full.selection, full.test, full.sizes, full.seeds) == (["addition", "multiply"],
                                                                   ["reverse", "sort", "max"], [512, 4096], [0, 1])
    assert (full.minutes, full.selection_minutes, full.jobs, full.selection_jobs, full.reuse) == (3.0, 3.0, 1, 1, None)
    assert (quick.selection_sizes, full.selection_sizes) == ([512], [512])
    assert loop.parse_args(["--reuse-trl"]).reuse == "trl" and loop.parse_args(["--reuse"]).reuse == "all"


CANDIDATES = 'shipped=,constant=run.rounds=1000;train.lr_schedule="constant",hold=run.rounds=1000;run.decay_rounds=30'


def fake_runs(jobs, reuse, at_once):
    """Curves without training: TRL does best at lr 1e-4; groupforge's "constant" has the best mean plateau
    on the selection cells though "shipped" wins on addition; on a test cell both sides reach 0.8,
    groupforge in a quarter of TRL's seconds."""
    curves = []
    for kind, job in jobs:
        family = job["variant"].split("-")[0]
        if family in ("reverse", "sort"):
            level = 0.8
        elif kind == "trl":
            level = 0.7 if job["lr"] == 1e-4 else 0.5
        else:
            level = {"shipped": 0.9 if family == "addition" else 0.3, "constant": 0.7, "hold": 0.6}[job["candidate"]]
        extra = {"lr": job["lr"]} if kind == "trl" else {"set": job["set"]}
        every = 7.5 if kind == "groupforge" and family in ("reverse", "sort") else 30
        c = flat_curve(kind, level, job["variant"], job["seed"], every, **extra)
        c.extra["candidate"] = job.get("candidate")
        curves.append(c)
    fake_runs.jobs += jobs
    return curves


def test_selection_then_test_sees_only_the_chosen_settings(loop, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "OUT", tmp_path)
    monkeypatch.setattr(loop, "LOOP", tmp_path / "loop")
    monkeypatch.setattr(loop, "need_trl", lambda: None)
    monkeypatch.setattr(loop, "build_toys",
                        lambda families, sizes, build: {(f, s): tmp_path for f in families for s in sizes})
    monkeypatch.setattr(loop, "run_jobs", fake_runs)
    figures = []
    monkeypatch.setattr(loop, "plot_variant", lambda curves, target, path: figures.append((curves, path)) or path)
    fake_runs.jobs = []
    loop.main(["--selection", "addition,multiply", "--test", "reverse,sort", "--sizes", "512,4096",
               "--selection-sizes", "512,4096", "--seeds", "0,1", "--trl-lrs", "3e-5,1e-4",
               "--gf-candidates", CANDIDATES])

    selection = [job for _, job in fake_runs.jobs[:2 * 4 + 3 * 4]]
    held_out = [(kind, job) for kind, job in fake_runs.jobs[2 * 4 + 3 * 4:]]
    assert {job["variant"].split("-")[0] for job in selection} == {"addition", "multiply"}
    assert {job["seed"] for job in selection} == {0}
    assert len(held_out) == 2 * 2 * 2 * 2
    assert {job["variant"].split("-")[0] for _, job in held_out} == {"reverse", "sort"}
    assert {job["lr"] for kind, job in held_out if kind == "trl"} == {1e-4}
    assert {job["candidate"] for kind, job in held_out if kind == "groupforge"} == {"constant"}
    assert all(job["set"] == ["eval.every=1", "run.rounds=1000", 'train.lr_schedule="constant"']
               for kind, job in held_out if kind == "groupforge")

    import json

    chosen = json.loads((tmp_path / "loop" / "selection.json").read_text())
    assert (chosen["trl"]["lr"], chosen["groupforge"]["candidate"]) == (1e-4, "constant")
    assert chosen["groupforge"]["mean_plateau"] == pytest.approx({"shipped": 0.6, "constant": 0.7, "hold": 0.6})

    report = (tmp_path / "loop.md").read_text()
    result, _, evidence = report.partition("### Selection families (addition, multiply)")
    result = result.partition("### Test families (reverse, sort): the result")[2]
    assert "not a result" in evidence and "reverse" not in evidence and "sort-" not in evidence
    assert "addition" not in result and "multiply" not in result
    assert "**8 of 8 test cells pass both checks**" in result
    assert "| constant: `run.rounds=1000; train.lr_schedule=\"constant\"` (chosen) | 0.700 | 0.700 |" in evidence
    assert "| 0.0001 (chosen) |" in evidence
    assert [path.name for _, path in figures] == [f"loop-{f}-{s}.png" for f in ("reverse", "sort") for s in (512, 4096)]
    assert all({(c.framework, c.variant) for c in curves} == {("trl", path.stem[5:]), ("groupforge", path.stem[5:])}
               for curves, path in figures)


def test_reuse_needs_the_saved_runs(loop, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "ROOT", tmp_path)
    job = {"result": str(tmp_path / "loop" / "reverse-512" / "trl-lr0.0001-5min-seed0.json"), "minutes": 5}
    with pytest.raises(SystemExit, match="no saved run loop/reverse-512/trl-lr0.0001-5min-seed0.json"):
        loop.run_job("trl", job, "trl")
    Path(job["result"]).parent.mkdir(parents=True)
    Path(job["result"]).write_text(__import__("json").dumps(flat_curve("trl", 0.7, "reverse-512", lr=1e-4).to_dict()))
    assert loop.run_job("trl", job, "trl").accuracy[-1] == 0.7
    gf = {"result": job["result"], "minutes": 5, "set": ["eval.every=1"], "candidate": "shipped"}
    with pytest.raises(SystemExit, match="ran other overrides"):
        loop.run_job("groupforge", gf, "all")


def test_greedy_timer_restores_the_generators(loop):
    import _gf_run

    from curation.generate.hf import HFGenerator

    original = HFGenerator.greedy
    with _gf_run.greedy_seconds() as spent:
        assert HFGenerator.greedy is not original and spent == [0.0, 0.0]
    assert HFGenerator.greedy is original


def test_plot_writes_one_figure(loop, tmp_path):
    import _report

    runs = [flat_curve("trl", 0.5, "reverse-512"), flat_curve("groupforge", 0.6, "reverse-512")]
    path = _report.plot_variant(runs, 0.5, tmp_path / "loop-reverse-512.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_round_breakdown_per_cell(loop):
    rounds = [{"wall_seconds": 2.0, "phase_seconds": {"generate": 1.0, "train": 0.8}},
              {"wall_seconds": 4.0, "phase_seconds": {"generate": 2.0, "train": 1.6}}]
    gf = flat_curve("groupforge", 0.7, "sort-512", rounds=rounds)
    (line,) = loop.breakdown([flat_curve("trl", 0.7, "sort-512"), gf])
    assert line == "- groupforge round, sort-512 (mean of 2 rounds, 3.00 s): generate 1.50, train 1.20 s"
