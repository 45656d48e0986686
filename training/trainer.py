"""The trainer: read a run's curated tables, take optimizer steps, checkpoint, log metrics.

    groupforge train RUN --objective grpo --steps 100

`train(run, config, model=..., steps=N)` trains until global optimizer step N (the step
count is the policy_version of the weights, continued across calls and rounds). Its body
reads in this order:

    resume   the session's live weights when it holds them (TrainSession), else the newest
             complete checkpoint in RUN/checkpoints/ (or the base model at step 0)
    data     training.data: the rows of the objective in the chosen rounds
    policy   Hugging Face causal LM (safetensors), AdamW, the reference (training.policy), the
             step's context (training.step.StepContext)
    loop     training/step_loop.py, per step: `batch_size` rows from a seeded permutation of the rows, token-budget
             micro-batches, gradient accumulation normalised by the step's totals (so any
             split gives the one-batch gradient; training/step.py), warmup then constant or
             cosine lr, grad clipping, one optimizer step, one line in RUN/metrics.jsonl
             (store.run_files.MetricsLog; what the step measures beside its gradient:
             training/measurements.py)
    save     RUN/checkpoints/step-<k>/ every `save_every` steps and at the end (unless
             LoopOptions.save is False)

With `passes` set, a call also stops once the current rows have been drawn `passes` times:
ceil(passes * rows / batch_size) steps after the step where they were first trained on.

Resume reproduces an uninterrupted run: which rows a step uses depends only on (seed, the
step, the step at which these rows were first trained on); the optimizer state and the
weights are restored exactly; and the metrics lines of steps after the checkpoint are
dropped before they are recomputed. Callers hold the run's lock (`RunStore.lock()`).

Skipping checkpoints (`LoopOptions(save=False)`, a `TrainSession` carrying the weights to the
next call, `return_state=True` handing them to the engine) is safe for resume by the same
rule: a killed run restarts from the newest checkpoint, and re-training each call since then
(same rows, same target steps, in order) recomputes the same weights and metrics lines. The
caller must replay those calls before training on anything new.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from store.location import RunLocation, local_folder
from store.run_files import MetricsLog
from store.run_store import RunStore
from store.storage import is_object_url, open_storage
from training import checkpoint as ckpt
from training import distributed
from training.batching import pair_batches, policy_batches
from training.config import TrainConfig, steps_for_passes
from training.data import POLICY_OBJECTIVES, TrainingData, load_training_data
from training.objectives import get_pair_loss, get_policy_loss
from training.policy import (
    cpu_state_dict,
    final_weights,
    load_policy,
    load_reference,
    longest_prompt_tokens,
    longest_response_tokens,
    optimizer_factory,
    reference_source,
    with_recomputed_logprobs,
)
from training.sizing import GIB, GPU_HEADROOM, MicroBatchPlan, ModelShape, plan_micro_batches
from training.step import StepContext, pair_micro_step, policy_micro_step
from training.step_loop import BuiltPolicy, CallStart, StepLoop, Timing

__all__ = ["LoopOptions", "TrainResult", "TrainSession", "train"]


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
    plan: MicroBatchPlan | None = None
    """How token_budget and checkpointing were sized, when the config left them to the trainer."""
    state_dict: dict[str, torch.Tensor] | None = None
    """With LoopOptions.return_state: the policy's weights at end_step, CPU tensors, a copy (safe to
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
    run: str | None = None
    """The run these weights belong to (`RunLocation.key`: a session given another run is not used)."""
    policy: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    reference: torch.nn.Module | None = None
    reference_from: str | None = None
    base_model: str | None = None
    segment: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.policy is not None

    def clear(self) -> None:
        self.policy = self.optimizer = self.reference = None
        self.reference_from = None


@dataclass(frozen=True)
class LoopOptions:
    """What the round loop (or a trainer rank) asks of one `train` call beyond the CLI's
    defaults. Not fields of TrainSession: the session is state a call reads and leaves behind;
    these are the caller's choices for this one call, frozen so no call changes the next's."""

    save: bool = True
    """Write a checkpoint at the end of the call (save_every checkpoints are written either way)."""
    return_state: bool = False
    """Put the final weights in TrainResult.state_dict (for `Generator.update_weights`)."""
    engine_bytes: int = 0
    """Memory an engine in the same process (or on the same GPU) holds: the micro-batch plan
    leaves it out of the trainer's budget (training/sizing.py)."""


