"""The round loop: generate with the newest policy, curate, train, checkpoint, evaluate.

    groupforge run SPEC [--run-dir DIR] [--rounds +K] [--no-wait]

    round 0    evaluate the starting model (greedy, eval prompts)
    round n    choose `per_round` prompts (least used first, then a seeded order)
               -> generate G responses each with the live engine (weights of the newest checkpoint)
               -> score -> filter -> label -> pair
               -> train `steps_per_round` optimizer steps on round n (+ `replay_rounds` earlier ones)
               -> checkpoint -> load the new weights into the engine -> evaluate
               -> append a record to RUN/metrics.jsonl

Every stage is resumable, so killing the process at any point and rerunning the same
command continues where it stopped: a round whose record is in metrics.jsonl is done; a
round's prompt choice is a file written once; generate keeps finished chunks and is skipped
once committed; curation stages skip when their manifests match; the trainer resumes from
its newest checkpoint. `--rounds +K` extends a finished run by K rounds (the target is kept
in RUN/pipeline.json). The run's lock keeps a second job off the same run.

The run folder's non-table files (spec.toml, pipeline.json, metrics.jsonl, _rounds/) are
named, read and written by curation/runlog.py; a round's record is its `RoundRecord`. The
loop is described in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import builtins
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from curation.generate.base import Generator, load_prompts
from curation.generate.stage import generate, make_generator
from curation.rewards.registry import get_reward
from curation.runlog import (
    SPEC_FILE,
    MetricsLog,
    RoundRecord,
    load_pipeline_state,
    round_prompts_path,
    save_pipeline_state,
    write_atomic,
)
from curation.store import RunStore
from pipelines.curate import STAGES, CurationSpec, run_stage
from pipelines.spec import PipelineSpec, dump_toml, load_spec
from training import checkpoint as ckpt
from training.config import TrainConfig
from training.data import NoTrainingData
from training.trainer import train


@dataclass
class RoundContext:
    """What one round needs: the run, its spec and the live generator (started lazily)."""

    spec: PipelineSpec
    store: RunStore
    target_rounds: int = 0
    generator: Generator | None = None
    log: Callable[[str], None] = print

    @property
    def run_dir(self) -> Path:
        return self.store.root

    @property
    def metrics(self) -> MetricsLog:
        return MetricsLog(self.store.root)


def run_pipeline(spec: PipelineSpec | str | Path, run_dir: str | Path | None = None,
                 extra_rounds: int | None = None, wait: bool = True, log: Callable[[str], None] = print,
                 on_round: Callable[[dict], None] | None = None) -> list[dict]:
    """Run (or resume, or extend by `extra_rounds`) the pipeline of `spec` (a spec or its
    TOML file); returns the round records of the run. The resolved spec is written to
    RUN/spec.toml."""
    if not isinstance(spec, PipelineSpec):
        spec = load_spec(spec)
    run_dir = Path(run_dir or Path("runs") / spec.run.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = RunStore(run_dir)
    with store.lock(wait=wait, on_wait=lambda msg: log(f"waiting: {msg}")):
        store.clean_tmp()
        target = _target_rounds(run_dir, spec, extra_rounds)
        write_atomic(run_dir / SPEC_FILE, dump_toml(spec.model_dump(mode="json")))
        ctx = RoundContext(spec=spec, store=store, target_rounds=target, log=log)
        try:
            for round in range(target + 1):
                if ctx.metrics.round_record(round) is not None:
                    continue
                record = evaluate_start(ctx) if round == 0 else run_round(ctx, round)
                ctx.metrics.append(record)
                if on_round is not None:
                    on_round(record.to_dict())
        finally:
            if ctx.generator is not None:
                ctx.generator.close()
    return ctx.metrics.rounds()


def run_round(ctx: RoundContext, round: int) -> RoundRecord:
    """Round `round` >= 1: generate, curate, train, evaluate; returns its metrics record."""
    spec, run_dir = ctx.spec, ctx.run_dir
    started = time.perf_counter()
    # The loop runs rounds in order, so the previous record is there; a missing one counts as
    # a start from the base model.
    found = ctx.metrics.round_record(round - 1)
    previous = RoundRecord.from_dict(found) if found else RoundRecord(round=round - 1, eval_accuracy=0.0)
    start_version = previous.policy_version

    # -- generate with the newest policy ---------------------------------------------------
    prompts_file = choose_prompts(ctx, round)
    gen_seconds, gen_tokens = 0.0, 0
    if ctx.store.load_manifest("generate", round) is None:
        generator = _generator(ctx, start_version)
        ctx.log(f"round {round}: generate {spec.prompts.per_round} prompts x {spec.generator.group_size} "
                f"with policy_version {generator.policy_version}")
        sampling = spec.generator.sampling(spec.run.seed)
        result = generate(run_dir, prompts_file, sampling, generator=generator, round=round,
                          run_id=spec.run.name, chunk_prompts=spec.generator.chunk_prompts)
        gen_seconds, gen_tokens = result.sample_seconds, result.response_tokens

    # -- curate ------------------------------------------------------------------------------
    curation = CurationSpec(score=spec.score, filter=spec.filter, label=spec.label, pair=spec.pair)
    for stage in STAGES:
        run_stage(stage, run_dir, round, curation)

    # -- train -------------------------------------------------------------------------------
    rounds = list(range(max(1, round - spec.run.replay_rounds), round + 1))
    # A cosine schedule spans the whole run unless the spec pins decay_steps (a run extended
    # with --rounds +K stretches it from there on).
    decay_steps = spec.train.decay_steps or ctx.target_rounds * spec.run.steps_per_round
    cfg = TrainConfig(**{**spec.train.model_dump(), "rounds": rounds, "seed": spec.run.seed,
                         "temperature": spec.generator.temperature, "decay_steps": decay_steps})
    end_step = start_version + spec.run.steps_per_round
    steps, train_tokens_per_s = start_version, 0.0
    if ckpt.latest_checkpoint(run_dir) is None or _latest_step(run_dir) < end_step:
        try:
            ctx.log(f"round {round}: train {spec.train.objective} steps {start_version + 1}..{end_step}")
            steps = train(run_dir, cfg, steps=end_step, model=spec.model.path).end_step
        except NoTrainingData as exc:
            ctx.log(f"round {round}: no training ({exc})")
    else:
        steps = _latest_step(run_dir)
    step_records = [s for s in ctx.metrics.steps() if start_version < s["step"] <= steps]
    if step_records:
        train_tokens_per_s = sum(s["tokens_per_s"] for s in step_records) / len(step_records)

    # -- evaluate the new policy -------------------------------------------------------------
    accuracy = evaluate(ctx, steps)
    stats = round_stats(ctx.store, round)
    manifest = ctx.store.load_manifest("generate", round) or {}
    gen_seconds = gen_seconds or float(manifest.get("sample_seconds", 0.0))
    gen_tokens = gen_tokens or int(manifest.get("response_tokens", 0))
    wall = time.perf_counter() - started
    decimals = builtins.round  # `round` is the round number here
    return RoundRecord(
        round=round, eval_accuracy=accuracy, **stats,
        samples_total=previous.samples_total + stats["samples"],
        policy_version=steps, steps=steps - start_version, objective=spec.train.objective,
        wall_seconds=decimals(wall, 2), elapsed_seconds=decimals(previous.elapsed_seconds + wall, 2),
        gen_tokens_per_s=decimals(gen_tokens / gen_seconds, 1) if gen_seconds else 0.0,
        train_tokens_per_s=decimals(train_tokens_per_s, 1))


def evaluate_start(ctx: RoundContext) -> RoundRecord:
    """Round 0: the starting model's eval accuracy (no samples, no training)."""
    started = time.perf_counter()
    accuracy = evaluate(ctx, 0)
    wall = round(time.perf_counter() - started, 2)
    return RoundRecord(round=0, eval_accuracy=accuracy, objective=ctx.spec.train.objective,
                       wall_seconds=wall, elapsed_seconds=wall)


