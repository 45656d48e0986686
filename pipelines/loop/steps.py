"""The steps of one round of the loop (pipelines/loop/run.py), and what the loop keeps between rounds.

    RoundContext        the run, its spec, the live engine, the trainer's live session, the
                        weights the engine has not loaded yet, the eval prompts, the round
                        records, and the round's stopwatch (`Phases`)
    sample              generate G responses per prompt with the live engine (a stage of the round)
    curate              score -> filter -> label (-> pair: `loop_stages`); the reports hold
                        the committed tables
    round_stats         reward mean, samples, groups, kept groups, pairs: from those tables
    train_round         the round's optimizer steps; checkpoint every `checkpoint_every` rounds
    replay              after a restart, train again the rounds no checkpoint holds
    prefetch            `[run] overlap = 1`: start the next round's generate in a thread, so
                        the engines sample while the trainer trains; `sample` waits for it
    live_generator      the engine with the weights of a policy version (from memory or a checkpoint)

Every phase is timed on the round's stopwatch: the record's `phase_seconds` (startup,
generate, score, filter, label, pair, train, checkpoint, reload, eval, other) sum to its wall
seconds, and `model_seconds` counts engine sampling and greedy calls and the trainer's
optimizer steps.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation.faults import fault_point
from curation.generate.base import Generator
from curation.generate.stage import GenerateResult, generate, make_generator, resolve_backend
from curation.generate.weights import fingerprint_ahead
from curation.stages.runner import StageReport, fresh_round, prepare_stage, run_stage
from curation.store.run_store import RunStore
from curation.store.runlog import PHASES, MetricsLog, RoundRecord
from pipelines.loop.curate import STAGES
from pipelines.loop.prompts import remember_sampled
from pipelines.spec import PipelineSpec
from training import checkpoint as ckpt
from training.config import TrainConfig, steps_for_passes
from training.data import NoTrainingData, count_training_rows
from training.trainer import TrainResult, TrainSession, train

if TYPE_CHECKING:
    from training.ray_ranks import TrainerRanks


class Phases:
    """A round's stopwatch: wall seconds per phase (`curation.store.runlog.PHASES`), a phase inside
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


class Publisher:
    """The round loop's curation commits, made in order by one background thread while the
    loop trains: the stages hand their tables over in memory (`prepare_stage`) and queue their
    commits; `start()`, called as training begins, hands them to the thread (started earlier,
    their Python work would slow the stages' own), so the files and manifests land beside the
    optimizer steps. `settle()` waits for every commit so far (and raises the first failure);
    the loop settles before anything reads the round's files and before the round's record is
    written, so a recorded round is a committed one, as before. After a failed commit the
    later ones are not made."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._queued: list[Callable[[], dict]] = []
        self._pending: list[Future[dict]] = []
        self._failed = False

    def submit(self, publish: Callable[[], dict]) -> None:
        """Queue a commit (made after those queued before it, once `start` or `settle` runs)."""
        self._queued.append(publish)

    def start(self) -> None:
        """Start making the queued commits in the background thread."""
        if not self._queued:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="groupforge-commit")
        self._pending += [self._pool.submit(self._run, publish) for publish in self._queued]
        self._queued = []

    def _run(self, publish: Callable[[], dict]) -> dict:
        if self._failed:
            raise RuntimeError("not committed: an earlier commit of the round failed")
        try:
            return publish()
        except BaseException:
            self._failed = True
            raise

    @property
    def busy(self) -> bool:
        return bool(self._queued or self._pending)

    def settle(self) -> dict[str, tuple[dict, pa.Table]]:
        """Make (`start`) and wait for every commit submitted so far; their `written` entries
        merged (the files as published: size and mtime_ns). Raises the first commit's error."""
        self.start()
        pending, self._pending = self._pending, []
        written: dict[str, tuple[dict, pa.Table]] = {}
        error: BaseException | None = None
        for future in pending:
            try:
                written.update(future.result())
            except BaseException as exc:  # wait for the rest (they are skipped), then raise the first
                error = error or exc
        self._failed = False
        if error is not None:
            raise error
        return written

    def close(self) -> None:
        """Let the commits already started finish (a commit is never cut by the loop itself),
        drop those still queued (the loop is stopping on an error: a rerun makes them), and
        stop the thread."""
        self._queued = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending = []


@dataclass
class EvalSet:
    """The eval prompts as the engine and the metric take them: read and tokenized once per run."""

    token_ids: list[list[int]]
    prompts: list
    """Each prompt's text, or its messages."""
    columns: dict[str, list]
    """reference and metadata, for the metric."""