def train(run: RunStore | str | Path, cfg: TrainConfig, *, steps: int, model: str | Path | None = None,
          progress: Callable[[int, int, dict], None] | None = None, session: TrainSession | None = None,
          options: LoopOptions | None = None) -> TrainResult:
    """Train until optimizer step `steps` (sooner with `cfg.passes`), starting from the live
    `session`, else the newest checkpoint of the run, else the model folder `model`. `run`: the
    run folder, or its RunStore (the round loop's, which holds the parts it just committed).
    `progress(done, total, step_metrics)` after each step; `options`: LoopOptions()."""
    options = options or LoopOptions()
    started, timing = time.perf_counter(), Timing()
    location = RunLocation.of(run.storage if isinstance(run, RunStore) else run)
    place = distributed.Placement.of(cfg)
    start = _resume(location, model, session, timing)

    def skipped() -> TrainResult:
        weights = cpu_state_dict(session.policy) if options.return_state and start.live else None
        return TrainResult(start.step, start.step, skipped=True, checkpoint=start.latest, state_dict=weights,
                           seconds=time.perf_counter() - started, load_seconds=timing.load)

    if start.step >= steps:
        return skipped()
    metrics_log = MetricsLog(location.storage)
    if not start.live and place.world.main:  # a live session wrote every step record there is up to its step
        metrics_log.drop_steps_after(start.step)
    with timing("load"):
        data = load_training_data(run, cfg.objective, cfg.rounds, cfg.max_staleness, cfg.sft_min_reward)
    segment = _segment(data, start, session)
    if cfg.passes is not None:
        steps = min(steps, segment["start_step"] + steps_for_passes(data.num_rows, cfg.batch_size, cfg.passes))
        if start.step >= steps:
            return skipped()
    cfg, plan = _sized(cfg, start.base_model, data.table, place, options.engine_bytes)
    built = _build_policy(location, cfg, start, data, segment, place, session, timing)
    loop = StepLoop(location, cfg, start, segment, data.rounds, place, built, metrics_log, timing)
    metrics, saved = loop.run(steps, options.save, progress)
    if place.world.main:
        metrics_log.sync()
    place.sync.barrier()
    if session is not None:
        session.step, session.run, session.base_model = steps, location.key, start.base_model
        session.policy, session.optimizer = built.policy, built.optimizer
        session.reference, session.reference_from, session.segment = built.reference, built.reference_from, segment
    weights = final_weights(built.policy, built.optimizer, place.sharded) if options.return_state else None
    return TrainResult(start.step, steps, skipped=False, checkpoint=saved, rows=built.table.num_rows,
                       rounds=data.rounds, last_metrics=metrics, seconds=time.perf_counter() - started,
                       load_seconds=timing.load, step_seconds=timing.step, checkpoint_seconds=timing.checkpoint,
                       plan=plan, state_dict=weights)


# ---- resume ------------------------------------------------------------------------------------

def _resume(location: RunLocation, model: str | Path | None, session: TrainSession | None,
            timing: Timing) -> CallStart:
    """The session's weights when they are at least as new as the newest checkpoint, else that
    checkpoint, else the base model folder `model`."""
    with timing("load"):
        latest = ckpt.latest_checkpoint(location)
        state = ckpt.load_trainer_state(latest) if latest else {}
    live = (session is not None and session.live and session.run == location.key
            and session.step >= int(state.get("step", 0)))
    if not live and latest is None and (model is None or not _has_config(str(model))):
        raise ValueError(f"{location.url}: no checkpoint to resume and no base model folder (got {model!r}; "
                         "it needs a config.json)")
    return CallStart(latest, state, live, step=session.step if live else int(state.get("step", 0)),
                  base_model=session.base_model if live else _model_ref(state.get("base_model") or model or ""))


def _model_ref(model: str | Path) -> str:
    """A model folder's path in its normal form (a URL as it is): what trainer_state.json keeps."""
    return str(model) if is_object_url(model) else str(Path(model))


def _has_config(model: str) -> bool:
    """Whether the model folder or object-store prefix `model` holds a config.json."""
    if is_object_url(model):
        return open_storage(model).size("config.json") is not None
    return (Path(model) / "config.json").is_file()


def _segment(data: TrainingData, start: CallStart, session: TrainSession | None) -> dict[str, Any]:
    """The data segment these rows belong to: the resumed one while the rows are the same,
    else a new one that starts at this call's first step."""
    segment = (session.segment if start.live else start.state.get("data")) or {}
    if segment.get("fingerprint") != data.fingerprint:  # new rows: a new segment starts here
        segment = {"fingerprint": data.fingerprint, "start_step": start.step, "rounds": data.rounds,
                   "rows": data.num_rows}
    return segment


