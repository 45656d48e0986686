"""The round loop as Dagster assets: one asset per step of a round, rounds as partitions.

    pip install 'groupforge[dagster]'

    # definitions.py, loaded by `dagster dev -f definitions.py` (or a code location)
    from pipelines.orchestrate.dagster import groupforge_definitions
    defs = groupforge_definitions("specs/prod.toml", run_dir="s3://bucket/runs/prod")

A round of `groupforge run` (pipelines/loop/run.py) is these steps, each an asset keyed
`<run.name>/<step>` (`-` and `.` in the name become `_`) that declares the tables it reads and
writes (asset metadata) and depends on the step before it and on the steps that wrote what it
reads:

    prompts -> generate -> score -> filter -> label [-> pair] [-> refill] -> train [-> export]

pair when the loop pairs (`loop_stages`), refill with `[run] refill`, export with `[export]
append_to`. Each calls the loop's own functions on the run's RoundContext, which the
`groupforge` resource opens for the Dagster run (`open_run`: lock, spec.toml, the train
prompt files listed again) and closes after it; so the engine and the trainer session live
for one Dagster run, and a step in a new process starts them from the run's storage
(checkpoints, replay), as a resumed `groupforge run` does. `train` trains, evaluates when the
round does, and appends the round's record: the round is done. Round 0 has one step, `train`,
which evaluates the start model; the others do nothing in round 0.

Rounds are the keys of a DynamicPartitionsDefinition: a run's rounds are open-ended (each
refresh adds one), which a static set fixed when the definitions load cannot say. Round n
needs round n-1 done. Dagster can only make an asset depend on its own earlier partitions for
time windows, and a dependency of `prompts` on the previous round's `train` would close a
cycle in the asset graph, so the order is kept in two places instead: the refresh sensor adds
and requests round n only once round n-1 is done and no run is in flight, and every step
refuses a round whose previous round is not done (a Failure that is not retried).

Every step is idempotent: the loop's steps skip what their commits already hold (a prompt
choice written once, generate and curation skipped when their manifests match), a done round's
steps do nothing, and an append adds only the rounds the dataset lacks; so a RetryPolicy on
each asset reruns a failed step safely.
"""

# No `from __future__ import annotations`: Dagster reads the asset function's `context`
# annotation as a class, not as a string.
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from curation.generate import stage as generate_stage
from curation.stages.export import READS as EXPORT_READS
from curation.stages.runner import run_stage, stage_module
from pipelines.loop.curriculum import record_history
from pipelines.loop.prompts import choose_prompts
from pipelines.loop.refill import refill
from pipelines.loop.run import (
    Phases,
    RoundContext,
    append_dataset,
    open_run,
    previous_record,
    round_record,
    start_record,
)
from pipelines.loop.steps import (
    checkpoints,
    evaluate,
    evaluates,
    keep_best,
    loop_stages,
    replay,
    sample,
    train_round,
)
from pipelines.spec import PipelineSpec, load_spec
from store.location import RunLocation
from store.run_files import MetricsLog, RoundRecord, load_pipeline_state, save_pipeline_state

RESOURCE = "groupforge"
"""The resource key of the run's RoundContext."""


@dataclass(frozen=True)
class Step:
    """One step of a round as an asset: what it reads and writes, and what it does."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    run: Callable[[RoundContext, int], dict]
    """(context, round) -> the materialization's metadata (round 0 reaches train and export only)."""
    description: str


def groupforge_definitions(spec_path: str | Path, run_dir: str | None = None,
                           retry_policy: dg.RetryPolicy | None = None,
                           refresh_seconds: int = 24 * 3600) -> dg.Definitions:
    """Dagster definitions for the run of `spec_path` at `run_dir` (default runs/<run.name>): the
    round's steps as assets partitioned by round (see the module docstring), the job that
    materializes a round, a sensor that starts the next round every `refresh_seconds` once the
    previous one is done, and the `groupforge` resource. `retry_policy`: each asset's (default:
    2 retries, 30 s apart)."""
    spec = load_spec(spec_path)  # a bad spec fails the code location, with the line naming the key
    prefix = spec.run.name.replace("-", "_").replace(".", "_")
    rounds = dg.DynamicPartitionsDefinition(name=f"{prefix}_rounds")
    retry = retry_policy or dg.RetryPolicy(max_retries=2, delay=30)
    assets, writers = [], {}  # writers: table -> the asset that wrote it last in the round
    for step in round_steps(spec):
        upstream = [assets[-1].key] if assets else []  # the step before: the loop's order
        upstream += [writers[table] for table in step.reads if table in writers]
        assets.append(_step_asset(step, prefix, rounds, retry, list(dict.fromkeys(upstream))))
        writers.update(dict.fromkeys(step.writes, assets[-1].key))
    job = dg.define_asset_job(f"{prefix}_round", selection=dg.AssetSelection.assets(*assets))
    run = str(run_dir) if run_dir is not None else str(Path("runs") / spec.run.name)
    return dg.Definitions(assets=assets, jobs=[job],
                          sensors=[_refresh_sensor(prefix, run, rounds, job, refresh_seconds)],
                          resources={RESOURCE: _run_resource(str(spec_path), run)})