@dataclass
class RoundContext:
    """What one round needs: the run, its spec, the live generator (started lazily) and what
    the loop keeps between rounds."""

    spec: PipelineSpec
    store: RunStore
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
    clock: Phases = field(default_factory=Phases)
    """The current round's stopwatch."""
    held: dict[str, tuple[dict, pa.Table]] = field(default_factory=dict)
    """The current round's committed tables by file (generate and each stage), which the next
    stage reads instead of the files; emptied once curation is done."""
    prefetch: tuple[int, Future[GenerateResult]] | None = None
    """(round, its generate call running in a thread) under `[run] overlap = 1`."""
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _hasher: ThreadPoolExecutor | None = field(default=None, repr=False)
    weights_hashed: Future[str] | None = None
    """The sha256 of `weights`, computed in a thread (`fingerprint_ahead`)."""
    ranks: "TrainerRanks | None" = None
    """The trainer ranks (Ray actors) of `[train] nproc` > 1, started on first use."""
    publisher: Publisher = field(default_factory=Publisher)
    """The round's curation commits, made in the background (`curate`)."""

    def settle(self) -> None:
        """Wait for the round's background commits; `held` then has their files as published."""
        if self.publisher.busy:
            published = self.publisher.settle()
            self.held.update({rel: entry for rel, entry in published.items() if rel in self.held})
            for rel, (entry, table) in published.items():
                if rel.startswith("samples/"):  # the next prompt choice counts it without reading it
                    remember_sampled(self.store.root / rel, entry, table)

    def finish_prefetch(self) -> None:
        """Wait for a generate call still running in the background (it commits atomically or
        not at all; an error of it is raised by the round that waits for it)."""
        if self.prefetch is not None:
            self.prefetch[1].exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    @property
    def run_dir(self) -> Path:
        return self.store.root

    @property
    def metrics(self) -> MetricsLog:
        return MetricsLog(self.store.root)


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
        if ctx.weights_hashed is not None:
            ctx.weights_hashed.result()
            ctx.weights_hashed = None
        held = ctx.weights is not None and ctx.weights[0] == policy_version
        weights = ctx.weights[1] if held else ckpt.engine_weights(ckpt.checkpoint_dir(ctx.run_dir, policy_version))
        with ctx.clock("reload"):
            fault_point("loop.reload")
            ctx.generator.update_weights(weights, policy_version)
        ctx.weights = None
    return ctx.generator


def sample(ctx: RoundContext, round: int, prompts_file: Path, policy_version: int, stage: str = "generate") -> None:
    """Generate G responses per prompt of `prompts_file` as `stage` of the round (skipped once
    committed); with a prefetch of the round running, wait for it instead."""
    if stage == "generate" and ctx.prefetch is not None and ctx.prefetch[0] == round:
        with ctx.clock("generate"):
            tic = time.perf_counter()
            future, ctx.prefetch = ctx.prefetch[1], None
            result = future.result()
            ctx.clock.model += time.perf_counter() - tic  # only the wait: the rest ran beside training
        ctx.held.update(result.written)
        return
    if ctx.store.load_manifest(stage, round) is not None:
        return
    generator = live_generator(ctx, policy_version)
    ctx.log(f"round {round}: {stage} {pq.read_metadata(prompts_file).num_rows} prompts x "
            f"{ctx.spec.generator.group_size} with policy_version {generator.policy_version}")
    with ctx.clock("generate"):  # the round's own samples are committed in the background (`Publisher`)
        result = _generate_call(ctx, round, prompts_file, generator, stage,
                                ctx.publisher.submit if stage == "generate" and ctx.spec.run.background_commits
                                else None)
    ctx.clock.model += result.sample_seconds
    ctx.held.update(result.written)


def prefetch(ctx: RoundContext, round: int, prompts_file: Path, policy_version: int) -> None:
    """Start round `round`'s generate in a thread with the weights of `policy_version` (the
    engines run in other processes; their calls are in order, so weights loaded later wait
    for these samples). Skipped when the round's samples are committed already."""
    if ctx.store.load_manifest("generate", round) is not None:
        return
    generator = live_generator(ctx, policy_version)
    ctx.log(f"round {round}: generate {pq.read_metadata(prompts_file).num_rows} prompts x "
            f"{ctx.spec.generator.group_size} with policy_version {generator.policy_version}, while round "
            f"{round - 1} trains")
    if ctx._pool is None:
        ctx._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="groupforge-prefetch")
    ctx.prefetch = (round, ctx._pool.submit(_generate_call, ctx, round, prompts_file, generator, "generate"))


def _generate_call(ctx: RoundContext, round: int, prompts_file: Path, generator: Generator,
                   stage: str, publish: Callable[[Callable[[], dict]], None] | None = None) -> GenerateResult:
    spec = ctx.spec
    return generate(ctx.run_dir, prompts_file, spec.generator.sampling(spec.run.seed), generator=generator,
                    round=round, run_id=spec.run.name, chunk_prompts=spec.generator.chunk_prompts, stage=stage,
                    publish=publish)


