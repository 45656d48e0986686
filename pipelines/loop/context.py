"""What the round loop (pipelines/loop/run.py) keeps between rounds, and the round's stopwatch.

    RoundContext        the run, its spec, its store, the live engine, the trainer's live
                        session, the weights the engine has not loaded yet, the eval prompts,
                        the round records, prompt uses, and the round's stopwatch (`Phases`)
    live_generator      the engine with the weights of a policy version (from memory or a checkpoint)

Every phase is timed on the round's stopwatch: the record's `phase_seconds` (startup,
generate, score, filter, label, pair, train, checkpoint, reload, eval, other) sum to its wall
seconds, and `model_seconds` counts engine sampling and greedy calls and the trainer's
optimizer steps.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from curation.generate.base import Generator
from curation.generate.prompt_files import expand_prompt_files
from curation.generate.stage import GenerateResult, make_generator, resolve_backend
from pipelines.loop.prompts import PromptBook
from pipelines.spec import PipelineSpec
from store.faults import fault_point
from store.location import RunLocation
from store.run_files import PHASES, MetricsLog, RoundRecord
from store.run_store import RunStore
from training import checkpoint as ckpt
from training.trainer import TrainSession

if TYPE_CHECKING:
    from training.ray_ranks import TrainerRanks


class Phases:
    """A round's stopwatch: wall seconds per phase (`store.run_files.PHASES`), a phase inside
    another counted once (the engine reload inside evaluation is reload, not eval), and the
    seconds of model work (engine sampling and greedy calls, trainer optimizer steps)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.model = 0.0
        self._inner: list[float] = []  # per open phase: seconds spent in phases inside it

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        tic = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - tic
            self.seconds[phase] += elapsed - self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed

    def move(self, seconds: float, source: str, target: str) -> None:
        """Book `seconds` measured inside phase `source` under `target` (the trainer's checkpoint writes)."""
        seconds = min(seconds, self.seconds[source])
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def result(self) -> tuple[float, dict[str, float]]:
        """(wall seconds so far, seconds per phase with other = wall - the rest, never < 0)."""
        wall = time.perf_counter() - self.started
        known = sum(seconds for phase, seconds in self.seconds.items() if phase != "other")
        return wall, {phase: builtins.round(seconds, 4) for phase, seconds in
                      {**self.seconds, "other": max(0.0, wall - known)}.items()}


@dataclass
class EvalSet:
    """The eval prompts as the engine and the metric take them: read and tokenized once per run."""

    token_ids: list[list[int]]
    prompts: list
    """Each prompt's text, or its messages."""
    columns: dict[str, list]
    """reference and metadata, for the metric."""


@dataclass(frozen=True)
class RoundStart:
    """What a round starts from (pipelines/loop/run.py `begin_round`)."""

    round: int
    previous: RoundRecord
    """The previous round's record (a start from the base model when the run has none)."""

    @property
    def policy_version(self) -> int:
        """The policy the round samples with and trains from: the previous round's."""
        return self.previous.policy_version


@dataclass
class RoundContext:
    """What one round needs: the run, its spec, the live generator (started lazily) and what
    the loop keeps between rounds."""

    spec: PipelineSpec
    store: RunStore
    """The run's store; the loop's holds (`hold=True`) the parts the round commits, so the
    next stage and the trainer read them from memory (released when the round ends)."""
    target_rounds: int = 0
    generator: Generator | None = None
    log: Callable[[str], None] = print
    records: dict[int, dict] = field(default_factory=dict)
    """The round records of metrics.jsonl, read once per run, added to as rounds finish."""
    session: TrainSession = field(default_factory=TrainSession)
    """The trainer's live model and optimizer between rounds."""
    weights: tuple[int, dict] | None = None
    """(policy_version, state dict) of trained weights the engine has not loaded yet."""
    eval_set: EvalSet | None = None
    prompts: PromptBook = field(default_factory=PromptBook)
    """The prompt pool and how many earlier rounds sampled each prompt (prompt choice)."""
    prompt_files: list[str] | None = None
    """The train prompt files the spec's `[prompts] train` entries name (globs and folders
    listed when the context is made: once per invocation, so a refresh sees new partitions)."""
    clock: Phases = field(default_factory=Phases)
    """The current round's stopwatch."""
    current: RoundStart | None = None
    """The round under way (set by `begin_round`, cleared when its record is saved)."""
    prefetch: tuple[int, Future[GenerateResult]] | None = None
    """(round, its generate call running in a thread) under `[run] overlap = 1`."""
    pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    """The thread of `prefetch` (started on first use)."""
    ranks: "TrainerRanks | None" = None
    """The trainer ranks (Ray actors) of `[train] nproc` > 1, started on first use."""
    micro_batches: str | None = None
    """The trainer's micro-batch plan as last printed (training/sizing.py)."""

    def __post_init__(self) -> None:
        if self.prompt_files is None:
            self.prompt_files = expand_prompt_files(self.spec.prompts.train)

    def finish_prefetch(self) -> None:
        """Wait for a generate call still running in the background (it commits atomically or
        not at all; an error of it is raised by the round that waits for it)."""
        if self.prefetch is not None:
            self.prefetch[1].exception()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    @property
    def location(self) -> RunLocation:
        """The run's storage and this machine's work folder for it."""
        return RunLocation.of(self.store.storage)

    @property
    def metrics(self) -> MetricsLog:
        return MetricsLog(self.store.storage)


def live_generator(ctx: RoundContext, policy_version: int) -> Generator:
    """The live generator holding the weights of `policy_version` (started on first use; new
    weights are loaded in place, from the trainer's memory or else the checkpoint folder)."""
    spec = ctx.spec
    if ctx.generator is None:
        backend = resolve_backend(spec.generator.backend, spec.model.path)
        kwargs = {**spec.generator.generator_kwargs(backend), "policy_version": 0}
        if spec.model.trust_remote_code:
            kwargs["trust_remote_code"] = True
        if backend == "vllm":
            kwargs["seed"] = spec.run.seed  # the engine's own seed; every group also has its own
        picked = " (backend auto)" if spec.generator.backend == "auto" else ""
        ctx.log(f"starting the {backend} engine{picked} on {spec.model.path}")
        with ctx.clock("startup"):
            # The engine loads tokenizer and config from the base model; weights come next.
            ctx.generator = make_generator(backend, spec.model.path, **kwargs)
    if ctx.generator.policy_version != policy_version:
        in_memory = ctx.weights is not None and ctx.weights[0] == policy_version
        weights = ctx.weights[1] if in_memory else \
            ckpt.engine_weights(ckpt.checkpoint_dir(ctx.location, policy_version))
        with ctx.clock("reload"):
            fault_point("loop.reload")
            ctx.generator.update_weights(weights, policy_version)
        ctx.weights = None
    return ctx.generator
