"""The round loop: generate with the newest policy, curate, train, checkpoint, evaluate.

    groupforge run SPEC [--run-dir DIR] [--rounds +K] [--no-wait]

    round 0    evaluate the starting model (greedy, eval prompts)
    round n    choose `per_round` prompts (least used first, then a seeded order)
               -> generate G responses each with the live engine (weights of the newest policy)
               -> score -> filter -> label (-> pair, when the objective trains on pairs or with
                  `[run] pairs = "every_round"`; `groupforge pair RUN` makes them afterwards)
               -> refill: too few kept groups -> sample more prompts, curate again ([run] refill)
               -> `[prompts] curriculum`: commit the round's rows of the prompt_stats table
               -> train `steps_per_round` optimizer steps on round n (+ `replay_rounds` earlier ones)
               -> checkpoint (every `checkpoint_every` rounds and the last) -> evaluate (every
                  `[eval] every` rounds, round 0 and the last; `[run] keep_best`: each of them
                  checkpoints and RUN/checkpoints/best.json names the best)
               -> append a record to RUN/metrics.jsonl, with the seconds of each phase

`run_pipeline` is that loop, one round per pass of its body, in that order; each phase is a
function of pipelines/loop/steps.py (or prompts.py, refill.py, curriculum.py) on the run's
`RoundContext`.

Every stage is resumable, so killing the process at any point and rerunning the same
command continues where it stopped: a round whose record is in metrics.jsonl is done; a
round's prompt choice (and each refill's) is a file written once; generate keeps finished
chunks and is skipped once committed; curation stages skip when their manifests match; the
trainer resumes from its newest checkpoint, and the loop first trains again the rounds done
since then (checkpoint_every > 1: the same rows and steps give the same weights).
`--rounds +K` extends a finished run by K rounds (the target is kept in RUN/pipeline.json).
The run's lock keeps a second job off the same run.

Within one process the loop keeps what it already has (`RoundContext`): the trainer's model
and optimizer (`TrainSession`), the new weights for the engine (loaded from memory, no
checkpoint read), the tokenized eval prompts, the round records, the prompt pool and its use
counts (`PromptBook`), and the tables the round committed: each stage commits before the next
runs, and the run's store (`RunStore(..., hold=True)`) keeps the parts it committed so the
next stage and the trainer read them from memory, until the round's record is written.

Every phase is timed on the round's stopwatch (`Phases`): the record's `phase_seconds`
(startup, generate, score, filter, label, pair, train, checkpoint, reload, eval, other) sum
to its wall seconds, and `model_seconds` counts engine sampling and greedy calls and the
trainer's optimizer steps.

The run is a local folder or an object-store prefix (`RunLocation`, store/location.py):
tables go through the run store, the other files (spec.toml, pipeline.json, metrics.jsonl,
_rounds/, checkpoints/, report/) are named by store/run_files.py and written through the
run's storage or its work folder on this machine; a round's record is its `RoundRecord`. The
loop is described in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from curation.env.environments import check_model_environment
from curation.generate.base import Generator
from curation.generate.prompt_files import check_chat_template, expand_prompt_files
from curation.generate.stage import GenerateResult
from curation.stages.dataset import Appended, append_export
from pipelines.loop.curriculum import record_history
from pipelines.loop.prompts import PromptBook, choose_prompts
from pipelines.loop.refill import refill
from pipelines.loop.steps import (
    EvalSet,
    Trained,
    checkpoints,
    curate_round,
    evaluate,
    evaluates,
    keep_best,
    loop_stages,
    prefetch,
    replay,
    round_stats,
    sample,
    sampling_manifests,
    train_round,
    trajectory_stats,
    wait_for_prefetch,
)
from pipelines.loop.trackers import Trackers, check_installed, spec_params
from pipelines.spec import PipelineSpec, load_spec, resolved_toml
from store.errors import JobError
from store.faults import fault_point
from store.location import RunLocation
from store.run_files import (
    PHASES,
    SPEC_FILE,
    MetricsLog,
    RoundRecord,
    load_pipeline_state,
    save_pipeline_state,
)
from store.run_store import RunStore
from store.storage import Storage
from store.verify import check_run
from training.trainer import TrainSession

if TYPE_CHECKING:
    from training.ray_ranks import TrainerRanks

__all__ = ["Phases", "RoundContext", "append_dataset", "open_run", "previous_record", "round_record",
           "run_pipeline", "start_record"]


def run_pipeline(spec: PipelineSpec | str | Path, run_dir: str | Path | None = None,
                 extra_rounds: int | None = None, wait: bool = True, log: Callable[[str], None] = print,
                 on_round: Callable[[dict], None] | None = None, report: bool = False) -> list[dict]:
    """Run (or resume, or extend by `extra_rounds`) the pipeline of `spec` (a spec or its
    TOML file); returns the round records of the run. The resolved spec is written to
    RUN/spec.toml. With `[export] append_to` the run ends by appending its finished rounds'
    export to that Delta table; with `report` (or `[run] trackers`, whose artifacts it is) by
    writing RUN/report/."""
    with open_run(spec, run_dir, extra_rounds, wait, log) as ctx:
        spec, location = ctx.spec, ctx.location
        trackers = Trackers(spec.run.trackers, location.work, spec_params(spec.model_dump(mode="json")), warn=log)
        try:
            if trackers:
                rounds, steps, _ = ctx.metrics.read() if ctx.metrics.exists() else ([], [], 0)
                trackers.catch_up(rounds, steps)
            for round in range(ctx.target_rounds + 1):
                if round in ctx.records:  # done: its record is in metrics.jsonl
                    continue
                position = ctx.metrics.position() if trackers else None
                ctx.clock = Phases()
                if round == 0:  # the starting model's eval accuracy (no samples, no training)
                    record = start_record(ctx, evaluate(ctx, 0))
                else:
                    # the round samples with and trains from the previous round's policy; after a
                    # restart, the rounds since the newest checkpoint are trained again first
                    previous = previous_record(ctx.records, round)
                    replay(ctx, round, previous.policy_version)

                    # -- choose prompts and generate (skipped once committed; `[run] overlap`: the
                    #    previous round started it)
                    prompts_file = choose_prompts(ctx, round)
                    if ctx.prefetch is not None and ctx.prefetch[0] == round:
                        wait_for_prefetch(ctx)
                    elif ctx.store.load_manifest("generate", round) is None:
                        sample(ctx, round, prompts_file, previous.policy_version)

                    # -- curate, and refill while too few groups are kept
                    stages = loop_stages(spec)
                    curate_round(ctx, round, stages)
                    if spec.run.refill is not None:
                        refill(ctx, round, previous.policy_version, stages)
                    fault_point("loop.after_curate")
                    if spec.run.overlap and round < ctx.target_rounds:  # the engines sample the next round meanwhile
                        next_prompts = choose_prompts(ctx, round + 1)
                        if ctx.store.load_manifest("generate", round + 1) is None:
                            prefetch(ctx, round + 1, next_prompts, previous.policy_version)

                    # -- `[prompts] curriculum`: the round's prompt_stats rows
                    record_history(ctx, round)

                    # -- train (and checkpoint), evaluate the new policy
                    trained = train_round(ctx, round, previous.policy_version, save=checkpoints(ctx, round))
                    accuracy = evaluate(ctx, trained.policy_version) if evaluates(ctx, round) else None
                    if spec.run.keep_best and accuracy is not None:
                        keep_best(ctx, round, trained.policy_version, accuracy)
                    record = round_record(ctx, round, previous, trained, accuracy)
                    ctx.store.release()  # the round's held parts

                # -- the record: the round is done
                ctx.metrics.append(record)
                ctx.records[round] = record.to_dict()
                if trackers:  # the round's step lines and its record, read back from metrics.jsonl
                    trackers.log_records(ctx.metrics.records_since(position))
                if on_round is not None:
                    on_round(record.to_dict())
            if spec.export.append_to is not None:
                append_dataset(ctx)
            if report or trackers.logged:
                from pipelines.reports.run_report import report_run

                trackers.finish(report_run(location.storage))
        finally:
            trackers.close()
    return [ctx.records[round] for round in sorted(ctx.records)]


class Phases:
    """A round's stopwatch: wall seconds per phase (`store.run_files.PHASES`), a phase inside
    another counted once (the engine reload inside evaluation is reload, not eval), and the
    seconds of model work (engine sampling and greedy calls, trainer optimizer steps)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.model = 0.0
        self._inner: list[float] = []  # per open phase: seconds spent in phases inside it

    @contextlib.contextmanager
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
    started: int | None = None
    """The round whose stopwatch runs, for callers that run a round in several calls (a Dagster
    run's steps, pipelines/orchestrate/dagster.py, start it once)."""
    prefetch: tuple[int, Future[GenerateResult]] | None = None
    """(round, its generate call running in a thread) under `[run] overlap = 1`."""
    pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    """The thread of `prefetch` (started on first use)."""
    ranks: "TrainerRanks | None" = None
    """The trainer ranks (Ray actors) of `[train] nproc` > 1, started on first use."""
    micro_batches: str | None = None
    """The trainer's micro-batch plan as last printed (training/sizing.py)."""
    location: RunLocation = field(init=False)
    """The run's storage and this machine's work folder for it."""
    metrics: MetricsLog = field(init=False)

    def __post_init__(self) -> None:
        self.location = RunLocation.of(self.store.storage)
        self.metrics = MetricsLog(self.store.storage)
        if self.prompt_files is None:
            self.prompt_files = expand_prompt_files(self.spec.prompts.train)