def sampling_manifests(store: RunStore, round: int) -> list[dict]:
    """The manifests of the round's generate call and of its refills."""
    found = [store.load_manifest("generate", round)]
    call = 1
    while (manifest := store.load_manifest(f"refill-{call}", round)) is not None:
        found.append(manifest)
        call += 1
    return [manifest for manifest in found if manifest]


def loop_stages(spec: PipelineSpec) -> tuple[str, ...]:
    """The curation stages a round of the loop runs: score, filter, label, and pair when the
    objective trains on pairs or `[run] pairs = "every_round"` (pairs derive from the groups
    tables alone, so `groupforge pair RUN` makes them for every round afterwards)."""
    wanted = spec.run.pairs == "every_round" or spec.train.objective == "pairwise"
    return STAGES if wanted else tuple(stage for stage in STAGES if stage != "pair")


def curate(ctx: RoundContext, round: int, stages: Sequence[str] = STAGES) -> dict[str, StageReport]:
    """`stages` (default score -> filter -> label -> pair) on the round; each stage reads what
    the ones before it produced from memory (`ctx.held`). On a fresh round (`fresh_round`: the
    loop's first curation of it) each stage's commit is made by `ctx.publisher` in the
    background (`prepare_stage`), and `ctx.settle()` waits for them; otherwise (a resumed
    round, a refill, a round taken in slices) each stage commits before the next one runs."""
    reports = {}
    background = ctx.spec.run.background_commits and fresh_round(ctx.store, round, stages, ctx.held)
    if not background:
        ctx.settle()  # the stage-by-stage path reads the round's files
    for stage in stages:
        with ctx.clock(stage):
            if background:
                prepared = prepare_stage(stage, ctx.store, round, getattr(ctx.spec, stage), ctx.held)
                ctx.publisher.submit(prepared.publish)
                reports[stage] = prepared.report
            else:
                reports[stage] = run_stage(stage, ctx.run_dir, round, getattr(ctx.spec, stage), held=ctx.held)
        ctx.held.update(reports[stage].written)
    return reports


def round_stats(store: RunStore, round: int, reports: dict[str, StageReport]) -> dict:
    """reward_mean, samples, groups, kept_groups, pairs (None when `reports` has no pair stage:
    the round built none) of `round`: from the tables the stages just committed (`reports`),
    reading back only the columns of those a skipped stage did not hand over; samples from
    the generate manifests."""
    rewards = _round_table(store, round, reports, "scores", ["reward"]).column("reward")
    groups = _round_table(store, round, reports, "groups", ["prompt_id", "group_kept"])
    return {"reward_mean": pc.mean(rewards).as_py() if len(rewards) else None,
            "samples": sum(int(m.get("rows_out") or 0) for m in sampling_manifests(store, round)),
            "groups": pc.count_distinct(groups.column("prompt_id")).as_py(),
            "kept_groups": _kept(groups),
            "pairs": _round_table(store, round, reports, "pairs", ["prompt_id"]).num_rows if "pair" in reports
            else None}


def kept_groups(store: RunStore, round: int, reports: dict[str, StageReport]) -> int:
    """round_stats' kept_groups alone."""
    return _kept(_round_table(store, round, reports, "groups", ["prompt_id", "group_kept"]))


def _kept(groups: pa.Table) -> int:
    kept = groups.filter(pc.fill_null(groups.column("group_kept"), False))
    return pc.count_distinct(kept.column("prompt_id")).as_py()


def _round_table(store: RunStore, round: int, reports: dict[str, StageReport], name: str,
                 columns: list[str]) -> pa.Table:
    """The round's `name` table as a stage of `reports` committed it, else `columns` read back."""
    for report in reports.values():
        for rel, (_, table) in report.written.items():
            if rel.split("/")[0] == name:
                return table
    return store.read_columns(name, columns, round)


def train_round(ctx: RoundContext, round: int, start_version: int) -> tuple[int, int]:
    """Train round `round`'s steps from `start_version`: `steps_per_round`, or with
    `[train] passes` the steps that draw its rows that many times. Checkpoints every
    `checkpoint_every` rounds and in the last. Returns (policy_version after, cosine horizon)."""
    spec = ctx.spec
    decay_steps = cosine_horizon(spec, ctx.target_rounds)
    cfg = train_config(spec, round, decay_steps)
    steps = spec.run.steps_per_round
    save = round % spec.run.checkpoint_every == 0 or round >= ctx.target_rounds
    if save or spec.train.nproc > 1:
        ctx.settle()  # a checkpoint follows committed tables; trainer ranks read the files
    held = ctx.held if spec.train.nproc == 1 else None  # the round's tables, their commits maybe in flight
    ctx.publisher.start()
    if cfg.passes is not None:
        rows = count_training_rows(ctx.run_dir, cfg.objective, cfg.rounds, cfg.max_staleness, cfg.sft_min_reward,
                                   held=held)
        steps = steps_for_passes(rows, cfg.batch_size, cfg.passes)
    try:
        ctx.log(f"round {round}: train {spec.train.objective} steps {start_version + 1}..{start_version + steps}")
        return _train(ctx, cfg, start_version + steps, save, held).end_step, decay_steps
    except NoTrainingData as exc:
        ctx.log(f"round {round}: no training ({exc})")
        return start_version, decay_steps


