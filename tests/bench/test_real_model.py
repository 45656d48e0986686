"""bench/real_model.py: its arithmetic (ratios, MFU, the bf16 rule), the run's phase table and overhead
shares from hand-written round records, and the checkpoint summary of a hand-made folder. No model runs."""

from __future__ import annotations

import pytest

from tests.helpers import bench_script


@pytest.fixture(scope="module")
def real():
    return bench_script("real_model")


def record(round: int, wall: float, rss: float | None = 2048.0, **phases) -> dict:
    return {"event": "round", "round": round, "wall_seconds": wall, "phase_seconds": phases, "peak_rss_mib": rss}


# ---- arithmetic ---------------------------------------------------------------------------------

def test_mfu_is_six_flops_per_parameter_and_token_over_the_peak(real):
    assert real.flops_per_token(134_515_008) == 6 * 134_515_008
    # 100 tokens/s x 6 x 1e8 = 60 GFLOP/s of a 120 GFLOP/s peak
    assert real.mfu(100.0, 100_000_000, 120e9) == pytest.approx(0.5)


def test_the_bf16_step_runs_only_within_ten_times_the_fp32_matmul_speed(real):
    assert not real.bf16_step_runs(66e9, 1.2e9)  # this AVX2 host: 55x slower
    assert real.bf16_step_runs(198e9, 428e9)  # AVX-512 BF16: faster
    assert real.bf16_step_runs(10e9, 1e9) and not real.bf16_step_runs(10e9, 0.99e9)


def test_ratio_lines_say_pass_or_fail_against_the_target(real):
    assert real.ratio_line("stage", 90.0, 100.0, "samples/s", "bare") == (
        "- **stage: 90.0 samples/s = 0.90x bare's 100.0 (target >= 0.9x): PASS**")
    assert real.ratio_line("stage", 89.0, 100.0, "samples/s", "bare").endswith("(target >= 0.9x): FAIL**")


def test_speed_is_units_of_the_fastest_call(real):
    t = real.Timing("engine", "vllm bare", 16, 2, wall=[4.0, 2.0, 3.0], cpu=[7.0, 3.5, 5.0], tokens=1000)
    assert real.speed(t) == 500.0 and real.speed(t, units=64) == 32.0 and t.best_cpu == 3.5
    rows = real.timing_rows([t], {"vllm bare": 64})
    assert rows[0] == "| what | best s | CPU s | tokens | tokens/s | samples | samples/s | calls s |"
    assert rows[2] == "| vllm bare | 2.00 | 3.5 | 1,000 | 500 | 64 | 32.0 | 4.00, 2.00, 3.00 |"


# ---- the run's rounds ---------------------------------------------------------------------------

RECORDS = [
    {"event": "step", "step": 1},  # not a round record
    record(2, 100.0, rss=9000.0, generate=50.0, train=30.0, reload=2.0, eval=15.0, other=3.0),
    record(0, 40.0, rss=3000.0, startup=25.0, eval=15.0),
    record(1, 80.0, rss=8500.0, generate=50.0, train=25.0, reload=2.0, other=3.0),
    record(3, 110.0, rss=9500.5, generate=50.0, train=30.0, checkpoint=10.0, reload=2.0, eval=15.0, other=3.0),
]


def test_round_records_in_round_order_with_their_overhead_shares(real):
    rounds = real.round_phases(RECORDS)
    assert [r.round for r in rounds] == [0, 1, 2, 3]
    assert rounds[3].share("checkpoint") == pytest.approx(10 / 110) and rounds[1].share("eval") == 0.0
    # rounds 1-3 together: 290 s, of which reload 6, checkpoint 10, eval 30 (round 0 left out)
    assert real.measured_shares(rounds) == pytest.approx({"reload": 6 / 290, "checkpoint": 10 / 290,
                                                          "eval": 30 / 290})


def test_phase_table_lists_the_phases_used_and_the_shares(real):
    table = real.phase_table(real.round_phases(RECORDS))
    assert table[0] == ("| round | wall s | startup s | generate s | train s | checkpoint s | reload s | eval s "
                        "| other s | reload % | checkpoint % | eval % | peak RSS MiB |")  # no score..pair: all zero
    assert table[1] == "|" + "--:|" * 13
    assert table[2] == "| 0 | 40.0 | 25.0 | 0.0 | 0.0 | 0.0 | 0.0 | 15.0 | 0.0 | 0.0% | 0.0% | 37.5% | 3,000 |"
    assert table[5] == ("| 3 | 110.0 | 0.0 | 50.0 | 30.0 | 10.0 | 2.0 | 15.0 | 3.0 | 1.8% | 9.1% | 13.6% "
                        "| 9,500 |")


