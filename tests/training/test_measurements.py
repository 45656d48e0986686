"""training/measurements.py: the step's behavior-gap and staleness-bucket measurements, by hand."""

from __future__ import annotations

import pytest
import torch

from training.batching import MicroBatch
from training.measurements import StepMeasurements
from training.step import MicroStep


def micro_batch() -> tuple[MicroBatch, MicroStep]:
    """Three rows of two target positions (row 2's second is padding): sampled by policy
    versions 4, 4, 3 and 0, 1, 2 rounds before the newest."""
    target_mask = torch.tensor([[True, True], [True, True], [True, False]])
    mb = MicroBatch(input_ids=torch.ones(3, 3, dtype=torch.long), attention_mask=torch.ones(3, 3, dtype=torch.long),
                    target_mask=target_mask, old_logp=torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, 0.0]]),
                    advantages=torch.zeros(3), rows=torch.arange(3), policy_version=torch.tensor([4, 4, 3]),
                    behavior_logp=torch.tensor([[-1.5, -2.0], [-1.0, -3.0], [-2.0, 9.0]]),
                    staleness=torch.tensor([0, 1, 2]))
    logp = torch.tensor([[-1.25, -2.0], [-1.0, -1.5], [-3.0, 0.0]])
    return mb, MicroStep(loss=torch.tensor(0.0), metrics={}, weight=3, logp=logp)


def test_gaps_by_hand_and_the_same_over_two_micro_batches():
    measurements = StepMeasurements([], policy_version=4, behavior_gap=True, grad_noise=False)
    for _ in range(2):
        measurements.add(*micro_batch())
    # behavior_logp_gap: rows 0 and 1 (version 4): |logp - old| = 0.25, 0, 0, 0.5 over 4 tokens
    # lag0: row 0 |old - behavior| = 0.5, 0; lag1: row 1 = 0, 2; lag2+: row 2's one token = 1
    assert measurements.result(measurements.sums, batch_size=6) == pytest.approx(
        {"behavior_logp_gap": 0.1875, "old_behavior_gap_lag0": 0.25, "old_behavior_gap_lag1": 1.0,
         "old_behavior_gap_lag2+": 1.0})


def test_nothing_is_measured_when_nothing_is_asked_or_no_row_matches():
    off = StepMeasurements([], policy_version=4, behavior_gap=False, grad_noise=False)
    off.add(*micro_batch())
    assert "behavior_logp_gap" not in off.result(off.sums, batch_size=3)
    other_version = StepMeasurements([], policy_version=7, behavior_gap=True, grad_noise=False)
    other_version.add(*micro_batch())
    assert "behavior_logp_gap" not in other_version.result(other_version.sums, batch_size=3)
    assert other_version.parts is None and "grad_parts" not in other_version.sums
