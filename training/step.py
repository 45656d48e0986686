"""One optimizer step's gradient: the step's context, the micro-steps, gradient accumulation.

A micro-batch's forward and loss is `policy_micro_step` (grpo, gspo, gspo_token, cispo, sft) or
`pair_micro_step` (pairwise), chosen once per run; both read a frozen `StepContext` (the
models, the loss and its ObjectiveConfig, temperature, pad id, device, autocast), and
`accumulate_gradients` runs one of them over a step's micro-batches, each loss normalised by
the step's totals, so any split into micro-batches gives the one-batch gradient. What the
step measures beside its gradient (behavior log-prob gaps, gradient noise) is a
`training.measurements.StepMeasurements` that the step feeds each micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from training.batching import MicroBatch, step_normalizer
from training.correction import CorrectionConfig, correction_weights, mismatch_metrics
from training.distributed import StepSync
from training.logprobs import token_logprobs
from training.measurements import StepMeasurements
from training.objectives import Metrics, Normalizer, ObjectiveConfig

__all__ = ["ZERO_ADVANTAGE", "MicroStep", "StepContext", "accumulate_gradients", "pair_micro_step",
           "policy_micro_step"]

ZERO_ADVANTAGE = 1e-6
"""|advantage| below this counts as zero in zero_adv_frac (a group whose rewards were all equal)."""


@dataclass(frozen=True)
class StepContext:
    """What every micro-step of a run needs; fixed for the run."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    """The frozen reference model (pairwise with `reference`, policy losses with beta > 0)."""
    loss: Callable[..., tuple[torch.Tensor, Metrics]]
    """The checked loss of the objective (get_policy_loss / get_pair_loss)."""
    objective: ObjectiveConfig
    temperature: float
    """logp = log softmax(z / temperature): the rounds' sampling temperature."""
    pad_id: int
    device: torch.device
    autocast: bool
    """Forward passes under bfloat16 autocast."""
    measure_gap: bool
    """Report behavior_logp_gap (old_logp are the generator's behavior log-probs)."""
    correction: CorrectionConfig | None = None
    """Rollout correction (decoupled mode; training.correction), None: off."""
    top_k: int = 0
    top_p: float = 1.0
    """The sampler's truncation: logp and old_logp are computed under it (training.logprobs)."""
    grad_noise: bool = False
    """Measure grad_signal, grad_noise and grad_snr from the micro-batches' gradients
    (TrainConfig.grad_noise); off: nothing is read or kept."""

    def logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """(b, L-1) log-probs of `model` at mb's positions (0 where target_mask is False)."""
        # FSDP2 (training/fsdp.py): through the registered forward method, which unshards the weights
        compute = getattr(model, "groupforge_logprobs", None) or (lambda *a, **k: token_logprobs(model, *a, **k))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return compute(mb.input_ids, mb.attention_mask, mb.target_mask,
                           temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, shared=mb.shared)

    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            return self.logprobs(self.reference, mb)


class MicroStep(NamedTuple):
    """A micro-batch's loss (its share of the step loss, not yet backpropagated) and metrics."""

    loss: torch.Tensor
    metrics: Metrics
    weight: int
    """Sequences (pairwise: pairs) the metrics describe; the step averages them by it."""
    logp: torch.Tensor
    """The policy's log-probs of the micro-batch, for behavior_logp_gap."""


