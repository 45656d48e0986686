"""What the round loop uses of training/trainer.py, on a real curated toy run: several passes
over a round's rows (off-policy and clipped after the first), the timing fields, the weights
handed back without a checkpoint, and a live TrainSession that skips checkpoints and still
resumes deterministically. (Fixtures: tests/training/conftest.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from store.weights import load_state_dict
from tests.helpers import step_records
from training import checkpoint as ckpt
from training.config import TrainConfig, steps_for_passes
from training.data import count_training_rows
from training.trainer import LoopOptions, TrainSession, train

COMPARED = ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_low", "pass")


def test_passes_train_ceil_passes_rows_over_batch_steps_and_later_passes_are_off_policy(run_copy, toy_dir):
    rows = count_training_rows(run_copy, "grpo")
    cfg = TrainConfig(objective="grpo", batch_size=64, token_budget=2048, lr=1e-4, passes=2)
    expected = steps_for_passes(rows, 64, 2)
    assert expected == -(-2 * rows // 64) > 2
    result = train(run_copy, cfg, steps=1000, model=toy_dir / "model")  # passes stop it first
    assert (result.start_step, result.end_step, result.rows) == (0, expected, rows)
    records = step_records(run_copy)
    assert [r["step"] for r in records] == list(range(1, expected + 1))
    passes = [r["pass"] for r in records]
    assert passes == [1 + (s - 1) * 64 // rows for s in range(1, expected + 1)] and passes[-1] == 2
    # Step 1 is on-policy (ratio 1); every step of pass 2 reuses samples of policy_version 0 with
    # weights several steps newer: off-policy w.r.t. behavior_logprobs, and the clip acts.
    assert records[0]["ratio_min"] == pytest.approx(1.0, abs=1e-3) and records[0]["clip_frac_low"] == 0
    second = [r for r in records if r["pass"] == 2]
    assert second and all(abs(r["ratio_max"] - 1) > 1e-2 or abs(r["ratio_min"] - 1) > 1e-2 for r in second)
    assert all(r["clip_frac_low"] + r["clip_frac_high"] > 0 for r in second)
    # Idempotent: the checkpoint's rows are the same rows, so their passes are done.
    again = train(run_copy, cfg, steps=1000)
    assert again.skipped and again.end_step == expected
    # New rows (another selection of rounds) start a new segment of `passes` passes.
    rows_1 = count_training_rows(run_copy, "grpo", rounds=[1])
    more = train(run_copy, cfg.model_copy(update={"rounds": [1]}), steps=1000)
    assert (more.start_step, more.end_step) == (expected, expected + steps_for_passes(rows_1, 64, 2))


def test_timing_fields_and_the_returned_weights(run_copy, toy_dir):
    cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=512, lr=1e-4, save_every=1, keep_last=0)
    result = train(run_copy, cfg, steps=2, model=toy_dir / "model", options=LoopOptions(return_state=True))
    assert result.load_seconds > 0 and result.step_seconds > 0 and result.checkpoint_seconds > 0
    assert result.load_seconds + result.step_seconds + result.checkpoint_seconds <= result.seconds
    assert result.step_seconds == pytest.approx(sum(r["seconds"] for r in step_records(run_copy)), abs=1e-3)
    saved = load_state_dict(ckpt.checkpoint_dir(run_copy, 2))
    weights = result.state_dict
    assert sorted(weights) == sorted(saved)
    assert all(w.device.type == "cpu" and torch.equal(w, saved[name]) for name, w in weights.items())
    skipped = train(run_copy, cfg, steps=2, options=LoopOptions(return_state=True))
    assert skipped.state_dict is None  # skipped: weights on disk


def _rounds(run_dir, toy_dir, session=None, save_first=True, **kwargs):
    """Two 'rounds' of training as the round loop makes them: round 0's rows to step 2, then
    rounds 0 and 1 to step 4."""
    cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=512, lr=1e-4, **kwargs)
    first = train(run_dir, cfg.model_copy(update={"rounds": [0]}), steps=2, model=toy_dir / "model",
                  session=session, options=LoopOptions(save=save_first, return_state=True))
    second = train(run_dir, cfg.model_copy(update={"rounds": [0, 1]}), steps=4, model=toy_dir / "model",
                   session=session)
    return first, second


def test_a_session_skips_checkpoints_and_gives_the_same_weights(curated_run, toy_dir, tmp_path):
    plain, live = tmp_path / "plain", tmp_path / "live"
    shutil.copytree(curated_run, plain)
    shutil.copytree(curated_run, live)
    _rounds(plain, toy_dir)

    session = TrainSession()
    first, second = _rounds(live, toy_dir, session=session, save_first=False)
    # Round 0's weights came back without a checkpoint: only step 4 is on disk.
    assert first.checkpoint is None and ckpt.checkpoint_steps(live) == [4]
    assert first.state_dict is not None and second.start_step == 2
    assert session.live and session.step == 4
    for key in COMPARED:
        assert [r[key] for r in step_records(plain)] == [r[key] for r in step_records(live)], key
    a, b = load_state_dict(ckpt.checkpoint_dir(plain, 4)), load_state_dict(ckpt.checkpoint_dir(live, 4))
    assert all(torch.equal(a[name], b[name]) for name in a)
    # The handed-back weights are a copy: training on in the session did not change them.
    assert any(not torch.equal(first.state_dict[name], b[name]) for name in b)
    skipped = train(live, TrainConfig(rounds=[0, 1], batch_size=32), steps=4, session=session,
                    options=LoopOptions(return_state=True))
    assert skipped.state_dict is not None  # skipped, but the session holds the weights


def test_a_killed_session_run_replays_from_the_newest_checkpoint(curated_run, toy_dir, tmp_path):
    """Round 0 skipped its checkpoint, then the process died: nothing of it is on disk but its
    metrics lines. Replaying both calls (what the round loop does) recomputes the same steps."""
    plain, killed = tmp_path / "plain", tmp_path / "killed"
    shutil.copytree(curated_run, plain)
    shutil.copytree(curated_run, killed)
    _rounds(plain, toy_dir)
    cfg = TrainConfig(objective="grpo", batch_size=32, token_budget=512, lr=1e-4, rounds=[0])
    train(killed, cfg, steps=2, model=toy_dir / "model", session=TrainSession(), options=LoopOptions(save=False))
    assert ckpt.latest_checkpoint(killed) is None and len(step_records(killed)) == 2
    _rounds(killed, toy_dir, session=TrainSession(), save_first=False)  # a new process, a new session
    for key in COMPARED:
        assert [r[key] for r in step_records(plain)] == [r[key] for r in step_records(killed)], key


def test_a_failed_call_leaves_the_session_empty(run_copy, toy_dir):
    session = TrainSession()
    train(run_copy, TrainConfig(batch_size=32, token_budget=512, rounds=[0]), steps=1, model=toy_dir / "model",
          session=session, options=LoopOptions(save=False))
    assert session.live and session.step == 1

    def interrupted(done, total, metrics):  # after step 2's update: the weights have changed
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run_copy, TrainConfig(batch_size=32, token_budget=512, rounds=[0]), steps=3, session=session,
              progress=interrupted)
    assert not session.live  # the next call loads from disk instead of half-trained weights
