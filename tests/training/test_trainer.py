"""training/trainer.py on a real curated toy run: the row stream, the lr schedule, every objective
end to end, resume after kill -9, CLI errors. (Fixtures: tests/training/conftest.py.)"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from store.faults import FAULT_ENV
from tests.helpers import REPO, groupforge_in_process, logged_files, step_records
from training import checkpoint as ckpt
from training.config import TrainConfig
from training.schedule import group_units, lr_at, step_rows
from training.trainer import train


def test_step_rows_are_a_seeded_stream_of_permutations():
    # 10 rows, batches of 4: steps 1..5 cover epoch 0 (10 rows) then half of epoch 1.
    rows = [step_rows(10, 4, seed=3, segment_start=0, step=s) for s in range(1, 6)]
    assert all(len(r) == 4 for r in rows)
    first_epoch = sorted(list(rows[0]) + list(rows[1]) + list(rows[2][:2]))
    assert first_epoch == list(range(10))
    assert list(step_rows(10, 4, seed=3, segment_start=0, step=2)) == list(rows[1])  # pure function
    assert list(step_rows(10, 4, seed=4, segment_start=0, step=1)) != list(rows[0])
    assert sorted(step_rows(3, 8, seed=0, segment_start=5, step=6)) == [0, 1, 2]  # batch capped at the rows


def test_step_rows_by_group_keep_each_group_together():
    groups = np.array([2, 0, 1, 2, 3, 0, 2, 4, 3, 1, 2, 4])  # 12 rows in 5 groups, not adjacent
    rows = [step_rows(12, 4, seed=1, segment_start=0, step=s, units=groups) for s in range(1, 7)]
    epoch = np.concatenate(rows[:3])
    assert sorted(epoch) == list(range(12))  # an epoch is a permutation of the rows
    stream = groups[epoch]
    assert [g for i, g in enumerate(stream) if i == 0 or g != stream[i - 1]] == list(dict.fromkeys(stream))
    assert all(list(epoch[stream == g]) == sorted(epoch[stream == g]) for g in range(5))  # row order inside
    assert not np.array_equal(np.concatenate(rows[3:]), epoch)  # the next epoch, another group order
    assert np.array_equal(step_rows(12, 4, seed=1, segment_start=0, step=2, units=groups), rows[1])  # pure
    # per_group=2: a group's rows in runs of two (its 1st and 2nd row, its 3rd and 4th, ...)
    halves = np.concatenate([step_rows(12, 4, seed=1, segment_start=0, step=s, units=group_units(groups, 2))
                             for s in (1, 2, 3)])
    assert sorted(halves) == list(range(12))
    pairs = {tuple(sorted(halves[i : i + 2])) for i in range(0, 12, 2)}
    assert pairs == {(0, 3), (6, 10), (2, 9), (1, 5), (4, 8), (7, 11)}


def test_share_prompts_trains_on_policy_and_is_not_for_pairwise(run_copy, toy_dir):
    cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=256, lr=1e-4, share_prompts=True)
    train(run_copy, cfg, steps=2, model=toy_dir / "model")
    first, second = step_records(run_copy)
    # step 1: the shared layout's log-probs are the sampler's (same weights, same positions)
    assert first["behavior_logp_gap"] < 1e-4 and first["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert second["grad_norm"] > 0 and first["rows"] == 32
    with pytest.raises(ValueError, match="share_prompts is for the policy objectives"):
        TrainConfig(objective="pairwise", share_prompts=True)


def test_held_tables_train_exactly_as_the_files(curated_run, toy_dir, tmp_path):
    from store.fingerprints import fingerprint_file
    from store.run_store import HeldPart, RunStore

    records = []
    for name in ("files", "held"):
        run = tmp_path / name
        shutil.copytree(curated_run, run)
        store = RunStore(run, hold=True)
        store.held.update({path.relative_to(run).as_posix(): HeldPart(fingerprint_file(path), pq.read_table(path))
                           for table in ("samples", "groups") for path in logged_files(run, table)})
        cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=256, lr=1e-4, share_prompts=True)
        train(store if name == "held" else run, cfg, steps=2, model=toy_dir / "model")
        records.append([{k: v for k, v in r.items() if k not in ("seconds", "tokens_per_s")}
                        for r in step_records(run)])
    assert records[0] == records[1] and len(records[0]) == 2


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1, decay_steps=12)
    assert lr_at(1, cfg, 12) == pytest.approx(0.5)
    assert lr_at(2, cfg, 12) == pytest.approx(1.0)
    assert lr_at(7, cfg, 12) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_at(12, cfg, 12) == pytest.approx(0.1)
    assert lr_at(50, cfg, 12) == pytest.approx(0.1)
    assert lr_at(9, TrainConfig(lr=0.3), 12) == 0.3


def test_grpo_steps_write_metrics_and_a_loadable_checkpoint(run_copy, toy_dir):
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=256, lr=1e-4)
    result = train(run_copy, cfg, steps=3, model=toy_dir / "model")
    assert (result.start_step, result.end_step, result.skipped) == (0, 3, False)
    records = step_records(run_copy)
    assert [r["step"] for r in records] == [1, 2, 3]
    first = records[0]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "clip_frac_low", "clip_frac_high", "ratio_mean",
                "ratio_min", "ratio_max", "micro_batches"):
        assert key in first, key
    assert first["micro_batches"] > 1  # the budget forced gradient accumulation
    # Step 1 trains on samples of policy_version 0 with the weights that sampled them: the
    # trainer's log-probs must equal behavior_logprobs (token alignment, temperature, masks).
    assert first["behavior_logp_gap"] < 1e-4
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-3) and first["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    folder = result.checkpoint
    assert folder == ckpt.checkpoint_dir(run_copy, 3)
    model = AutoModelForCausalLM.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(toy_dir / "model")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    assert (folder / "tokenizer.json").is_file() and (folder / "optimizer" / "state.safetensors").is_file()
    # Rerunning to the same step is a no-op; the next call continues from the checkpoint.
    assert train(run_copy, cfg, steps=3, model=toy_dir / "model").skipped
    assert train(run_copy, cfg, steps=4).start_step == 3
    assert [r["step"] for r in step_records(run_copy)] == [1, 2, 3, 4]


@pytest.mark.parametrize("objective,extra", [
    ("gspo", {}),
    ("gspo_token", {}),
    ("grpo", {"beta": 0.05, "kl": "k3", "agg": "token-mean", "old_logprobs": "recompute"}),
    ("pairwise", {"reference": True}),
    ("pairwise", {"length_normalize": True, "gamma": 0.1, "beta": 2.0}),
    ("sft", {"agg": "seq-mean-token-sum-norm"}),
    ("cispo", {"agg": "token-mean", "beta": 0.05, "kl": "k3_clamped"}),
])
def test_every_objective_trains(run_copy, toy_dir, objective, extra):
    cfg = TrainConfig(objective=objective, batch_size=16, token_budget=200, lr=1e-4, **extra)
    train(run_copy, cfg, steps=2, model=toy_dir / "model")
    records = step_records(run_copy)
    assert [r["step"] for r in records] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["grad_norm"] > 0 for r in records)
    if objective == "pairwise":
        assert "reward_accuracy" in records[0]
    # bypass mode (old = behavior) has no second log-prob to compare; decoupled mode measures it
    assert ("mismatch_kl_k3" in records[0]) == (extra.get("old_logprobs") == "recompute")
    if extra.get("old_logprobs") == "recompute":
        # old_logp recomputed by these weights: on-policy at step 1.
        assert records[0]["ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert records[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert list((run_copy / "_train").glob("old_logprobs-*.safetensors"))


@pytest.mark.parametrize("objective,mode", [("grpo", "token_truncate"), ("gspo", "sequence_mask")])
def test_decoupled_mode_measures_the_mismatch_and_weights_the_loss(run_copy, toy_dir, objective, mode):
    cfg = TrainConfig(objective=objective, batch_size=64, token_budget=400, lr=1e-4, old_logprobs="recompute",
                      rollout_correction=mode, correction_floor=0.5, rounds=[0, 1])
    train(run_copy, cfg, steps=2, model=toy_dir / "model")
    first = step_records(run_copy)[0]
    # the transformers generator sampled with these very fp32 weights: old and behavior agree
    # k3 = exp(d) - 1 - d >= 0; float rounding of a near-zero d leaves it within 1e-8 of 0 either side
    assert -1e-8 <= first["mismatch_kl_k3"] < 1e-4 and first["old_behavior_gap"] < 1e-3
    assert first["is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and first["is_weight_max"] < 1.01
    assert ("is_truncated_frac" if mode.endswith("truncate") else "is_masked_frac") in first
    assert {"old_behavior_gap_lag0", "old_behavior_gap_lag1"} <= set(first)  # rounds 1 and 0


@pytest.mark.parametrize("truncated", [True, False])
def test_top_k_samples_are_on_policy_at_step_one(toy_dir, tmp_path, truncated):
    """Sampled with top_k = 3 at T = 0.8 (transformers: its warped scores are the behavior
    log-probs): the trainer's first step, at the weights that sampled, sees ratio 1 only when
    it computes its log-probs under the same truncation."""
    from curation.stages.runner import run_stage
    from pipelines.loop.curate import STAGES, CurationSpec
    from tests.helpers import make_toy_run

    run_dir = make_toy_run(toy_dir, tmp_path, "train", n_prompts=16, group_size=8, max_tokens=6, rounds=(0,),
                           temperature=0.8, top_k=3)
    for stage in STAGES:
        run_stage(stage, run_dir, 0, getattr(CurationSpec(filter={"drop_duplicates": False}), stage))
    cfg = TrainConfig(batch_size=10_000, lr=1e-4, truncated_logprobs=truncated)
    train(run_dir, cfg, steps=1, model=toy_dir / "model")
    first = step_records(run_dir)[0]
    if truncated:
        assert first["ratio_min"] == pytest.approx(1.0, abs=1e-4) and first["ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert first["behavior_logp_gap"] < 1e-5
    else:  # the full softmax puts mass on tokens the sampler never could draw: ratio < 1
        assert first["ratio_min"] < 0.99 and first["behavior_logp_gap"] > 1e-3


def test_sft_loss_goes_down_on_fixed_data(run_copy, toy_dir):
    cfg = TrainConfig(objective="sft", batch_size=10_000, lr=3e-4)  # the whole set every step
    train(run_copy, cfg, steps=8, model=toy_dir / "model")
    losses = [r["loss"] for r in step_records(run_copy)]
    assert losses[-1] < 0.8 * losses[0], losses


def _cli(run_dir, *args, env=None):
    """`groupforge train RUN args`: in this process, or with `env` (a fault point that kills it) in a child."""
    if env is None:
        return groupforge_in_process("train", run_dir, *args)
    cmd = [sys.executable, "-m", "pipelines.cli", "train", str(run_dir), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def test_kill_during_training_then_resume_reproduces_the_loss_sequence(curated_run, toy_dir, tmp_path):
    args = ["--model", str(toy_dir / "model"), "--objective", "grpo", "--batch-size", "24", "--lr", "3e-4",
            "--token-budget", "256", "--steps", "5", "--save-every", "2"]
    straight = tmp_path / "straight"
    shutil.copytree(curated_run, straight)
    done = _cli(straight, *args)
    assert done.returncode == 0, done.stderr

    killed = tmp_path / "killed"
    shutil.copytree(curated_run, killed)
    # Killed after step 3 is logged, before step 4's checkpoint: the newest checkpoint is step 2.
    crash = _cli(killed, *args, env={FAULT_ENV: "train.step_logged:3"})
    assert crash.returncode == -9, crash.stderr
    assert [r["step"] for r in step_records(killed)] == [1, 2, 3]
    assert ckpt.latest_checkpoint(killed) == ckpt.checkpoint_dir(killed, 2)
    resumed = _cli(killed, *args)
    assert resumed.returncode == 0, resumed.stderr

    a, b = step_records(straight), step_records(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]  # step 3 recomputed, not duplicated
    for key in ("loss", "grad_norm", "ratio_mean", "clip_frac_high"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa = ckpt.load_trainer_state(ckpt.latest_checkpoint(straight))
    wb = ckpt.load_trainer_state(ckpt.latest_checkpoint(killed))
    assert wa["step"] == wb["step"] == 5 and wa["data"] == wb["data"]


def test_cli_errors_are_clear(run_copy, toy_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nobjective = 'grpo'\nlearning_rate = 1e-4\n")
    out = _cli(run_copy, "--steps", "1", "--model", str(toy_dir / "model"), "--config", str(bad))
    assert out.returncode == 2 and "train.learning_rate" in out.stderr and str(bad) in out.stderr
    out = _cli(run_copy, "--steps", "1")
    assert out.returncode == 2 and "no checkpoint to resume and no base model" in out.stderr
    out = _cli(run_copy, "--steps", "1", "--model", str(toy_dir / "model"), "--objective", "ppo")
    assert out.returncode == 2 and "objective" in out.stderr
    out = _cli(run_copy, "--steps", "1", "--model", str(toy_dir / "model"), "--objective", "pairwise", "--beta", "0")
    assert out.returncode == 2 and "beta > 0" in out.stderr
    out = _cli(run_copy, "--steps", "1", "--model", str(toy_dir / "model"), "--rounds", "5")
    assert out.returncode == 2 and "round(s) [5]" in out.stderr


def test_grad_noise_measures_each_step_without_changing_the_weights(curated_run, toy_dir, tmp_path):
    from safetensors.torch import load_file

    from training.data import load_training_data

    runs = {}
    for on in (False, True):
        runs[on] = tmp_path / f"grad_noise_{on}"
        shutil.copytree(curated_run, runs[on])
        cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=256, lr=1e-4, grad_noise=on)
        train(runs[on], cfg, steps=3, model=toy_dir / "model")
    off_weights, on_weights = (load_file(ckpt.checkpoint_dir(runs[on], 3) / "model.safetensors") for on in (0, 1))
    assert off_weights.keys() == on_weights.keys()
    assert all(torch.equal(off_weights[k], on_weights[k]) for k in off_weights)  # bit for bit
    timing = ("seconds", "tokens_per_s")
    names = ("grad_signal", "grad_noise", "grad_snr")
    data = load_training_data(runs[True], "grpo", None, None, None)
    advantage = data.table.column("advantage").to_numpy()
    for off, on in zip(step_records(runs[False]), step_records(runs[True]), strict=True):
        assert {k: v for k, v in off.items() if k not in timing} == \
               {k: v for k, v in on.items() if k not in timing + names}
        assert on["micro_batches"] > 1 and all(math.isfinite(on[k]) for k in names)
        assert on["grad_noise"] > 0 and on["grad_snr"] >= 0
        # signal + noise / B = ||step gradient||^2 (before clipping: grad_norm)
        assert on["grad_signal"] + on["grad_noise"] / on["rows"] == pytest.approx(on["grad_norm"] ** 2, rel=1e-4)
        rows = step_rows(data.table.num_rows, 32, 0, 0, on["step"])
        assert on["zero_adv_frac"] == pytest.approx(float((abs(advantage[rows]) < 1e-6).mean()), abs=1e-12)
    # a step of one micro-batch has no estimate
    train(runs[True], TrainConfig(objective="grpo", batch_size=32, token_budget=100_000, grad_noise=True), steps=4)
    last = step_records(runs[True])[-1]
    assert last["micro_batches"] == 1 and not set(names) & set(last)


def test_grad_noise_under_two_ddp_ranks_and_refused_with_fsdp2(curated_run, toy_dir, tmp_path):
    """Parts are every rank's micro-batches: their sums go over the ranks like the gradient."""
    from pydantic import ValidationError
    from safetensors.torch import load_file

    settings = dict(objective="grpo", dtype="float64", batch_size=24, token_budget=160, lr=1e-3, seed=3)
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    shutil.copytree(curated_run, single)
    shutil.copytree(curated_run, ddp)
    train(single, TrainConfig(**settings, grad_noise=True), steps=2, model=toy_dir / "model")
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "pipelines.cli", "train", str(ddp), "--steps", "2", "--model", str(toy_dir / "model"), "--strategy",
           "ddp", "--grad-noise", *flags]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    a, b = load_file(ckpt.checkpoint_dir(single, 2) / "model.safetensors"), \
        load_file(ckpt.checkpoint_dir(ddp, 2) / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-9
    for one, two in zip(step_records(single), step_records(ddp), strict=True):
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-9)
        assert two["zero_adv_frac"] == one["zero_adv_frac"]
        assert two["micro_batches"] >= 2 and two["grad_noise"] > 0
        # the two ranks' micro-batches split the step differently, but gbar is the same gradient
        assert two["grad_signal"] + two["grad_noise"] / two["rows"] == pytest.approx(two["grad_norm"] ** 2, rel=1e-9)
        assert one["grad_signal"] + one["grad_noise"] / one["rows"] == pytest.approx(one["grad_norm"] ** 2, rel=1e-9)
    with pytest.raises(ValidationError, match="grad_noise is not supported with strategy = 'fsdp2'"):
        TrainConfig(strategy="fsdp2", grad_noise=True)