# ---- the micro-batch plan, policy, optimizer, reference, the step's context -------------------

def _sized(cfg: TrainConfig, base_model: str, table, place: distributed.Placement,
           engine: int) -> tuple[TrainConfig, MicroBatchPlan | None]:
    """`cfg` with token_budget and checkpointing decided (training/sizing.py) where it leaves them
    to the trainer, and the plan that decided them (None when both were set)."""
    if cfg.token_budget is not None and cfg.checkpointing != "auto":
        return cfg, None
    folder = local_folder(base_model)
    shape = ModelShape.of_folder(folder)
    budget, source = None, ""
    if cfg.memory_budget is not None:
        budget, source = int(cfg.memory_budget * GIB), "[train] memory_budget"
    elif place.device.type == "cuda":
        budget = int(GPU_HEADROOM * torch.cuda.get_device_properties(place.device).total_memory)
        source = f"{GPU_HEADROOM:.0%} of GPU memory"
    longest = longest_response_tokens(table) + longest_prompt_tokens(table)
    plan = plan_micro_batches(shape, longest_sequence=longest, reference=cfg.uses_reference(),
                              autocast=cfg.autocast(place.device.type), lora=cfg.lora is not None, engine=engine,
                              budget=budget, budget_source=source, checkpointing=cfg.checkpointing)
    update = {"checkpointing": "on" if plan.checkpointing else "off"}
    if cfg.token_budget is None:
        update["token_budget"] = plan.token_budget
    return cfg.model_copy(update=update), plan


def _build_policy(location: RunLocation, cfg: TrainConfig, start: CallStart, data: TrainingData, segment: dict,
                  place: distributed.Placement, session: TrainSession | None, timing: Timing) -> BuiltPolicy:
    """The session's policy and optimizer, or loaded ones (FSDP2: sharded); the reference;
    the step's context. Leaves the session empty."""
    torch.manual_seed(cfg.seed)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32  # master weights
    reference_from = reference_source(cfg, start.base_model, place.sharded)
    make_optimizer = optimizer_factory(cfg)
    with timing("load"):
        if start.live:
            policy, optimizer = session.policy, session.optimizer
        else:
            policy = load_policy(start.latest, start.base_model, cfg, place.device, dtype)
            optimizer = make_optimizer([p for p in policy.parameters() if p.requires_grad])
            if start.latest is not None:
                ckpt.load_optimizer(optimizer, start.latest)
            if place.sharded:
                from training import fsdp

                policy, optimizer = fsdp.shard(policy, optimizer, make_optimizer, place.device, place.world.world,
                                               resumed=start.latest is not None)
        if start.live and session.reference_from == reference_from:
            reference = session.reference
        else:
            reference = load_reference(reference_from, policy, cfg, place.device, dtype)
    if session is not None:
        session.clear()  # the weights change in place from here on; a failure must not leave them live
    if cfg.checkpointing == "on":  # non-reentrant: the recomputed layers' RNG and autocast state are kept
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(policy, "is_gradient_checkpointing", False):
        policy.gradient_checkpointing_disable()
    if cfg.objective == "pairwise":
        loss, micro_batches, micro_step = get_pair_loss(cfg.objective), pair_batches, pair_micro_step
    else:
        loss, micro_step = get_policy_loss(cfg.objective), policy_micro_step
        micro_batches = functools.partial(policy_batches, share_prompts=cfg.share_prompts)
    ctx = StepContext(
        policy=policy, reference=reference, loss=loss,
        objective=cfg.objective_config(longest_response=longest_response_tokens(data.table)),
        temperature=cfg.temperature or data.temperature or 1.0,
        pad_id=policy.config.pad_token_id if isinstance(policy.config.pad_token_id, int) else 0,
        device=place.device,
        autocast=cfg.autocast(place.device.type),
        measure_gap=cfg.old_logprobs == "generator",
        correction=cfg.correction_config() if cfg.rollout_correction != "off" else None, grad_noise=cfg.grad_noise,
        **({"top_k": data.top_k, "top_p": data.top_p} if cfg.truncated_logprobs else {}))
    table = data.table
    if cfg.old_logprobs == "recompute" and cfg.objective in POLICY_OBJECTIVES:
        with timing("load"):
            table = with_recomputed_logprobs(location.storage, table, segment, start.step, ctx, cfg.token_budget,
                                             write=place.world.main)
    return BuiltPolicy(policy, optimizer, make_optimizer, reference, reference_from, dtype, ctx, micro_batches,
                  micro_step, table)
