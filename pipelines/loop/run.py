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

Every stage is resumable, so killing the process at any point and rerunning the same
command continues where it stopped: a round whose record is in metrics.jsonl is done; a
round's prompt choice (and each refill's) is a file written once; generate keeps finished
chunks and is skipped once committed; curation stages skip when their manifests match; the
trainer resumes from its newest checkpoint, and the loop first trains again the rounds done
since then (checkpoint_every > 1: the same rows and steps give the same weights).
`--rounds +K` extends a finished run by K rounds (the target is kept in RUN/pipeline.json).
The run's lock keeps a second job off the same run.

Within one process the loop keeps what it already has (pipelines/loop/context.py): the
trainer's model and optimizer (`TrainSession`), the new weights for the engine (loaded from
memory, no checkpoint read), the tokenized eval prompts, the round records, the prompt pool
and its use counts (`PromptBook`), and the tables the round committed: each stage commits
before the next runs, and the run's store (`RunStore(..., hold=True)`) keeps the parts it
committed so the next stage and the trainer read them from memory.

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
from pathlib import Path
from typing import Callable, Iterator

from curation.generate.base import Generator, load_prompts
from curation.generate.prompt_files import check_chat_template, expand_prompt_files
from curation.rewards.registry import get_reward
from curation.stages.dataset import Appended, append_export
from pipelines.loop.context import EvalSet, Phases, RoundContext, RoundStart, live_generator
from pipelines.loop.curriculum import record_history
from pipelines.loop.prompts import choose_prompts
from pipelines.loop.refill import refill
from pipelines.loop.steps import (
    curate_round,
    evaluates,
    keep_best,
    loop_stages,
    prefetch,
    replay,
    round_stats,
    sample,
    sampling_manifests,
    train_round,
)
from pipelines.loop.trackers import Trackers, check_installed, spec_params
from pipelines.spec import PipelineSpec, load_spec, resolved_toml
from store.errors import JobError
from store.faults import fault_point
from store.location import RunLocation
from store.run_files import (
    SPEC_FILE,
    MetricsLog,
    RoundRecord,
    load_pipeline_state,
    save_pipeline_state,
)
from store.run_store import RunStore
from store.storage import Storage
from store.verify import check_run

__all__ = ["RoundContext", "append_dataset", "begin_round", "choose_prompts", "evaluate", "evaluate_start",
           "finish_round", "open_run", "run_pipeline", "run_round", "save_record"]


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
                if round in ctx.records:
                    continue
                position = ctx.metrics.position() if trackers else None
                record = evaluate_start(ctx) if round == 0 else run_round(ctx, round)
                save_record(ctx, record)
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


@contextlib.contextmanager
def open_run(spec: PipelineSpec | str | Path, run_dir: str | Path | None = None, extra_rounds: int | None = None,
             wait: bool = True, log: Callable[[str], None] = print) -> Iterator[RoundContext]:
    """The run of `spec` opened for writing (the loop's, and each Dagster step's,
    pipelines/orchestrate/dagster.py): its train prompt files listed and checked against the
    model's chat template, the run checked against its log, locked, its Ray session up,
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
            ctx.finish_prefetch()
            if ctx.generator is not None:
                ctx.generator.close()
            if ctx.ranks is not None:
                ctx.ranks.close()
            ctx.session.clear()


def run_round(ctx: RoundContext, round: int) -> RoundRecord:
    """Round `round` >= 1: generate, curate (refill), train, evaluate; returns its metrics record."""
    spec = ctx.spec
    start = begin_round(ctx, round)

    # -- generate with the newest policy ---------------------------------------------------
    sample(ctx, round, choose_prompts(ctx, round), start.policy_version)

    # -- curate, and refill while too few groups are informative ----------------------------
    stages = loop_stages(spec)
    reports = curate_round(ctx, round, stages)
    if spec.run.refill is not None:
        refill(ctx, round, start.policy_version, reports, stages)
    fault_point("loop.after_curate")
    if spec.run.overlap and round < ctx.target_rounds:  # the engines sample the next round meanwhile
        prefetch(ctx, round + 1, choose_prompts(ctx, round + 1), start.policy_version)
    return finish_round(ctx, round)


def begin_round(ctx: RoundContext, round: int) -> RoundStart:
    """The start of round `round` >= 1 (once per round and process): its stopwatch, the policy
    version it samples and trains from (the previous round's; a missing record counts as a
    start from the base model), and the rounds no checkpoint holds trained again (`replay`)."""
    if ctx.current is not None and ctx.current.round == round:
        return ctx.current
    ctx.clock = Phases()
    found = ctx.records.get(round - 1)
    previous = RoundRecord.from_dict(found) if found else RoundRecord(round=round - 1, eval_accuracy=0.0)
    ctx.current = RoundStart(round, previous)
    replay(ctx, round, previous.policy_version)
    return ctx.current


def finish_round(ctx: RoundContext, round: int) -> RoundRecord:
    """The end of round `round` >= 1, whose tables are curated: its prompt_stats rows (`[prompts]
    curriculum`), train, evaluate (when the round does; `[run] keep_best`), and the round's
    record from its tables and manifests."""
    spec, start = ctx.spec, begin_round(ctx, round)
    record_history(ctx, round)  # [prompts] curriculum: the round's prompt_stats rows
    since = ctx.metrics.position()
    steps, decay_steps = train_round(ctx, round, start.policy_version)
    rates = [s["tokens_per_s"] for s in ctx.metrics.records_since(since)
             if s.get("event") == "step" and start.policy_version < s.get("step", 0) <= steps]

    # -- evaluate the new policy -------------------------------------------------------------
    accuracy = evaluate(ctx, steps) if evaluates(ctx, round) else None
    if spec.run.keep_best and accuracy is not None:
        keep_best(ctx, round, steps, accuracy)
    stats = round_stats(ctx.store, round, paired="pair" in loop_stages(spec))
    ctx.store.release()
    manifests = sampling_manifests(ctx.store, round)
    tokens, sample_seconds = (sum(float(m.get(key) or 0) for m in manifests)
                              for key in ("response_tokens", "sample_seconds"))
    refilled = sum(int(m.get("rows_in") or 0) for m in manifests if m.get("stage") != "generate")
    wall, phases = ctx.clock.result()
    decimals = builtins.round  # `round` is the round number here
    previous = start.previous
    return RoundRecord(
        round=round, eval_accuracy=accuracy, **stats,
        samples_total=previous.samples_total + stats["samples"],
        policy_version=steps, steps=steps - start.policy_version, objective=spec.train.objective,
        wall_seconds=decimals(wall, 2), elapsed_seconds=decimals(previous.elapsed_seconds + wall, 2),
        gen_tokens_per_s=decimals(tokens / sample_seconds, 1) if sample_seconds else 0.0,
        train_tokens_per_s=decimals(sum(rates) / len(rates), 1) if rates else 0.0,
        phase_seconds=phases, model_seconds=decimals(ctx.clock.model, 4), refill_prompts=refilled,
        decay_steps=decay_steps, peak_rss_mib=peak_rss_mib())


def save_record(ctx: RoundContext, record: RoundRecord) -> None:
    """Append the round's record to RUN/metrics.jsonl: the round is done."""
    ctx.metrics.append(record)
    ctx.records[record.round] = record.to_dict()
    ctx.current = None