@contextlib.contextmanager
def open_run(spec: PipelineSpec | str | Path, run_dir: str | Path | None = None, extra_rounds: int | None = None,
             wait: bool = True, log: Callable[[str], None] = print) -> Iterator[RoundContext]:
    """The run of `spec` opened for writing (the loop's, and each Dagster step's,
    pipelines/orchestrate/dagster.py): its train prompt files listed and checked against the
    model's chat template, its `[env]` checked with the model's tokenizer, the run checked
    against its log, locked, its Ray session up,
    the checkpoint it resumes from checked, its target rounds and RUN/spec.toml written, its round
    records read. Yields its RoundContext; on the way out waits for a prefetch and closes the
    engine, the trainer ranks and the trainer session."""
    if not isinstance(spec, PipelineSpec):
        spec = load_spec(spec)
    check_installed(spec.run.trackers)  # before anything is written
    if run_dir is None:  # from the spec's name: runs/<name>, which must not lead out of runs/
        run_dir = Path("runs") / spec.run.name
        if run_dir.is_symlink() and not run_dir.resolve().is_relative_to(Path("runs").resolve()):
            raise ValueError(f"run folder {run_dir} (run.name {spec.run.name!r}) is a symlink to {run_dir.resolve()}, "
                             "outside runs/: refused; give --run-dir to write there on purpose")
    location = RunLocation.of(run_dir)  # a folder, or an object-store URL (store/location.py)
    prompt_files = expand_prompt_files(spec.prompts.train)
    # conversations the model cannot render (no chat template): refused before anything is written
    check_chat_template([*prompt_files, spec.prompts.eval], spec.model.path, spec.model.trust_remote_code)
    if spec.env is not None:  # and an environment, tool or template a multi-turn generate cannot use
        check_model_environment(spec.env, spec.model.path, spec.model.trust_remote_code)
    # a resumed run is what its log says, before the lock writes the log's "open" row
    # (a damaged run, a missing bucket, refused credentials: nothing written) and before a round reads it
    check_run(location.storage)
    location.work.mkdir(parents=True, exist_ok=True)
    store = RunStore(location.storage, hold=True)
    with store.lock(wait=wait, on_wait=lambda msg: log(f"waiting: {msg}")), _ray_session(spec):
        from training.checkpoint import check_checkpoint, latest_checkpoint  # torch: only once a run starts

        newest = latest_checkpoint(location)
        if newest is not None:
            check_checkpoint(newest)  # and the checkpoint it resumes from is whole
        target = _target_rounds(location.storage, spec, extra_rounds)
        resolved = resolved_toml(spec).encode("utf-8")
        if location.storage.read_if_exists(SPEC_FILE) != resolved:
            location.storage.write(SPEC_FILE, resolved)  # a rerun of the same spec writes nothing
        metrics = MetricsLog(location.storage)
        ctx = RoundContext(spec=spec, store=store, target_rounds=target, log=log, prompt_files=prompt_files,
                           records={record["round"]: record for record in metrics.rounds()} if metrics.exists() else {})
        try:
            yield ctx
        finally:
            if ctx.prefetch is not None:  # a generate call still running: it commits whole or not at all
                ctx.prefetch[1].exception()
            if ctx.pool is not None:
                ctx.pool.shutdown(wait=True)
            if ctx.generator is not None:
                ctx.generator.close()
            if ctx.ranks is not None:
                ctx.ranks.close()
            ctx.session.clear()