def round_steps(spec: PipelineSpec) -> list[Step]:
    """The steps of a round of `spec`, in order, with the tables each reads and writes."""
    stages = loop_stages(spec)
    history = ("prompt_stats",) if spec.prompts.curriculum else ()  # [prompts] curriculum's table
    steps = [Step("prompts", ("prompts.train files", "samples", *history), ("_rounds/round=<n>/prompts.parquet",
                                                                              "pipeline.json"),
                  _choose, "The round's prompts: least used first, then prompts of new files (written once)."),
             Step("generate", generate_stage.READS, generate_stage.WRITES, _generate,
                  "G responses per prompt with the newest policy.")]
    for stage in stages:
        module = stage_module(stage)
        steps.append(Step(stage, tuple(module.READS), tuple(module.WRITES), _curate(stage),
                          (module.__doc__ or stage).strip().splitlines()[0]))
    if spec.run.refill is not None:
        written = ("samples", "rejects", "prompts", *(t for s in stages for t in stage_module(s).WRITES))
        steps.append(Step("refill", ("groups",), tuple(dict.fromkeys(written)), _refill(stages),
                          "More prompts while too few groups are kept ([run] refill), curated again."))
    trained_on = ("samples", "pairs") if spec.train.objective == "pairwise" else ("samples", "groups")
    steps.append(Step("train", trained_on, ("checkpoints", "metrics.jsonl", *history), _train,
                      "Train the round's steps, evaluate, append the round's record (round 0: evaluate the "
                      "start model)."))
    if spec.export.append_to is not None:
        steps.append(Step("export", EXPORT_READS[spec.export.format], (spec.export.append_to,), _export,
                          f"Append the finished rounds' {spec.export.format} export to the Delta table "
                          f"{spec.export.append_to}."))
    return steps


# -- the steps: the loop's own functions ---------------------------------------------------

def _start(ctx: RoundContext, round: int) -> RoundRecord:
    """The previous round's record (the policy the round samples with and trains from); the
    round's first step in this process starts its stopwatch and replays what no checkpoint
    holds, as the loop does at the start of a round."""
    previous = previous_record(ctx.records, round)
    if ctx.started != round:
        ctx.clock, ctx.started = Phases(), round
        replay(ctx, round, previous.policy_version)
    return previous


def _choose(ctx: RoundContext, round: int) -> dict:
    _start(ctx, round)
    return {"prompts_file": str(choose_prompts(ctx, round)), "prompt_files": len(ctx.prompt_files)}


def _generate(ctx: RoundContext, round: int) -> dict:
    previous = _start(ctx, round)
    prompts_file = choose_prompts(ctx, round)
    if ctx.store.load_manifest("generate", round) is None:
        sample(ctx, round, prompts_file, previous.policy_version)
    return {"samples": ctx.store.read_columns("samples", ["sample_idx"], round).num_rows,
            "policy_version": previous.policy_version}


def _curate(stage: str) -> Callable[[RoundContext, int], dict]:
    def run(ctx: RoundContext, round: int) -> dict:
        _start(ctx, round)
        with ctx.clock(stage):
            report = run_stage(stage, ctx.store, round, getattr(ctx.spec, stage))
        return {"rows_in": report.rows_in, "rows_out": report.rows_out, "skipped": report.skipped}

    return run


def _refill(stages: tuple[str, ...]) -> Callable[[RoundContext, int], dict]:
    def run(ctx: RoundContext, round: int) -> dict:
        previous = _start(ctx, round)
        return {"extra_prompts": refill(ctx, round, previous.policy_version, stages)}

    return run