def test_projected_shares_weigh_eval_and_checkpoint_as_the_spec_does_them(real):
    rounds = real.round_phases(RECORDS)
    # rest of a round: (78 + 83 + 83) / 3; eval 15 s x 4 of 8 rounds (2, 4, 6, 8); checkpoint 10 s x 2 (4, 8);
    # reload 2 s in every round
    rest = (78 + 83 + 83) / 3
    total = 8 * rest + 60 + 20 + 16
    assert real.projected_shares(rounds, 8, 2, 4) == pytest.approx({"eval": 60 / total, "checkpoint": 20 / total,
                                                                    "reload": 16 / total})
    assert real.projected_shares(rounds[:1], 8, 2, 4) == {"reload": 0.0, "checkpoint": 0.0, "eval": 0.0}


def test_run_verdicts_pass_and_fail_plainly(real):
    rounds = real.round_phases(RECORDS)
    lines = real.run_verdicts(rounds, {"reload": 0.02, "checkpoint": 0.03, "eval": 0.11}, "8 rounds")
    assert lines[0].startswith("- **reload: 2.1% of the wall seconds of rounds 1-3 (PASS); projected to the spec's "
                               "defaults (8 rounds): 2.0% (target <= 10%): PASS**")
    assert "eval: 10.3% of the wall seconds of rounds 1-3 (FAIL)" in lines[2] and lines[2].endswith(
        "11.0% (target <= 10%): FAIL** (per round: 0.0%, 15.0%, 13.6%)")
    assert lines[3] == "- **peak RSS of the loop process: 9,500 MiB (9.28 GiB; target <= 10 GiB): PASS**"
    over = real.run_verdicts(real.round_phases([record(1, 10.0, rss=10241.0)]), dict.fromkeys(real.OVERHEAD_PHASES,
                                                                                             0.0), "x")
    assert over[-1].endswith("target <= 10 GiB): FAIL**") and "of the wall seconds of round 1 (PASS)" in over[0]


def test_checkpoint_summary_names_the_kept_steps_and_the_newest_files(real, tmp_path):
    assert real.checkpoint_summary(tmp_path, 3).startswith("- checkpoints: none in ")
    for step in (2, 10):
        folder = tmp_path / "checkpoints" / f"step-{step}"
        (folder / "optimizer").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * (3 * 2**20))
        (folder / "optimizer" / "state.safetensors").write_bytes(b"\0" * (6 * 2**20))
        (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "best.json").write_text("{}")
    text = real.checkpoint_summary(tmp_path, 3)
    assert "step-2, step-10 in " in text  # numeric order, not text order
    assert ("step-10/ holds 9 MiB: optimizer/state.safetensors 6.0 MiB, model.safetensors 3.0 MiB, "
            "trainer_state.json.") in text
    assert "train.keep_last = 3: the newest 3 are kept" in text
    assert "train.keep_last = 0: all are kept" in real.checkpoint_summary(tmp_path, 0)


def test_spec_overrides_point_the_spec_at_the_task_and_quick_shrinks_the_groups_and_the_run(real):
    from pipelines.spec import PipelineSpec, apply_overrides, parse_overrides, read_toml, validate_model

    def spec(overrides: list[str]) -> PipelineSpec:
        data = apply_overrides(read_toml(real.SPEC), parse_overrides(overrides))
        return validate_model(PipelineSpec, data, real.SPEC)

    full, quick = spec(real.spec_overrides("addition", False)), spec(real.spec_overrides("addition", True))
    quick_run = spec(real.spec_overrides("addition", True) + real.QUICK_RUN)
    assert full.prompts.train == [str(real.CHAT / "addition" / "train.parquet")]
    assert full.prompts.eval == str(real.CHAT / "addition" / "eval.parquet") and full.model.path == str(real.MODEL)
    assert (full.prompts.per_round, full.generator.group_size, full.train.share_prompts) == (16, 8, True)
    assert (quick.prompts.per_round, quick.generator.group_size) == (16, 4)  # the trainer benches' round
    assert (quick_run.prompts.per_round, quick_run.generator.group_size) == (8, 4)  # the run's