def previous_record(records: dict[int, dict], round: int) -> RoundRecord:
    """The record of the round before `round` (a start from the base model when the run has
    none): the policy round `round` samples with and trains from."""
    found = records.get(round - 1)
    return RoundRecord.from_dict(found) if found else RoundRecord(round=round - 1, eval_accuracy=0.0)


def start_record(ctx: RoundContext, accuracy: float) -> RoundRecord:
    """Round 0's record: the starting model's eval accuracy (no samples, no training)."""
    wall, phases = ctx.clock.result()
    wall = round(wall, 2)
    return RoundRecord(round=0, eval_accuracy=accuracy, objective=ctx.spec.train.objective,
                       wall_seconds=wall, elapsed_seconds=wall, phase_seconds=phases,
                       model_seconds=round(ctx.clock.model, 4), peak_rss_mib=peak_rss_mib())


def round_record(ctx: RoundContext, round: int, previous: RoundRecord, trained: Trained,
                 accuracy: float | None) -> RoundRecord:
    """The record of round `round` >= 1, trained and evaluated: from its tables (held parts
    from memory; with `[env]` its trajectories' tool use, turns and stop reasons too) and its
    generate and refill manifests, and its stopwatch."""
    spec = ctx.spec
    stats = round_stats(ctx.store, round, paired="pair" in loop_stages(spec))
    turns = trajectory_stats(ctx.store, round) if spec.env is not None else {}
    manifests = sampling_manifests(ctx.store, round)
    tokens, sample_seconds = (sum(float(m.get(key) or 0) for m in manifests)
                              for key in ("response_tokens", "sample_seconds"))
    refilled = sum(int(m.get("rows_in") or 0) for m in manifests if m.get("stage") != "generate")
    rates = trained.tokens_per_s
    wall, phases = ctx.clock.result()
    decimals = builtins.round  # `round` is the round number here
    return RoundRecord(
        round=round, eval_accuracy=accuracy, **stats,
        samples_total=previous.samples_total + stats["samples"],
        policy_version=trained.policy_version, steps=trained.policy_version - previous.policy_version,
        objective=spec.train.objective,
        wall_seconds=decimals(wall, 2), elapsed_seconds=decimals(previous.elapsed_seconds + wall, 2),
        gen_tokens_per_s=decimals(tokens / sample_seconds, 1) if sample_seconds else 0.0,
        train_tokens_per_s=decimals(sum(rates) / len(rates), 1) if rates else 0.0,
        phase_seconds=phases, model_seconds=decimals(ctx.clock.model, 4), refill_prompts=refilled,
        decay_steps=trained.decay_steps, peak_rss_mib=peak_rss_mib(), **turns)


