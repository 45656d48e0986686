"""The trainer's step loop (training/trainer.py `train` builds what it runs on): steps start+1..N
of a call, each a seeded draw of rows, token-budget micro-batches, gradient accumulation
(training/step.py), the lr of the schedule, clipping and one optimizer step, one metrics line
per step and a checkpoint when one is due; and the typed pieces a call passes to it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import torch

from store.faults import fault_point
from store.location import RunLocation
from store.run_files import MetricsLog
from training import checkpoint as ckpt
from training import distributed
from training.batching import prompt_groups
from training.config import TrainConfig
from training.measurements import StepMeasurements
from training.policy import OptimizerFactory
from training.schedule import group_units, lr_at, step_rows
from training.step import StepContext, accumulate_gradients


@dataclass(frozen=True)
class CallStart:
    """Where a call starts: the newest checkpoint and its trainer state, whether the session's
    live weights are used instead, the step, the base model."""

    latest: Path | None
    state: dict[str, Any]
    live: bool
    step: int
    base_model: str
    """The start model as given (a folder, or an object-store URL), as trainer_state.json keeps it."""


@dataclass
class BuiltPolicy:
    """The models and the step machinery of a call."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    make_optimizer: OptimizerFactory
    reference: torch.nn.Module | None
    reference_from: str | None
    dtype: torch.dtype
    """The master weights' dtype."""
    ctx: StepContext
    micro_batches: Callable[..., list]
    micro_step: Callable
    table: pa.Table
    """The rows trained on (with recomputed old_logprobs when the config asks for them)."""


@dataclass
class StepLoop:
    """Steps start+1..steps of a call over the built policy: one `step` per optimizer step,
    `checkpoint` when one is due."""

    location: RunLocation
    cfg: TrainConfig
    start: CallStart
    segment: dict[str, Any]
    rounds: list[int]
    place: distributed.Placement
    built: BuiltPolicy
    metrics_log: MetricsLog
    timing: Timing

    def run(self, steps: int, save: bool,
            progress: Callable[[int, int, dict], None] | None) -> tuple[dict[str, Any], Path | None]:
        """(the last step's metrics, the last checkpoint written or None)."""
        table, cfg = self.built.table, self.cfg
        # share_prompts: a step draws a prompt's rows together
        units = group_units(prompt_groups(table), cfg.share_prompts_rows) if cfg.share_prompts and table.num_rows \
            else None
        metrics, saved = {}, None
        for step in range(self.start.step + 1, steps + 1):
            metrics = self.step(step, steps, units)
            if self.place.world.main:  # synced before a checkpoint and at the end: a step line lost to a
                self.metrics_log.append(metrics, sync=False)  # power cut is after the newest checkpoint
            fault_point("train.step_logged")
            if (save and step == steps) or (cfg.save_every and step % cfg.save_every == 0):
                with self.timing("checkpoint"):
                    saved = self.checkpoint(step)
            if progress is not None:
                progress(step - self.start.step, steps - self.start.step, metrics)
        return metrics, saved

    def step(self, step: int, steps: int, units: np.ndarray | None) -> dict[str, Any]:
        """One optimizer step (the lr schedule's horizon is `steps`); its metrics record."""
        cfg, built, table = self.cfg, self.built, self.built.table
        tic = time.perf_counter()
        rows = step_rows(table.num_rows, cfg.batch_size, cfg.seed, self.segment["start_step"], step, units)
        mine = self.place.world.shard(rows)  # every rank draws the same rows and takes its share
        batch = built.micro_batches(table.take(pa.array(mine)), cfg.token_budget, pad_id=built.ctx.pad_id) \
            if len(mine) else []
        lr = lr_at(step, cfg, steps)
        for group in built.optimizer.param_groups:
            group["lr"] = lr
        built.optimizer.zero_grad(set_to_none=True)
        measurements = StepMeasurements.of(built.ctx, policy_version=step - 1)
        metrics = accumulate_gradients(built.ctx, built.micro_step, batch, policy_version=step - 1,
                                       sync=self.place.sync, measurements=measurements)
        params = [p for p in built.policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor over the ranks
            grad_norm = grad_norm.full_tensor()
        built.optimizer.step()
        seconds = time.perf_counter() - tic
        self.timing.step += seconds
        # pass: which pass over the segment's rows this step's first row belongs to (1-based)
        size = min(cfg.batch_size, table.num_rows)
        metrics.update(event="step", step=step, objective=cfg.objective, lr=lr, grad_norm=float(grad_norm),
                       rows=len(rows), seconds=round(seconds, 4),
                       tokens_per_s=round(metrics["tokens"] / seconds, 1), rounds=self.rounds,
                       **{"pass": (step - self.segment["start_step"] - 1) * size // table.num_rows + 1})
        return metrics

    def checkpoint(self, step: int) -> Path:
        """RUN/checkpoints/step-<step>/, a plain HF folder any world size resumes from: every
        rank takes part in gathering a sharded state, rank 0 writes it."""
        built, place, cfg = self.built, self.place, self.cfg
        plain, plain_optimizer = built.policy, built.optimizer
        if place.sharded:
            from training import fsdp

            model_state, optimizer_state = fsdp.full_state(built.policy, built.optimizer)
            if place.world.main:
                plain, plain_optimizer = fsdp.unsharded(built.policy, model_state, optimizer_state,
                                                        built.make_optimizer, built.dtype)
        if place.world.main:
            self.metrics_log.sync()
            saved = ckpt.save_checkpoint(
                self.location, step, plain, plain_optimizer,
                {"base_model": str(self.start.base_model), "data": self.segment,
                 "config": cfg.model_dump(mode="json"), "temperature": built.ctx.temperature},
                tokenizer_from=self.start.base_model, keep_last=cfg.keep_last or None,
                merged=cfg.lora is not None and cfg.lora.save_merged)
        else:
            saved = self.location.work / ckpt.checkpoint_rel(step)  # rank 0 writes it
        place.sync.barrier()  # no rank reads the run before the checkpoint is whole
        return saved


@dataclass
class Timing:
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