def evaluate(ctx: RoundContext, policy_version: int) -> float:
    """Mean of the eval metric over greedy responses to the eval prompts."""
    spec = ctx.spec
    generator = _generator(ctx, policy_version)
    prompts = load_prompts(spec.prompts.eval)
    if spec.prompts.eval_limit:
        prompts = prompts.slice(0, spec.prompts.eval_limit)
    texts = prompts.column("prompt").to_pylist()
    messages = prompts.column("messages").to_pylist()
    token_ids = [generator.tokenize(p, m) for p, m in zip(texts, messages)]
    responses = generator.greedy(token_ids, spec.eval.max_tokens or spec.generator.max_tokens)
    metric = get_reward(spec.eval.metric)
    columns = {name: prompts.column(name).to_pylist() for name in ("reference", "metadata")}
    values = metric([p if p is not None else m for p, m in zip(texts, messages)], responses, **columns)
    scored = [v for v in values if v is not None]
    if not scored:
        raise ValueError(f"eval metric {spec.eval.metric!r} gave no value for any eval prompt "
                         f"({spec.prompts.eval}: is the `reference` column empty?)")
    return float(sum(scored) / len(scored))


def choose_prompts(ctx: RoundContext, round: int) -> Path:
    """The prompts of `round`, written once to RUN/_rounds/round=<n>/prompts.parquet: the
    `per_round` prompts of the spec's train files used least so far (in the samples of earlier
    rounds); among those, prompts of files new to the run first (a scheduled refresh that adds
    a file trains on it next), then a hash of (seed, round, prompt_id). The train files are
    recorded in RUN/pipeline.json (`prompt_files`); on a new run no file counts as new."""
    path = round_prompts_path(ctx.run_dir, round)
    if path.is_file():
        return path
    spec = ctx.spec
    state = load_pipeline_state(ctx.run_dir)
    seen = set(state.get("prompt_files", []))
    pool, is_new = _prompt_pool(spec.prompts.train, seen if seen else None)
    used: dict[str, int] = {}
    for earlier in ctx.store.rounds("samples"):
        if earlier < round:
            for prompt_id in _distinct_prompt_ids(ctx.store, earlier):
                used[prompt_id] = used.get(prompt_id, 0) + 1
    ids = pool.column("prompt_id").to_pylist()
    order = sorted(range(len(ids)),
                   key=lambda i: (used.get(ids[i], 0), not is_new[i], _tiebreak(spec.run.seed, round, ids[i])))
    chosen = pool.take(pa.array(order[: spec.prompts.per_round]))
    write_atomic(path, lambda f: pq.write_table(chosen, f))
    save_pipeline_state(ctx.run_dir, {**state, "prompt_files": sorted(seen | {str(f) for f in spec.prompts.train})})
    return path


