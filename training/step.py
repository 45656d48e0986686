"""One optimizer step's gradient: the step's context, the micro-steps, gradient accumulation.

A micro-batch's forward and loss is `policy_micro_step` (grpo, gspo, gspo_token, sft) or
`pair_micro_step` (pairwise), chosen once per run; both read a frozen `StepContext` (the
models, the loss and its ObjectiveConfig, temperature, pad id, device, autocast), and
`accumulate_gradients` runs one of them over a step's micro-batches, each loss normalised by
the step's totals, so any split into micro-batches gives the one-batch gradient. With
`StepContext.grad_noise` it also measures the step's gradient signal and noise from the
micro-batches' gradients (training.grad_noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from training.batching import MicroBatch, step_normalizer
from training.correction import CorrectionConfig, correction_weights, mismatch_metrics
from training.distributed import StepSync
from training.grad_noise import grad_noise_from_sums
from training.logprobs import token_logprobs
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
    """grpo, gspo, gspo_token, sft: loss(logp, old_logp, advantages, mask) on b sequences;
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
                         batches: list[MicroBatch], policy_version: int,
                         sync: StepSync | None = None) -> dict[str, float]:
    """Forward and backward over the step's micro-batches, each loss normalised by the
    step's totals (so the gradient is the one-batch gradient however the step is split).
    Returns the step's metrics: loss is the full-batch loss; the objective's metrics are
    averaged, weighted by sequences (pairs); behavior_logp_gap is the mean |logp - old_logp|
    over response tokens of samples drawn by these very weights (policy_version); in
    decoupled mode old_behavior_gap_lag0 / _lag1 / _lag2+ are the mean |old - behavior| over
    the response tokens of rows 0, 1 and 2 or more rounds older than the newest.

    With ctx.grad_noise and K >= 2 micro-batches (over all ranks), training.grad_noise's
    estimates with the micro-batches as the parts: grad_signal (||E G||^2, unbiased, may be
    < 0), grad_noise (tr Sigma of the per-sample gradients) and grad_snr (max(signal, 0) /
    (noise / B), absent when noise is 0), B the step's sequences (pairs); absent with K < 2.
    They describe the gradient before clipping; the gradient itself is only read.

    `sync` (training.distributed): the step's counts, gradients and metric sums are summed
    over the ranks, each rank holding its shard of the step's rows in `batches` (possibly
    none); without it this process is the whole step."""
    sync = sync or StepSync(ctx.device)
    norm = sync.normalizer(step_normalizer(batches) if batches else Normalizer(0.0, 0.0))
    sums: dict[str, float] = {}  # summed over the ranks before the metrics are formed

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    params = [p for p in ctx.policy.parameters() if p.requires_grad]
    parts = _PartGradients(params) if ctx.grad_noise else None
    for mb in batches:
        mb = mb.to(ctx.device)
        out = micro_step(ctx, mb, norm)
        if ctx.measure_gap and mb.old_logp is not None and mb.policy_version is not None:
            # The train/sample mismatch, measured where the weights are the ones that
            # sampled: samples of this policy version.
            same = mb.policy_version == policy_version
            if same.any():
                sel = mb.target_mask & same[:, None]
                add("gap_sum", float((out.logp.detach() - mb.old_logp).abs()[sel].sum()))
                add("gap_tokens", int(sel.sum()))
        if mb.behavior_logp is not None and mb.old_logp is not None and mb.staleness is not None:
            gap = (mb.old_logp - mb.behavior_logp).abs()
            buckets = (("lag0", mb.staleness == 0), ("lag1", mb.staleness == 1), ("lag2+", mb.staleness >= 2))
            for bucket, rows in buckets:
                sel = mb.target_mask & rows[:, None]
                if sel.any():
                    add(f"lag_sum:{bucket}", float(gap[sel].sum()))
                    add(f"lag_tokens:{bucket}", int(sel.sum()))
        out.loss.backward()
        if parts is not None:
            add("grad_parts", 1)
            add("grad_part_sq", parts.add(out.weight))
        add("loss", float(out.loss.detach()))
        for key, value in out.metrics.items():
            add(f"metric:{key}", float(value) * out.weight)
        add("weight", out.weight)
        add("tokens", int(mb.attention_mask.sum()))
        add("response_tokens", int(mb.target_mask.sum()))
        add("micro_batches", 1)
    sync.gradients(params)
    sums = sync.sums(sums)
    weight = sums.get("weight", 0.0) or 1.0
    metrics = {key.removeprefix("metric:"): value / weight for key, value in sums.items() if key.startswith("metric:")}
    metrics.update(loss=sums.get("loss", 0.0), tokens=int(sums.get("tokens", 0)),
                   response_tokens=int(sums.get("response_tokens", 0)), micro_batches=int(sums.get("micro_batches", 0)))
    if sums.get("gap_tokens"):
        metrics["behavior_logp_gap"] = sums["gap_sum"] / sums["gap_tokens"]
    for bucket in ("lag0", "lag1", "lag2+"):
        if sums.get(f"lag_tokens:{bucket}"):
            metrics[f"old_behavior_gap_{bucket}"] = sums[f"lag_sum:{bucket}"] / sums[f"lag_tokens:{bucket}"]
    if parts is not None and sums.get("grad_parts", 0) >= 2:
        # g_k = B c_k / n_k, so sum_k n_k ||g_k||^2 = B^2 sum_k ||c_k||^2 / n_k; gbar: the summed gradient
        B = norm.num_seqs
        est = grad_noise_from_sums(B * B * sums["grad_part_sq"], _sq_norm(params), B, int(sums["grad_parts"]))
        metrics.update(grad_signal=est.signal, grad_noise=est.noise)
        if est.snr is not None:
            metrics["grad_snr"] = est.snr
    return metrics


class _PartGradients:
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


def _sq_norm(params: list[torch.nn.Parameter]) -> float:
    return sum(float(p.grad.detach().double().pow(2).sum()) for p in params if p.grad is not None)
