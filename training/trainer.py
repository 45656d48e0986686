"""The trainer: read a run's curated tables, take optimizer steps, checkpoint, log metrics.

    groupforge train RUN --objective grpo --steps 100

`train(run_dir, config, model=..., steps=N)` trains until global optimizer step N (the
step count is the policy_version of the weights, continued across calls and rounds):

    resume   the session's live weights when it holds them (TrainSession), else the newest
             complete checkpoint in RUN/checkpoints/ (or the base model at step 0)
    data     training.data: the rows of the objective in the chosen rounds
    model    Hugging Face causal LM (safetensors), AdamW, warmup then constant or cosine lr
    loop     per step: `batch_size` rows from a seeded permutation of the rows, token-budget
             micro-batches, gradient accumulation normalised by the step's totals (so any
             split gives the one-batch gradient; training/step.py), grad clipping, one
             optimizer step, one line in RUN/metrics.jsonl (curation.store.runlog.MetricsLog; with
             `grad_noise`, the step gradient's signal and noise: training/grad_noise.py)
    save     RUN/checkpoints/step-<k>/ every `save_every` steps and at the end (unless `save=False`)

With `passes` set, a call also stops once the current rows have been drawn `passes` times:
ceil(passes * rows / batch_size) steps after the step where they were first trained on.

Resume reproduces an uninterrupted run: which rows a step uses depends only on (seed, the
step, the step at which these rows were first trained on); the optimizer state and the
weights are restored exactly; and the metrics lines of steps after the checkpoint are
dropped before they are recomputed. Callers hold the run's lock (`RunStore.lock()`).

Skipping checkpoints (`save=False`, with a `TrainSession` carrying the weights to the next
call and `return_state=True` handing them to the engine) is safe for resume because of the
same rule: a killed run restarts from the newest checkpoint, and re-training each call
since then (same rows, same target steps, in order) recomputes the same weights and the
same metrics lines. The caller must replay those calls before training on anything new.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import torch

from curation.faults import fault_point
from curation.store.run_store import RunStore
from curation.store.runlog import TRAIN_CACHE_DIR, MetricsLog, write_atomic
from training import checkpoint as ckpt
from training import distributed, lora
from training.batching import pair_batches, policy_batches, prompt_groups
from training.config import TrainConfig, steps_for_passes
from training.data import POLICY_OBJECTIVES, load_training_data
from training.objectives import get_pair_loss, get_policy_loss
from training.step import StepContext, accumulate_gradients, pair_micro_step, policy_micro_step

__all__ = ["TrainConfig", "TrainResult", "TrainSession", "lr_at", "step_rows", "train"]

# Fault injection for resume tests: SIGKILL this process right after step k is logged.


@dataclass
class TrainResult:
    """What one `train` call did: steps (start_step, end_step], or nothing when skipped."""

    start_step: int
    end_step: int
    skipped: bool
    checkpoint: Path | None = None
    """The checkpoint written at the end of this call, or the newest one when skipped."""
    rows: int = 0
    rounds: list[int] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    """Wall seconds of the whole call."""
    load_seconds: float = 0.0
    """Reading the resume state, the data query, loading model, optimizer and reference (and,
    with old_logprobs = "recompute", the forward pass that recomputes them)."""
    step_seconds: float = 0.0
    """Sum of the optimizer steps' times (micro-batching, forward, backward, clip, update)."""
    checkpoint_seconds: float = 0.0
    """Writing checkpoints (save_every and the final one)."""
    state_dict: dict[str, torch.Tensor] | None = None
    """With return_state=True: the policy's weights at end_step, CPU tensors, a copy (safe to
    keep while training goes on); for `Generator.update_weights`. None when skipped without a
    live session (the weights are then in `checkpoint`)."""


