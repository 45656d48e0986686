"""What an optimizer step measures beside its gradient: StepMeasurements.

The step (training.step.accumulate_gradients) hands each micro-batch to `add` after its
backward pass and merges `sums` into the sums it adds over the ranks; `result` turns the
summed values into the step's metrics:

    behavior_logp_gap        mean |logp - old_logp| over the response tokens of samples drawn
                             by these very weights (policy_version): the train/sample mismatch
                             where it should be 0
    old_behavior_gap_lag0    in decoupled mode (old and behavior log-probs both there): mean
    ... _lag1, _lag2+        |old - behavior| over the response tokens of rows 0, 1 and 2 or
                             more rounds older than the table's newest round
    grad_signal, grad_noise  with grad_noise and K >= 2 micro-batches over all ranks,
    grad_snr                 training.grad_noise's estimates with the micro-batches as the parts

The gradient is only read: measuring leaves it bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from training.grad_noise import grad_noise_from_sums

if TYPE_CHECKING:
    from training.batching import MicroBatch
    from training.step import MicroStep, StepContext

__all__ = ["LAG_BUCKETS", "StepMeasurements"]

LAG_BUCKETS = ("lag0", "lag1", "lag2+")
"""old_behavior_gap_<bucket>: rows 0, 1, and 2 or more rounds older than the newest."""


class StepMeasurements:
    """One step's measurements (module docstring), fed one micro-batch at a time."""

    def __init__(self, params: list[torch.nn.Parameter], *, policy_version: int, behavior_gap: bool,
                 grad_noise: bool):
        self.params = params
        self.policy_version = policy_version
        """The step's weights: behavior_logp_gap counts the samples this version drew."""
        self.behavior_gap = behavior_gap
        self.parts = PartGradients(params) if grad_noise else None
        self.sums: dict[str, float] = {}
        """Per-rank sums; the step adds them over the ranks before `result`."""

    @classmethod
    def of(cls, ctx: StepContext, policy_version: int) -> StepMeasurements:
        """What the run's StepContext asks to measure (measure_gap, grad_noise)."""
        params = [p for p in ctx.policy.parameters() if p.requires_grad]
        return cls(params, policy_version=policy_version, behavior_gap=ctx.measure_gap, grad_noise=ctx.grad_noise)

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def add(self, mb: MicroBatch, out: MicroStep) -> None:
        """The micro-batch `mb` (on the step's device), whose loss `out` was just backpropagated."""
        if self.behavior_gap and mb.old_logp is not None and mb.policy_version is not None:
            same = mb.policy_version == self.policy_version
            if same.any():
                sel = mb.target_mask & same[:, None]
                self._add("gap_sum", float((out.logp.detach() - mb.old_logp).abs()[sel].sum()))
                self._add("gap_tokens", int(sel.sum()))
        if mb.behavior_logp is not None and mb.old_logp is not None and mb.staleness is not None:
            gap = (mb.old_logp - mb.behavior_logp).abs()
            buckets = (mb.staleness == 0, mb.staleness == 1, mb.staleness >= 2)
            for bucket, rows in zip(LAG_BUCKETS, buckets):
                sel = mb.target_mask & rows[:, None]
                if sel.any():
                    self._add(f"lag_sum:{bucket}", float(gap[sel].sum()))
                    self._add(f"lag_tokens:{bucket}", int(sel.sum()))
        if self.parts is not None:
            self._add("grad_parts", 1)
            self._add("grad_part_sq", self.parts.add(out.weight))

    def result(self, sums: dict[str, float], batch_size: float) -> dict[str, float]:
        """The metrics from `sums` (this object's keys, summed over the ranks) and the step's
        summed gradient; `batch_size`: B, the step's sequences (pairs)."""
        metrics = {}
        if sums.get("gap_tokens"):
            metrics["behavior_logp_gap"] = sums["gap_sum"] / sums["gap_tokens"]
        for bucket in LAG_BUCKETS:
            if sums.get(f"lag_tokens:{bucket}"):
                metrics[f"old_behavior_gap_{bucket}"] = sums[f"lag_sum:{bucket}"] / sums[f"lag_tokens:{bucket}"]
        if self.parts is not None and sums.get("grad_parts", 0) >= 2:
            # g_k = B c_k / n_k, so sum_k n_k ||g_k||^2 = B^2 sum_k ||c_k||^2 / n_k; gbar: the summed gradient
            B = batch_size
            est = grad_noise_from_sums(B * B * sums["grad_part_sq"], squared_grad_norm(self.params), B,
                                       int(sums["grad_parts"]))
            metrics.update(grad_signal=est.signal, grad_noise=est.noise)
            if est.snr is not None:
                metrics["grad_snr"] = est.snr
        return metrics


class PartGradients:
    """grad_noise: each micro-batch's contribution to the step gradient, c_k = p.grad after its
    backward - p.grad before, read (p.grad keeps accumulating untouched) as float64 copies on the
    CPU: one copy of the gradient, however many micro-batches."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.before: list[torch.Tensor | None] = [None] * len(params)

    def add(self, n: int) -> float:
        """||c_k||^2 / n_k of the micro-batch just backpropagated, of `n` sequences (pairs)."""
        sq = 0.0
        for i, p in enumerate(self.params):
            if p.grad is None:  # no micro-batch reached it yet
                continue
            now = p.grad.detach().to("cpu", torch.float64, copy=True)
            diff = now if self.before[i] is None else now - self.before[i]
            sq += float((diff * diff).sum())
            self.before[i] = now
        return sq / n


def squared_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """||grad||^2 over the parameters' current gradients, in float64."""
    return sum(float(p.grad.detach().double().pow(2).sum()) for p in params if p.grad is not None)