def append_dataset(ctx: RoundContext) -> Appended:
    """`[export] append_to`: the run's finished rounds not in that Delta table yet, appended as one
    version (curation/stages/dataset.py)."""
    done = append_export(ctx.store.storage, ctx.spec.export)
    if done.version is not None:
        ctx.log(f"appended rounds {done.rounds} ({done.rows} rows) to {done.table} as version {done.version}")
    return done


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# -- helpers ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _ray_session(spec: PipelineSpec) -> Iterator[None]:
    """One Ray connection for the run's engines and trainer ranks (when the spec has either on
    Ray), ended with the run when the run started it."""
    if not (spec.generator.uses_ray or spec.train.nproc > 1):
        yield
        return
    try:
        import ray
    except ImportError:
        raise JobError("generator.engines > 1, generator.ray_address and train.nproc > 1 run on Ray, which "
                           "is not installed: pip install 'groupforge[ray]'") from None
    from training.ray_cluster import check_room, connect_ray

    owns = connect_ray(spec.generator.ray_address)
    try:
        g, t = spec.generator, spec.train
        asks = [("engines", g.engines, g.engine_cpus, g.engine_gpus)] if g.uses_ray else []
        if t.nproc > 1:
            asks.append(("trainer ranks", t.nproc, t.rank_cpus, t.rank_gpus))
        check_room(asks, "generator.engine_cpus / engine_gpus or train.rank_cpus / rank_gpus")
        yield
    finally:
        if owns:
            ray.shutdown()


def _target_rounds(storage: Storage, spec: PipelineSpec, extra_rounds: int | None) -> int:
    """The last round this invocation runs to: the spec's rounds, or the previous target plus
    `extra_rounds` (`--rounds +K`); kept in RUN/pipeline.json."""
    state = load_pipeline_state(storage)
    target = max(int(state.get("target_rounds", 0)), spec.run.rounds)
    if extra_rounds:
        done = max([record["round"] for record in MetricsLog(storage).rounds()], default=0)
        target = max(target, done) + extra_rounds
    if state.get("target_rounds") != target:  # a rerun to the same target writes nothing
        save_pipeline_state(storage, {**state, "target_rounds": target})
    return target