def round_stats(store: RunStore, round: int) -> dict:
    """reward_mean, samples, groups, kept_groups, pairs of `round`, from its tables."""
    def query(sql: str, table: str, empty: tuple) -> tuple:
        files = [str(f) for f in store.files(table, round)]
        if not files:
            return empty
        source = "read_parquet($f, hive_partitioning = false, union_by_name = true)"
        return duckdb.sql(sql.format(t=source), params={"f": files}).fetchall()[0]

    (samples,) = query("SELECT count(*) FROM {t}", "samples", (0,))
    (reward,) = query("SELECT avg(reward) FROM {t}", "scores", (None,))
    groups, kept = query("SELECT count(DISTINCT prompt_id), count(DISTINCT prompt_id) FILTER (WHERE group_kept) "
                         "FROM {t}", "groups", (0, 0))
    (pairs,) = query("SELECT count(*) FROM {t}", "pairs", (0,))
    return {"reward_mean": None if reward is None else float(reward), "samples": int(samples),
            "groups": int(groups), "kept_groups": int(kept), "pairs": int(pairs)}


# -- helpers ---------------------------------------------------------------------------------

def _generator(ctx: RoundContext, policy_version: int) -> Generator:
    """The live generator holding the weights of `policy_version` (started on first use;
    new weights are loaded in place from the checkpoint folder)."""
    spec = ctx.spec
    if ctx.generator is None:
        folder = ckpt.checkpoint_dir(ctx.run_dir, policy_version) if policy_version else Path(spec.model.path)
        kwargs = {**spec.generator.generator_kwargs(), "policy_version": policy_version}
        if spec.generator.backend == "vllm":
            kwargs["seed"] = spec.run.seed  # the engine's own seed; every group also has its own
        ctx.log(f"starting the {spec.generator.backend} engine on {folder}")
        # The engine loads tokenizer and config from the base model; weights from the checkpoint.
        ctx.generator = make_generator(spec.generator.backend, spec.model.path, **kwargs)
        if policy_version:
            ctx.generator.update_weights(folder, policy_version)
    elif ctx.generator.policy_version != policy_version:
        ctx.generator.update_weights(ckpt.checkpoint_dir(ctx.run_dir, policy_version), policy_version)
    return ctx.generator


def _prompt_pool(files: list[str], seen: set[str] | None) -> tuple[pa.Table, list[bool]]:
    """Every prompt of the spec's train files (first occurrence of each prompt_id kept), and
    whether it comes from a file the run has not seen before (None: nothing is new)."""
    tables = [load_prompts(f) for f in files]
    new_flags = [[seen is not None and str(f) not in seen] * t.num_rows for f, t in zip(files, tables)]
    table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    is_new = [flag for flags in new_flags for flag in flags]
    ids = table.column("prompt_id").to_pylist()
    seen_ids: set[str] = set()
    keep = [i for i, prompt_id in enumerate(ids) if not (prompt_id in seen_ids or seen_ids.add(prompt_id))]
    if len(keep) < len(ids):
        return table.take(pa.array(keep)), [is_new[i] for i in keep]
    return table, is_new


def _distinct_prompt_ids(store: RunStore, round: int) -> list[str]:
    files = [str(f) for f in store.files("samples", round)]
    rows = duckdb.sql("SELECT DISTINCT prompt_id FROM read_parquet($f, hive_partitioning = false)",
                      params={"f": files}).fetchall()
    return [row[0] for row in rows]


def _tiebreak(seed: int, round: int, prompt_id: str) -> str:
    return hashlib.sha256(f"{seed}:{round}:{prompt_id}".encode()).hexdigest()


def _latest_step(run_dir: Path) -> int:
    found = ckpt.list_checkpoints(run_dir)
    return found[-1][0] if found else 0


def _target_rounds(run_dir: Path, spec: PipelineSpec, extra_rounds: int | None) -> int:
    """The last round this invocation runs to: the spec's rounds, or the previous target plus
    `extra_rounds` (`--rounds +K`); kept in RUN/pipeline.json."""
    state = load_pipeline_state(run_dir)
    target = max(int(state.get("target_rounds", 0)), spec.run.rounds)
    if extra_rounds:
        done = max([record["round"] for record in MetricsLog(run_dir).rounds()], default=0)
        target = max(target, done) + extra_rounds
    save_pipeline_state(run_dir, {**state, "target_rounds": target})
    return target