def cosine_horizon(spec: PipelineSpec, target_rounds: int) -> int:
    """The step where a cosine lr reaches its floor: train.decay_steps if pinned, else the end of
    round run.decay_rounds, or of the run's last round when that comes first or decay_rounds is
    unset (a run extended with --rounds +K stretches an unpinned schedule from there on)."""
    if spec.train.decay_steps:
        return spec.train.decay_steps
    return min(spec.run.decay_rounds or target_rounds, target_rounds) * spec.run.steps_per_round


def train_config(spec: PipelineSpec, round: int, decay_steps: int) -> TrainConfig:
    rounds = list(range(max(1, round - spec.run.replay_rounds), round + 1))
    return TrainConfig(**{**spec.train.model_dump(), "rounds": rounds, "seed": spec.run.seed,
                          "temperature": spec.generator.temperature, "decay_steps": decay_steps,
                          "trust_remote_code": spec.model.trust_remote_code})


def _train(ctx: RoundContext, cfg: TrainConfig, steps: int, save: bool, held: dict | None = None) -> TrainResult:
    """One trainer call on the live session (`held`: the round's tables, read from memory);
    its new weights are kept for the engine."""
    with ctx.clock("train"):
        if ctx.spec.train.nproc > 1:
            result = trainer_ranks(ctx).train(ctx.run_dir, cfg, steps=steps, model=ctx.spec.model.path, save=save,
                                              return_state=True)
        else:
            result = train(ctx.run_dir, cfg, steps=steps, model=ctx.spec.model.path, session=ctx.session,
                           save=save, return_state=True, held=held, sync_metrics=False)  # the round record syncs
    ctx.clock.move(result.checkpoint_seconds, "train", "checkpoint")
    ctx.clock.model += result.step_seconds
    if result.state_dict is not None:
        ctx.weights = (result.end_step, result.state_dict)
        if ctx._hasher is None:
            ctx._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="groupforge-hash")
        # hashed while the round finishes (hashlib lets go of the interpreter), not in the reload
        ctx.weights_hashed = ctx._hasher.submit(fingerprint_ahead, result.state_dict)
    return result


def trainer_ranks(ctx: RoundContext) -> "TrainerRanks":
    """The run's trainer ranks (`[train] nproc` Ray actors), started on first use."""
    if ctx.ranks is None:
        from training.ray_ranks import TrainerRanks

        spec = ctx.spec.train
        ctx.log(f"starting {spec.nproc} trainer ranks ({spec.strategy})")
        with ctx.clock("startup"):
            ctx.ranks = TrainerRanks(spec.nproc, rank_cpus=spec.rank_cpus, rank_gpus=spec.rank_gpus,
                                     ray_address=ctx.spec.generator.ray_address)
    return ctx.ranks


def replay(ctx: RoundContext, round: int, start_version: int) -> None:
    """Before round `round` trains from `start_version`: when neither the live session nor a
    checkpoint holds those weights (a restart with checkpoint_every > 1), train again, in
    order, each finished round since the newest checkpoint, with its recorded steps and
    cosine horizon. Which rows a step draws depends only on (seed, step, the step its rows
    were first trained on), so this recomputes the same weights and step records."""
    live = ctx.ranks if ctx.ranks is not None else ctx.session
    have = live.step if live.live else latest_step(ctx.run_dir)
    if start_version <= have:
        return
    for done in sorted(ctx.records):
        record = RoundRecord.from_dict(ctx.records[done])
        if 0 < done < round and record.policy_version > have and record.steps > 0:
            ctx.log(f"round {round}: replaying round {done} (steps {record.policy_version - record.steps + 1}.."
                    f"{record.policy_version}; no checkpoint holds them)")
            decay_steps = record.decay_steps or cosine_horizon(ctx.spec, ctx.target_rounds)
            _train(ctx, train_config(ctx.spec, done, decay_steps), record.policy_version, save=False)
            have = record.policy_version


def latest_step(run_dir: Path) -> int:
    found = ckpt.list_checkpoints(run_dir)
    return found[-1][0] if found else 0