def _train(ctx: RoundContext, round: int) -> dict:
    """The end of the loop's round: the curriculum's rows, train, evaluate, the record."""
    if round == 0:
        ctx.clock = Phases()
        record = start_record(ctx, evaluate(ctx, 0))
    else:
        previous = _start(ctx, round)
        record_history(ctx, round)
        trained = train_round(ctx, round, previous.policy_version, save=checkpoints(ctx, round))
        accuracy = evaluate(ctx, trained.policy_version) if evaluates(ctx, round) else None
        if ctx.spec.run.keep_best and accuracy is not None:
            keep_best(ctx, round, trained.policy_version, accuracy)
        record = round_record(ctx, round, previous, trained, accuracy)
        ctx.store.release()
    ctx.metrics.append(record)
    ctx.records[round] = record.to_dict()
    return {key: value for key, value in record.to_dict().items() if isinstance(value, (int, float, str))}


def _export(ctx: RoundContext, round: int) -> dict:
    done = append_dataset(ctx)
    return {"table": done.table, "version": done.version if done.version is not None else "unchanged",
            "rounds": str(done.rounds), "rows": done.rows}


# -- Dagster wiring ------------------------------------------------------------------------

def _step_asset(step: Step, prefix: str, rounds: dg.PartitionsDefinition, retry: dg.RetryPolicy,
                upstream: list[dg.AssetKey]) -> dg.AssetsDefinition:
    @dg.asset(name=step.name, key_prefix=[prefix], deps=upstream, partitions_def=rounds,
              retry_policy=retry, required_resource_keys={RESOURCE}, description=step.description,
              metadata={"reads": list(step.reads), "writes": list(step.writes)}, group_name=prefix)
    def materialize_step(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        ctx: RoundContext = getattr(context.resources, RESOURCE)
        round = int(context.partition_key)
        if round in ctx.records and step.name != "export":
            return dg.MaterializeResult(metadata={"round": round, "done": "the round's record is in metrics.jsonl"})
        if round > 0 and round - 1 not in ctx.records:
            raise dg.Failure(f"round {round}: round {round - 1} of {ctx.location.url} is not done; materialize its "
                             "partition first", allow_retries=False)
        if round == 0 and step.name not in ("train", "export"):
            return dg.MaterializeResult(metadata={"round": 0, "done": "round 0 only evaluates the start model"})
        _reach(ctx, round)
        return dg.MaterializeResult(metadata={"round": round, **step.run(ctx, round)})

    return materialize_step


def _reach(ctx: RoundContext, round: int) -> None:
    """Make `round` part of the run's target (RUN/pipeline.json), as `--rounds +K` does: the last
    round checkpoints and evaluates, and an unpinned cosine schedule spans the rounds so far."""
    if round > ctx.target_rounds:
        storage = ctx.store.storage
        save_pipeline_state(storage, {**load_pipeline_state(storage), "target_rounds": round})
        ctx.target_rounds = round


def _run_resource(spec_path: str, run_dir: str) -> dg.ResourceDefinition:
    @dg.resource(description=f"The groupforge run of {spec_path} at {run_dir}, open for one Dagster run.")
    def groupforge_run(init_context: dg.InitResourceContext) -> Iterator[RoundContext]:
        with open_run(spec_path, run_dir, log=init_context.log.info) as ctx:
            yield ctx

    return groupforge_run


def next_round(run_dir: str) -> int:
    """The first round of the run without a record (0 for a new run)."""
    metrics = MetricsLog(RunLocation.of(run_dir).storage)
    done = {record["round"] for record in metrics.rounds()} if metrics.exists() else set()
    return next(round for round in range(len(done) + 1) if round not in done)


def _refresh_sensor(prefix: str, run_dir: str, rounds: dg.DynamicPartitionsDefinition, job,
                    every: int) -> dg.SensorDefinition:
    @dg.sensor(name=f"{prefix}_refresh", job=job, minimum_interval_seconds=every,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="Add the run's next round as a partition and materialize it, once the previous "
                           "round is done and no run of this job is in flight.")
    def refresh(context: dg.SensorEvaluationContext):
        in_flight = context.instance.get_run_records(dg.RunsFilter(
            job_name=job.name, statuses=[dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING,
                                         dg.DagsterRunStatus.STARTED]), limit=1)
        if in_flight:
            return dg.SkipReason("a round is running")
        key = str(next_round(run_dir))
        return dg.SensorResult(run_requests=[dg.RunRequest(partition_key=key)],
                               dynamic_partitions_requests=[rounds.build_add_request([key])])

    return refresh