def append_dataset(ctx: RoundContext) -> Appended:
    """`[export] append_to`: the run's finished rounds not in that Delta table yet, appended as one
    version (curation/stages/dataset.py)."""
    done = append_export(ctx.store.storage, ctx.spec.export)
    if done.version is not None:
        ctx.log(f"appended rounds {done.rounds} ({done.rows} rows) to {done.table} as version {done.version}")
    return done


def evaluate_start(ctx: RoundContext) -> RoundRecord:
    """Round 0: the starting model's eval accuracy (no samples, no training)."""
    ctx.clock = Phases()
    accuracy = evaluate(ctx, 0)
    wall, phases = ctx.clock.result()
    wall = round(wall, 2)
    return RoundRecord(round=0, eval_accuracy=accuracy, objective=ctx.spec.train.objective,
                       wall_seconds=wall, elapsed_seconds=wall, phase_seconds=phases,
                       model_seconds=round(ctx.clock.model, 4), peak_rss_mib=peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def evaluate(ctx: RoundContext, policy_version: int) -> float:
    """Mean of the eval metric over greedy responses to the eval prompts."""
    spec = ctx.spec
    with ctx.clock("eval"):
        generator = live_generator(ctx, policy_version)
        if ctx.eval_set is None:
            ctx.eval_set = eval_set(spec, generator)
        prompts = ctx.eval_set
        tic = time.perf_counter()
        responses = generator.greedy(prompts.token_ids, spec.eval.max_tokens or spec.generator.max_tokens)
        fault_point("loop.eval")
        ctx.clock.model += time.perf_counter() - tic
        values = get_reward(spec.eval.metric)(prompts.prompts, responses, **prompts.columns)
    scored = [v for v in values if v is not None]
    if not scored:
        raise ValueError(f"eval metric {spec.eval.metric!r} gave no value for any eval prompt "
                         f"({spec.prompts.eval}: is the `reference` column empty?)")
    return float(sum(scored) / len(scored))


def eval_set(spec: PipelineSpec, generator: Generator) -> EvalSet:
    """The spec's eval prompts (the first eval_limit), tokenized by the live generator."""
    prompts = load_prompts(spec.prompts.eval)
    if spec.prompts.eval_limit:
        prompts = prompts.slice(0, spec.prompts.eval_limit)
    texts = prompts.column("prompt").to_pylist()
    messages = prompts.column("messages").to_pylist()
    return EvalSet(token_ids=[generator.tokenize(p, m) for p, m in zip(texts, messages)],
                   prompts=[p if p is not None else m for p, m in zip(texts, messages)],
                   columns={name: prompts.column(name).to_pylist() for name in ("reference", "metadata")})


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
