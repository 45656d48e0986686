"""The trainer: read a run's curated tables, take optimizer steps, checkpoint, log metrics.

    groupforge train RUN --objective grpo --steps 100

`train(run_dir, config, model=..., steps=N)` trains until global optimizer step N (the
step count is the policy_version of the weights, continued across calls and rounds):

    resume   the newest complete checkpoint in RUN/checkpoints/ (or the base model at step 0)
    data     training.data: the rows of the objective in the chosen rounds
    model    Hugging Face causal LM (safetensors), AdamW, warmup then constant or cosine lr
    loop     per step: `batch_size` rows from a seeded permutation of the rows, token-budget
             micro-batches, gradient accumulation normalised by the step's totals (so any
             split gives the one-batch gradient), grad clipping, one optimizer step, one line
             in RUN/metrics.jsonl (curation.runlog.MetricsLog)
    save     RUN/checkpoints/step-<k>/ every `save_every` steps and at the end

A micro-batch's forward and loss is `policy_micro_step` (grpo, gspo, gspo_token, sft) or
`pair_micro_step` (pairwise), chosen once per run; both read a frozen `StepContext` (the
models, the loss and its ObjectiveConfig, temperature, pad id, device, autocast), and
`accumulate_gradients` runs one of them over a step's micro-batches.

Resume reproduces an uninterrupted run: which rows a step uses depends only on (seed, the
step, the step at which these rows were first trained on); the optimizer state and the
weights are restored exactly; and the metrics lines of steps after the checkpoint are
dropped before they are recomputed. Callers hold the run's lock (`RunStore.lock()`).
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from curation.runlog import TRAIN_CACHE_DIR, MetricsLog, write_atomic
from training import checkpoint as ckpt
from training.batching import MicroBatch, pair_batches, policy_batches, step_normalizer
from training.config import TrainConfig
from training.data import POLICY_OBJECTIVES, load_training_data
from training.logprobs import token_logprobs
from training.objectives import Metrics, Normalizer, ObjectiveConfig, get_pair_loss, get_policy_loss

__all__ = ["KILL_AFTER_STEP_ENV", "TrainConfig", "TrainResult", "lr_at", "step_rows", "train"]

# Fault injection for resume tests: SIGKILL this process right after step k is logged.
KILL_AFTER_STEP_ENV = "GROUPFORGE_KILL_AFTER_STEP"


@dataclass
class TrainResult:
    """What one `train` call did: steps (start_step, end_step], or nothing when skipped."""

    start_step: int
    end_step: int
    skipped: bool
    checkpoint: Path | None = None
    rows: int = 0
    rounds: list[int] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup, then constant or cosine."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay = cfg.decay_steps or total_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rows(num_rows: int, batch_size: int, seed: int, segment_start: int, step: int) -> np.ndarray:
    """Row indices of optimizer step `step`: consecutive slices of a stream of seeded
    permutations of the rows (epoch e uses permutation e), counted from `segment_start`,
    the step after which these rows were first trained on. Depends on nothing else, so a
    resumed run draws exactly the rows an uninterrupted one would."""
    size = min(batch_size, num_rows)
    first = (step - segment_start - 1) * size
    out = []
    for epoch in range(first // num_rows, (first + size - 1) // num_rows + 1):
        perm = np.random.default_rng([seed, segment_start, epoch]).permutation(num_rows)
        lo, hi = max(first - epoch * num_rows, 0), min(first + size - epoch * num_rows, num_rows)
        out.append(perm[lo:hi])
    return np.concatenate(out)


def train(run_dir: str | Path, cfg: TrainConfig, *, steps: int, model: str | Path | None = None,
          progress: Callable[[int, int, dict], None] | None = None) -> TrainResult:
    """Train until optimizer step `steps`, starting from the newest checkpoint of the run or,
    when there is none, from the model folder `model`."""
    started = time.perf_counter()
    run_dir = Path(run_dir)

    # -- resume or start ------------------------------------------------------------------
    latest = ckpt.latest_checkpoint(run_dir)
    state = ckpt.load_trainer_state(latest) if latest else {}
    start_step = int(state.get("step", 0))
    base_model = Path(state.get("base_model") or model or "")
    if latest is None and (model is None or not (Path(model) / "config.json").is_file()):
        raise ValueError(f"{run_dir}: no checkpoint to resume and no base model folder (got {model!r}; "
                         "it needs a config.json)")
    if start_step >= steps:
        return TrainResult(start_step, start_step, skipped=True, checkpoint=latest,
                           seconds=time.perf_counter() - started)
    metrics_log = MetricsLog(run_dir)
    metrics_log.drop_steps_after(start_step)

    # -- data -------------------------------------------------------------------------------
    data = load_training_data(run_dir, cfg.objective, cfg.rounds, cfg.max_staleness, cfg.sft_min_reward)
    segment = state.get("data") or {}
    if segment.get("fingerprint") != data.fingerprint:  # new rows: a new segment starts here
        segment = {"fingerprint": data.fingerprint, "start_step": start_step, "rounds": data.rounds,
                   "rows": data.num_rows}

    # -- model, optimizer, the step's context -------------------------------------------
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    policy = ckpt.load_model(latest or base_model, device, trainable=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.adam_betas,
                                  weight_decay=cfg.weight_decay)
    if latest is not None:
        ckpt.load_optimizer(optimizer, latest)
    reference = ckpt.load_model(cfg.ref_model or base_model, device) if cfg.uses_reference() else None
    if cfg.objective == "pairwise":
        loss, micro_batches, micro_step = get_pair_loss(cfg.objective), pair_batches, pair_micro_step
    else:
        loss, micro_batches, micro_step = get_policy_loss(cfg.objective), policy_batches, policy_micro_step
    ctx = StepContext(
        policy=policy, reference=reference, loss=loss,
        objective=cfg.objective_config(longest_response=_longest_response(data.table)),
        temperature=cfg.temperature or data.temperature or 1.0,
        pad_id=policy.config.pad_token_id if isinstance(policy.config.pad_token_id, int) else 0,
        device=device, autocast=cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda"),
        measure_gap=cfg.old_logprobs == "generator")
    table = data.table
    if cfg.old_logprobs == "recompute" and cfg.objective in POLICY_OBJECTIVES:
        table = _with_recomputed_logprobs(run_dir, table, segment, start_step, ctx, cfg.token_budget)

    # -- the loop ---------------------------------------------------------------------------
    metrics: dict[str, Any] = {}
    kill_after = int(os.environ.get(KILL_AFTER_STEP_ENV, "0") or 0)
    saved = None
    for step in range(start_step + 1, steps + 1):
        tic = time.perf_counter()
        rows = step_rows(table.num_rows, cfg.batch_size, cfg.seed, segment["start_step"], step)
        batch = micro_batches(table.take(pa.array(rows)), cfg.token_budget, pad_id=ctx.pad_id)
        lr = lr_at(step, cfg, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(ctx, micro_step, batch, policy_version=step - 1)
        params = [p for p in policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
        optimizer.step()
        seconds = time.perf_counter() - tic
        metrics.update(event="step", step=step, objective=cfg.objective, lr=lr, grad_norm=float(grad_norm),
                       rows=len(rows), seconds=round(seconds, 4),
                       tokens_per_s=round(metrics["tokens"] / seconds, 1), rounds=data.rounds)
        metrics_log.append(metrics)
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

        # -- checkpoint -----------------------------------------------------------------------
        if step == steps or (cfg.save_every and step % cfg.save_every == 0):
            saved = ckpt.save_checkpoint(
                run_dir, step, policy, optimizer,
                {"base_model": str(base_model), "data": segment, "config": cfg.model_dump(mode="json"),
                 "temperature": ctx.temperature},
                tokenizer_from=base_model, keep_last=cfg.keep_last or None)
        if progress is not None:
            progress(step - start_step, steps - start_step, metrics)
    return TrainResult(start_step, steps, skipped=False, checkpoint=saved, rows=table.num_rows,
                       rounds=data.rounds, last_metrics=metrics, seconds=time.perf_counter() - started)


# ---- one optimizer step's gradient ------------------------------------------------------------

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

    def logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """(b, L-1) log-probs of `model` at mb's positions (0 where target_mask is False)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask,
                                  temperature=self.temperature)

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
    """grpo, gspo, gspo_token, sft: loss(logp, old_logp, advantages, mask) on b sequences."""
    logp = ctx.logprobs(ctx.policy, mb)
    ref_logp = ctx.reference_logprobs(mb)
    mask = mb.target_mask.to(logp.dtype)
    loss, metrics = ctx.loss(logp, mb.old_logp, mb.advantages, mask, ctx.objective, ref_logp=ref_logp, norm=norm)
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
                         batches: list[MicroBatch], policy_version: int) -> dict[str, float]:
    """Forward and backward over the step's micro-batches, each loss normalised by the
    step's totals (so the gradient is the one-batch gradient however the step is split).
    Returns the step's metrics: loss is the full-batch loss; the objective's metrics are
    averaged, weighted by sequences (pairs); behavior_logp_gap is the mean |logp - old_logp|
    over response tokens of samples drawn by these very weights (policy_version)."""
    norm = step_normalizer(batches)
    totals: dict[str, float] = {}
    weight_total = 0.0
    loss_total = 0.0
    tokens = response_tokens = 0
    gap_sum, gap_tokens = 0.0, 0
    for mb in batches:
        mb = mb.to(ctx.device)
        out = micro_step(ctx, mb, norm)
        if ctx.measure_gap and mb.old_logp is not None and mb.policy_version is not None:
            # The known train/sample mismatch (top-p not re-applied, kernels differ), measured
            # where the weights are the ones that sampled: samples of this policy version.
            same = mb.policy_version == policy_version
            if same.any():
                sel = mb.target_mask & same[:, None]
                gap_sum += float((out.logp.detach() - mb.old_logp).abs()[sel].sum())
                gap_tokens += int(sel.sum())
        out.loss.backward()
        loss_total += float(out.loss.detach())
        for key, value in out.metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value) * out.weight
        weight_total += out.weight
        tokens += int(mb.attention_mask.sum())
        response_tokens += int(mb.target_mask.sum())
    metrics = {key: value / weight_total for key, value in totals.items()}
    metrics.update(loss=loss_total, tokens=tokens, response_tokens=response_tokens, micro_batches=len(batches))
    if gap_tokens:
        metrics["behavior_logp_gap"] = gap_sum / gap_tokens
    return metrics