def policy_micro_step(ctx: StepContext, mb: MicroBatch, norm: Normalizer) -> MicroStep:
    """grpo, gspo, gspo_token, cispo, sft: loss(logp, old_logp, advantages, mask) on b sequences;
    in decoupled mode (the batch has behavior_logp) also the mismatch metrics, and with a
    rollout correction its weights (`is_weight`) and their metrics. zero_adv_frac: the share of
    the b sequences with |advantage| < ZERO_ADVANTAGE, which give no policy gradient (sft: of
    the kept samples' advantages, which its loss does not use)."""
    logp = ctx.logprobs(ctx.policy, mb)
    ref_logp = ctx.reference_logprobs(mb)
    mask = mb.target_mask.to(logp.dtype)
    extra, weights = {}, {}
    if mb.behavior_logp is not None and mb.old_logp is not None:
        extra = mismatch_metrics(mb.old_logp, mb.behavior_logp, mask)
        if ctx.correction is not None and ctx.correction.on:
            weights["is_weight"], correction = correction_weights(mb.old_logp, mb.behavior_logp, mask, ctx.correction)
            extra.update(correction)
    loss, metrics = ctx.loss(logp, mb.old_logp, mb.advantages, mask, ctx.objective, ref_logp=ref_logp, norm=norm,
                             **weights)
    metrics.update({key: float(value) for key, value in extra.items()})
    metrics["zero_adv_frac"] = float((mb.advantages.abs() < ZERO_ADVANTAGE).double().mean())
    return MicroStep(loss, metrics, weight=mb.input_ids.shape[0], logp=logp)


def pair_micro_step(ctx: StepContext, mb: MicroBatch, norm: Normalizer) -> MicroStep:
    """pairwise: rows 0..k-1 of the micro-batch are the chosen sequences, k..2k-1 the
    rejected ones of the same k pairs."""
    k = mb.num_pairs
    logp = ctx.logprobs(ctx.policy, mb)
    ref_logp = ctx.reference_logprobs(mb)
    mask = mb.target_mask.to(logp.dtype)
    loss, metrics = ctx.loss(logp[:k], logp[k:], mask[:k], mask[k:], mb.soft_label, mb.weight, ctx.objective,
                             ref_chosen_logp=None if ref_logp is None else ref_logp[:k],
                             ref_rejected_logp=None if ref_logp is None else ref_logp[k:], norm=norm)
    return MicroStep(loss, metrics, weight=k, logp=logp)


def accumulate_gradients(ctx: StepContext, micro_step: Callable[[StepContext, MicroBatch, Normalizer], MicroStep],
                         batches: list[MicroBatch], policy_version: int, sync: StepSync | None = None,
                         measurements: StepMeasurements | None = None) -> dict[str, float]:
    """Forward and backward over the step's micro-batches, each loss normalised by the
    step's totals (so the gradient is the one-batch gradient however the step is split).
    Returns the step's metrics: loss is the full-batch loss; the objective's metrics are
    averaged, weighted by sequences (pairs); tokens, response_tokens and micro_batches are
    counts; and `measurements`' results (training.measurements; default: what ctx asks for,
    at `policy_version`), each micro-batch handed to it after its backward pass.

    `sync` (training.distributed): the step's counts, gradients and metric sums are summed
    over the ranks, each rank holding its shard of the step's rows in `batches` (possibly
    none); without it this process is the whole step."""
    sync = sync or StepSync(ctx.device)
    measurements = measurements or StepMeasurements.of(ctx, policy_version)
    norm = sync.normalizer(step_normalizer(batches) if batches else Normalizer(0.0, 0.0))
    sums: dict[str, float] = {}  # summed over the ranks before the metrics are formed

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    for mb in batches:
        mb = mb.to(ctx.device)
        out = micro_step(ctx, mb, norm)
        out.loss.backward()
        measurements.add(mb, out)
        add("loss", float(out.loss.detach()))
        for key, value in out.metrics.items():
            add(f"metric:{key}", float(value) * out.weight)
        add("weight", out.weight)
        add("tokens", int(mb.attention_mask.sum()))
        add("response_tokens", int(mb.target_mask.sum()))
        add("micro_batches", 1)
    sync.gradients([p for p in ctx.policy.parameters() if p.requires_grad])
    sums = sync.sums({**sums, **measurements.sums})
    weight = sums.get("weight", 0.0) or 1.0
    metrics = {key.removeprefix("metric:"): value / weight for key, value in sums.items() if key.startswith("metric:")}
    metrics.update(loss=sums.get("loss", 0.0), tokens=int(sums.get("tokens", 0)),
                   response_tokens=int(sums.get("response_tokens", 0)), micro_batches=int(sums.get("micro_batches", 0)))
    metrics.update(measurements.result(sums, norm.num_seqs))
    return metrics
