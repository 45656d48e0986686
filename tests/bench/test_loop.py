"""bench/loop.py: its pieces import without TRL, and what it reads off a curve is right on hand-made curves."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


@pytest.fixture(scope="module")
def loop():
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))  # appended: bench/curation.py must not shadow the curation package
    spec = importlib.util.spec_from_file_location("bench_loop", BENCH / "loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def curve(loop, framework: str, seconds, accuracy, samples=None, seed: int = 0):
    import _curves

    c = _curves.Curve(framework, "default", seed)
    for i, (s, a) in enumerate(zip(seconds, accuracy)):
        c.add(s, samples[i] if samples else 512 * i, a, cpu_seconds=2 * s, load=1.0 + i)
    return c


def test_helpers_import_without_trl(loop):
    import _gf_run
    import _report
    import _trl_run

    assert callable(_trl_run.run_trl) and callable(_gf_run.run_groupforge) and callable(_report.plot_variant)


def test_smoothing_time_to_best_plateau(loop):
    import _curves

    c = curve(loop, "trl", [0, 10, 20, 30, 40, 50], [0.30, 0.60, 0.30, 0.60, 0.66, 0.72])
    assert _curves.smoothed(c.accuracy, 3) == pytest.approx([0.30, 0.45, 0.40, 0.50, 0.52, 0.66])
    assert _curves.time_to(c, 0.5, window=3) == (30.0, 1536)  # the raw 0.60 at 10 s is one lucky eval
    assert _curves.time_to(c, 0.6, window=1) == (10.0, 512)
    assert _curves.time_to(c, 0.7, window=3) is None
    assert _curves.best(c, 3) == pytest.approx(0.66)
    assert _curves.best(c, 3, within_seconds=40) == pytest.approx(0.52)
    assert _curves.plateau(c, last=3) == pytest.approx((0.60 + 0.66 + 0.72) / 3)
    assert _curves.plateau(curve(loop, "trl", [0], [0.3]), last=3) == pytest.approx(0.3)
    assert _curves.samples_per_s(c) == pytest.approx(2560 / 50)
    assert _curves.mean([1.0, None]) is None and _curves.mean([1.0, 2.0]) == 1.5
    assert _curves.Curve.from_dict(c.to_dict()) == c


def test_summary_pairs_seeds_and_times_trl_best(loop):
    trl = curve(loop, "trl", [0, 60, 120, 180], [0.3, 0.5, 0.6, 0.6], samples=[0, 5120, 10240, 15360])
    gf = curve(loop, "groupforge", [0, 10, 20, 30], [0.3, 0.6, 0.7, 0.8], samples=[0, 2048, 4096, 6144])
    rows = loop.summarize([trl, gf], [0.5, 0.7], window=1, last=2)
    by = {r["framework"]: r for r in rows}
    assert by["trl"]["target"] == pytest.approx(0.6) and by["groupforge"]["target"] == pytest.approx(0.6)
    assert (by["trl"]["target_seconds"], by["trl"]["target_samples"]) == (120.0, 10240)
    assert (by["groupforge"]["target_seconds"], by["groupforge"]["target_samples"]) == (10.0, 2048)
    assert by["groupforge"]["levels"] == {0.5: 10.0, 0.7: 20.0} and by["trl"]["levels"] == {0.5: 60.0, 0.7: None}
    assert by["groupforge"]["plateau"] == pytest.approx(0.75) and by["trl"]["plateau"] == pytest.approx(0.6)
    assert (by["groupforge"]["target_cpu"], by["trl"]["target_cpu"], by["trl"]["load"]) == (20.0, 240.0, 2.5)
    (line,) = loop.verdicts(rows)
    assert "0.08 (meets" in line and "in CPU seconds 0.08)" in line and "NOT higher" not in line
    assert f"{(6144 / 30) / (15360 / 180):.2f}x (meets" in line

    args = Namespace(levels=[0.5, 0.7], smooth=1, plateau_evals=2, trl_prompts=64, trl_batch=128, trl_minutes=3,
                     gf_minutes=1, spec=str(REPO / "pipelines/specs/toy-grpo.toml"), gf_set=[], sweep_minutes=1)
    trl.extra["lr"] = 1e-4
    text = loop.markdown(rows, [trl, gf], [trl], 1e-4, args, [])
    assert "| default | groupforge | 0 | 0.300 | 10 | 20 | 10 | 20 | 2,048 | 0.600 |" in text
    assert "| 0.0001 (chosen) | 0.600 | 0.600 | 85 |" in text


def test_spec_of_a_bench_run(loop, tmp_path):
    import _gf_run

    spec = _gf_run.loop_spec(REPO / "pipelines/specs/toy-grpo.toml", tmp_path, "gf-seed1", 1,
                             ["prompts.per_round=64"], rounds=3)
    assert (spec.run.name, spec.run.seed, spec.run.rounds, spec.prompts.per_round) == ("gf-seed1", 1, 3, 64)
    assert spec.model.path == str(tmp_path.resolve() / "model")
    assert spec.prompts.train == [str(tmp_path.resolve() / "train.parquet")]
    with pytest.raises(ValueError, match="train.nope"):
        _gf_run.loop_spec(REPO / "pipelines/specs/toy-grpo.toml", tmp_path, "x", 0, ["train.nope=1"])

    # evals every round (as often in samples as TRL's), before the user's overrides so they may change it
    args = Namespace(gf_minutes=1, spec=str(REPO / "pipelines/specs/toy-grpo.toml"), threads=1,
                     gf_set=["eval.every=2"], gf_rounds=None)
    job = loop.gf_job(args, "default", tmp_path, 0)
    assert job["set"] == ["eval.every=1", "eval.every=2"]
    assert _gf_run.loop_spec(job["spec"], tmp_path, "x", 0, job["set"]).eval.every == 2


def test_greedy_timer_restores_the_generators(loop):
    import _gf_run

    from curation.generate.hf import HFGenerator

    original = HFGenerator.greedy
    with _gf_run.greedy_seconds() as spent:
        assert HFGenerator.greedy is not original and spent == [0.0, 0.0]
    assert HFGenerator.greedy is original


def test_plot_writes_one_figure(loop, tmp_path):
    import _report

    trl = curve(loop, "trl", [0, 60], [0.3, 0.5])
    gf = curve(loop, "groupforge", [0, 10], [0.3, 0.6])
    path = _report.plot_variant([trl, gf], 0.5, tmp_path / "loop-default.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