# ---- helpers ----------------------------------------------------------------------------------

def _with_recomputed_logprobs(run_dir: Path, table: pa.Table, segment: dict, start_step: int, ctx: StepContext,
                              token_budget: int) -> pa.Table:
    """`table` with behavior_logprobs replaced by the log-probs of the policy at the start of
    this segment. Computed once and cached under RUN/_train/, so a resumed run uses the same
    values rather than those of its (already updated) weights."""
    from safetensors.torch import load_file, save

    cache = (run_dir / TRAIN_CACHE_DIR /
             f"old_logprobs-{segment['fingerprint'][:16]}-step{segment['start_step']}.safetensors")
    if cache.is_file():
        flat = load_file(cache)["logprobs"]
    elif segment["start_step"] != start_step:
        raise ValueError(f"{cache} is missing: the recomputed old log-probs of a segment started at step "
                         f"{segment['start_step']} cannot be rebuilt from step {start_step}'s weights")
    else:
        flat_parts = [None] * table.num_rows
        ctx.policy.eval()
        with torch.no_grad():
            for mb in policy_batches(table, token_budget, pad_id=ctx.pad_id):
                mb = mb.to(ctx.device)
                logp = ctx.logprobs(ctx.policy, mb)
                for i, row in enumerate(mb.rows.tolist()):
                    flat_parts[row] = logp[i][mb.target_mask[i]].float().cpu()
        ctx.policy.train()
        flat = torch.cat(flat_parts)
        write_atomic(cache, save({"logprobs": flat.contiguous()}))
    lengths = [len(x) for x in table.column("response_token_ids").to_pylist()]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.numpy(), pa.float32()))
    index = table.schema.get_field_index("behavior_logprobs")
    return table.set_column(index, "behavior_logprobs", column)


def _longest_response(table: pa.Table) -> int:
    import pyarrow.compute as pc

    columns = ["chosen_token_ids", "rejected_token_ids"] if "chosen_token_ids" in table.column_names \
        else ["response_token_ids"]
    return max(int(pc.max(pc.list_value_length(table.column(c))).as_py() or 1) for c in columns)