@dataclass
class TrainSession:
    """The trainer's live state between `train` calls of one process (the round loop): the
    policy, its optimizer, the reference and the data segment at optimizer step `step`. A
    call given a session continues from it (no model or optimizer load) when it is at least
    as new as the newest checkpoint, and leaves its end state in it. A call that fails
    leaves it empty, so the next one loads from disk."""

    step: int = 0
    run_dir: Path | None = None
    """The run these weights belong to (a session given another run's folder is not used)."""
    policy: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    reference: torch.nn.Module | None = None
    reference_from: str | None = None
    base_model: Path | None = None
    segment: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.policy is not None

    def clear(self) -> None:
        self.policy = self.optimizer = self.reference = None
        self.reference_from = None


ADAPTERS_OFF = "<the policy with its LoRA adapters disabled>"
"""TrainSession.reference_from of a LoRA policy's reference (training/lora.py)."""


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup, then constant or cosine."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay = cfg.decay_steps or total_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rows(num_rows: int, batch_size: int, seed: int, segment_start: int, step: int,
              units: np.ndarray | None = None) -> np.ndarray:
    """Row indices of optimizer step `step`: consecutive slices of a stream of seeded
    permutations of the rows (epoch e uses permutation e), counted from `segment_start`,
    the step after which these rows were first trained on. Depends on nothing else, so a
    resumed run draws exactly the rows an uninterrupted one would. `units` (a unit id per
    row, 0..n_units-1; `group_units`): epoch e permutes the units instead, each unit's rows
    together in row order, so a step holds whole units (one may straddle two steps)."""
    size = min(batch_size, num_rows)
    first = (step - segment_start - 1) * size
    out = []
    for epoch in range(first // num_rows, (first + size - 1) // num_rows + 1):
        rng = np.random.default_rng([seed, segment_start, epoch])
        if units is None:
            perm = rng.permutation(num_rows)
        else:
            rank = np.empty(int(units.max()) + 1, dtype=np.int64)
            rank[rng.permutation(rank.size)] = np.arange(rank.size)
            perm = np.lexsort((np.arange(num_rows), rank[units]))
        lo, hi = max(first - epoch * num_rows, 0), min(first + size - epoch * num_rows, num_rows)
        out.append(perm[lo:hi])
    return np.concatenate(out)


def group_units(groups: np.ndarray, per_group: int | None = None) -> np.ndarray:
    """step_rows' units: a group id per row, or with `per_group` a unit per run of that many
    rows of a group (its 1st..per_group-th rows in row order, the next ones, ...)."""
    if per_group is None:
        return groups
    order = np.lexsort((np.arange(groups.size), groups))
    starts = np.flatnonzero(np.r_[True, groups[order][1:] != groups[order][:-1]])
    position = np.empty(groups.size, dtype=np.int64)
    position[order] = np.arange(groups.size) - np.repeat(starts, np.diff(np.r_[starts, groups.size]))
    _, units = np.unique(groups * (groups.size + 1) + position // per_group, return_inverse=True)
    return units


def train(run_dir: str | Path | RunStore, cfg: TrainConfig, *, steps: int, model: str | Path | None = None,
          progress: Callable[[int, int, dict], None] | None = None, session: TrainSession | None = None,
          save: bool = True, return_state: bool = False, sync_metrics: bool = True) -> TrainResult:
    """Train until optimizer step `steps` (sooner with `cfg.passes`), starting from the live
    `session`, else the newest checkpoint of the run, else the model folder `model`.
    `save=False` writes no checkpoint at the end (save_every still does); `return_state`
    puts the final weights in `TrainResult.state_dict`. `held`: tables the caller has just
    committed (`curation.store.run_store.Held`, e.g. the round's stage reports' `written`), used instead
    of reading those files back while they are unchanged on disk; the rows are the same.
    `sync_metrics=False` leaves the fsync of the step lines to the caller's next synced line."""
    started = time.perf_counter()
    run = run_dir
    run_dir = Path(run.root if isinstance(run, RunStore) else run)
    timing = _Timing()
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.strategy != "single":
        distributed.ensure_process_group(device)
        if device.type == "cuda" and cfg.device is None:
            device = torch.device("cuda", torch.cuda.current_device())
    world = distributed.ranks() if cfg.strategy != "single" else distributed.Ranks()
    sharded = cfg.strategy == "fsdp2" and world.world > 1
    sync = distributed.StepSync(device, world.world, gradients=not sharded)  # FSDP sums the gradients itself

    # -- resume: the session's weights, a checkpoint, or the base model ------------------------
    with timing("load"):
        latest = ckpt.latest_checkpoint(run_dir)
        state = ckpt.load_trainer_state(latest) if latest else {}
    live = (session is not None and session.live and session.run_dir == run_dir.resolve()
            and session.step >= int(state.get("step", 0)))
    start_step = session.step if live else int(state.get("step", 0))
    base_model = session.base_model if live else Path(state.get("base_model") or model or "")
    if not live and latest is None and (model is None or not (Path(model) / "config.json").is_file()):
        raise ValueError(f"{run_dir}: no checkpoint to resume and no base model folder (got {model!r}; "
                         "it needs a config.json)")

    def skipped() -> TrainResult:
        weights = _cpu_state_dict(session.policy) if return_state and live else None
        return TrainResult(start_step, start_step, skipped=True, checkpoint=latest, state_dict=weights,
                           seconds=time.perf_counter() - started, load_seconds=timing.load)

    if start_step >= steps:
        return skipped()
    metrics_log = MetricsLog(run_dir)
    if not live and world.main:  # a live session wrote every step record there is up to its step
        metrics_log.drop_steps_after(start_step)

    # -- data -------------------------------------------------------------------------------
    with timing("load"):
        data = load_training_data(run, cfg.objective, cfg.rounds, cfg.max_staleness, cfg.sft_min_reward)
    segment = (session.segment if live else state.get("data")) or {}
    if segment.get("fingerprint") != data.fingerprint:  # new rows: a new segment starts here
        segment = {"fingerprint": data.fingerprint, "start_step": start_step, "rounds": data.rounds,
                   "rows": data.num_rows}
    if cfg.passes is not None:
        steps = min(steps, segment["start_step"] + steps_for_passes(data.num_rows, cfg.batch_size, cfg.passes))
        if start_step >= steps:
            return skipped()

    # -- model, optimizer, the step's context -------------------------------------------
    torch.manual_seed(cfg.seed)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32  # master weights
    reference_from = str(cfg.ref_model or base_model) if cfg.uses_reference() else None
    if reference_from is not None and cfg.lora is not None and cfg.ref_model is None:
        reference_from = ADAPTERS_OFF  # the policy with its adapters disabled: no second copy
    if cfg.lora is not None and sharded:
        raise ValueError("[train] lora with strategy fsdp2 is not supported: use single or ddp")
    with timing("load"):
        def make_optimizer(params):
            return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)

        if live:
            policy, optimizer = session.policy, session.optimizer
        else:
            policy = _load_policy(latest, base_model, cfg, device, dtype)
            optimizer = make_optimizer([p for p in policy.parameters() if p.requires_grad])
            if latest is not None:
                ckpt.load_optimizer(optimizer, latest)
            if sharded:
                from training import fsdp

                policy, optimizer = fsdp.shard(policy, optimizer, make_optimizer, device, world.world,
                                               resumed=latest is not None)
        if live and session.reference_from == reference_from:
            reference = session.reference
        elif reference_from == ADAPTERS_OFF:
            reference = lora.AdaptersOff(policy)
        else:
            reference = (ckpt.load_model(reference_from, device, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
                         if reference_from else None)
    if session is not None:
        session.clear()  # the weights change in place from here on; a failure must not leave them live
    if cfg.objective == "pairwise":
        loss, micro_batches, micro_step = get_pair_loss(cfg.objective), pair_batches, pair_micro_step
    else:
        loss, micro_step = get_policy_loss(cfg.objective), policy_micro_step
        micro_batches = functools.partial(policy_batches, share_prompts=cfg.share_prompts)
    ctx = StepContext(
        policy=policy, reference=reference, loss=loss,
        objective=cfg.objective_config(longest_response=_longest_response(data.table)),
        temperature=cfg.temperature or data.temperature or 1.0,
        pad_id=policy.config.pad_token_id if isinstance(policy.config.pad_token_id, int) else 0,
        device=device, autocast=cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda"),
        measure_gap=cfg.old_logprobs == "generator",
        correction=cfg.correction_config() if cfg.rollout_correction != "off" else None, grad_noise=cfg.grad_noise,
        **({"top_k": data.top_k, "top_p": data.top_p} if cfg.truncated_logprobs else {}))
    table = data.table
    if cfg.old_logprobs == "recompute" and cfg.objective in POLICY_OBJECTIVES:
        with timing("load"):
            table = _with_recomputed_logprobs(run_dir, table, segment, start_step, ctx, cfg.token_budget,
                                              write=world.main)

    # -- the loop ---------------------------------------------------------------------------
    metrics: dict[str, Any] = {}
    saved = None
    size = min(cfg.batch_size, table.num_rows)
    units = group_units(prompt_groups(table), cfg.share_prompts_rows) if cfg.share_prompts and table.num_rows \
        else None  # share_prompts: a step draws a prompt's rows together
    for step in range(start_step + 1, steps + 1):
        tic = time.perf_counter()
        rows = step_rows(table.num_rows, cfg.batch_size, cfg.seed, segment["start_step"], step, units)
        mine = world.shard(rows)  # every rank draws the same rows and takes its share
        batch = micro_batches(table.take(pa.array(mine)), cfg.token_budget, pad_id=ctx.pad_id) if len(mine) else []
        lr = lr_at(step, cfg, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(ctx, micro_step, batch, policy_version=step - 1, sync=sync)
        params = [p for p in policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor over the ranks
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        seconds = time.perf_counter() - tic
        timing.step += seconds
        # pass: which pass over the segment's rows this step's first row belongs to (1-based)
        metrics.update(event="step", step=step, objective=cfg.objective, lr=lr, grad_norm=float(grad_norm),
                       rows=len(rows), seconds=round(seconds, 4),
                       tokens_per_s=round(metrics["tokens"] / seconds, 1), rounds=data.rounds,
                       **{"pass": (step - segment["start_step"] - 1) * size // table.num_rows + 1})
        if world.main:  # synced before a checkpoint and at the end: a step line lost to a
            metrics_log.append(metrics, sync=False)  # power cut is after the newest checkpoint
        fault_point("train.step_logged")

        # -- checkpoint -----------------------------------------------------------------------
        if (save and step == steps) or (cfg.save_every and step % cfg.save_every == 0):
            with timing("checkpoint"):
                plain, plain_optimizer = policy, optimizer
                if sharded:  # every rank takes part in gathering the full state; rank 0 writes it
                    from training import fsdp

                    model_state, optimizer_state = fsdp.full_state(policy, optimizer)
                    if world.main:
                        plain, plain_optimizer = fsdp.unsharded(policy, model_state, optimizer_state,
                                                                make_optimizer, dtype)
                if world.main:  # a plain HF folder: any world size resumes from it
                    metrics_log.sync()
                    saved = ckpt.save_checkpoint(
                        run_dir, step, plain, plain_optimizer,
                        {"base_model": str(base_model), "data": segment, "config": cfg.model_dump(mode="json"),
                         "temperature": ctx.temperature},
                        tokenizer_from=base_model, keep_last=cfg.keep_last or None,
                        merged=cfg.lora is not None and cfg.lora.save_merged)
                else:
                    saved = ckpt.checkpoint_dir(run_dir, step)
                sync.barrier()  # no rank reads the run before the checkpoint is whole
        if progress is not None:
            progress(step - start_step, steps - start_step, metrics)
    if world.main and sync_metrics:  # else the caller's next fsynced line makes them durable (the loop's round record)
        metrics_log.sync()
    sync.barrier()
    if session is not None:
        session.step, session.run_dir, session.base_model = steps, run_dir.resolve(), base_model
        session.policy, session.optimizer = policy, optimizer
        session.reference, session.reference_from, session.segment = reference, reference_from, segment
    return TrainResult(start_step, steps, skipped=False, checkpoint=saved, rows=table.num_rows,
                       rounds=data.rounds, last_metrics=metrics, seconds=time.perf_counter() - started,
                       load_seconds=timing.load, step_seconds=timing.step, checkpoint_seconds=timing.checkpoint,
                       state_dict=_final_weights(policy, optimizer, sharded) if return_state else None)


# ---- helpers ----------------------------------------------------------------------------------

@dataclass
class _Timing:
    """Seconds spent per part of a call; `with timing("load"): ...` adds to `timing.load`."""

    load: float = 0.0
    step: float = 0.0
    checkpoint: float = 0.0

    @contextlib.contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        tic = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.perf_counter() - tic)


def _final_weights(policy: torch.nn.Module, optimizer, sharded: bool) -> dict[str, torch.Tensor]:
    """The weights for TrainResult.state_dict: FSDP2's gathered on rank 0 (a collective)."""
    if sharded:
        from training import fsdp

        return fsdp.full_state(policy, optimizer)[0]
    return _cpu_state_dict(policy)


def _cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's weights on the CPU (the live ones keep changing in a session); a
    LoRA policy's merged weights under the base model's names (what an engine loads)."""
    if lora.is_peft(model):
        return lora.merged_state_dict(model)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}


def _load_policy(latest: Path | None, base_model: Path, cfg: TrainConfig, device: torch.device,
                 dtype: torch.dtype) -> torch.nn.Module:
    """The trainable policy: the newest checkpoint, else the base model; with [train] lora, the
    base model with the checkpoint's adapter (or fresh adapters)."""
    adapter = latest is not None and lora.is_adapter_folder(latest)
    if cfg.lora is None:
        if adapter:
            raise ValueError(f"checkpoint {latest} holds a LoRA adapter: keep [train] lora set to resume this run")
        return ckpt.load_model(latest or base_model, device, trainable=True, dtype=dtype,
                               trust_remote_code=cfg.trust_remote_code)
    if latest is not None and not adapter:
        raise ValueError(f"checkpoint {latest} is a full model (this run trained without LoRA): to train adapters "
                         f"on it, start a new run with [model] path = \"{latest}\"")
    base = ckpt.load_model(base_model, device, trainable=True, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    if not adapter:
        return lora.wrap(base, cfg.lora)
    policy = lora.load(base, latest, trainable=True)
    saved = policy.peft_config[lora.ADAPTER]
    if (saved.r, float(saved.lora_alpha)) != (cfg.lora.r, float(cfg.lora.alpha)):
        raise ValueError(f"checkpoint {latest}: its adapter has r={saved.r}, alpha={saved.lora_alpha}, but [train] "
                         f"lora asks r={cfg.lora.r}, alpha={cfg.lora.alpha}: keep the run's adapter settings")
    return policy


def _with_recomputed_logprobs(run_dir: Path, table: pa.Table, segment: dict, start_step: int, ctx: StepContext,
                              token_budget: int, write: bool = True) -> pa.Table:
    """`table` with an old_logprobs column: the log-probs of the policy at the start of this
    segment (behavior_logprobs stay: decoupled mode reads both). Computed once and cached
    under RUN/_train/, so a resumed run uses the same values rather than those of its (already
    updated) weights."""
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
        if write:  # rank 0 of a ddp run; every rank computed the same values
            write_atomic(cache, save({"logprobs": flat.contiguous()}))
    lengths = [len(x) for x in table.column("response_token_ids").to_pylist()]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.numpy(), pa.float32()))
    return table.append_column("old_logprobs", column)


def _longest_response(table: pa.Table) -> int:
    import pyarrow.compute as pc

    columns = ["chosen_token_ids", "rejected_token_ids"] if "chosen_token_ids" in table.column_names \
        else ["response_token_ids"]
    return max(int(pc.max(pc.list_value_length(table.column(c))).as_py() or 1) for c in columns)
