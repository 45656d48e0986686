"""The phases of a round of the loop, each called from the loop's body (pipelines/loop/run.py).

    live_generator      the engine with the weights of a policy version (started on first use;
                        new weights from the trainer's memory, else the checkpoint folder)
    sample              generate G responses per prompt with the live engine (a stage of the round;
                        with `[env]` G multi-turn trajectories, as prefetch and the refills do)
    prefetch            `[run] overlap = 1`: the next round's generate in a thread, so the engines
                        sample while the trainer trains; `wait_for_prefetch` takes its result
    curate_round        score -> filter -> label (-> pair: `loop_stages`), each committed
                        before the next runs (the next reads it from the store's held parts)
    round_stats         reward mean, samples, groups, kept groups, pairs: from those tables
    trajectory_stats    a multi-turn round's tool use, tool errors, turns and stop reasons (its samples)
    train_round         the round's optimizer steps (`checkpoints`: whether it checkpoints)
    replay              after a restart, train again the rounds no checkpoint holds
    evaluate            the eval metric over greedy responses (`evaluates`: whether a round does);
                        with `[env]` over greedy trajectories against the environment
    keep_best           `[run] keep_best`: RUN/checkpoints/best.json names the best evaluated checkpoint
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from curation.env.environments import opened_environment, prompt_messages, template_tools
from curation.generate.base import Generator, SamplingConfig, load_prompts
from curation.generate.stage import GenerateResult, generate, make_generator, resolve_backend
from curation.generate.turns import roll_out
from curation.rewards.registry import get_reward
from curation.stages.runner import run_stage
from pipelines.loop.curate import STAGES
from pipelines.spec import PipelineSpec
from store.faults import fault_point
from store.location import local_folder
from store.run_files import BestCheckpoint, RoundRecord, save_best
from store.run_store import RunStore
from store.weights import count_parameters
from training import checkpoint as ckpt
from training.config import TrainConfig, steps_for_passes
from training.data import NoTrainingData, count_training_rows
from training.sizing import GIB
from training.sizing import engine_bytes as engine_memory
from training.trainer import LoopOptions, TrainResult, train

if TYPE_CHECKING:
    from pipelines.loop.run import RoundContext
    from training.ray_ranks import TrainerRanks


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


def sample(ctx: RoundContext, round: int, prompts_file: Path, policy_version: int, stage: str = "generate") -> None:
    """Generate G responses per prompt of `prompts_file` as `stage` of the round (the round's
    generate, or a refill's call) with the engine holding `policy_version`, committed as one."""
    generator = live_generator(ctx, policy_version)
    ctx.log(f"round {round}: {stage} {pq.read_metadata(prompts_file).num_rows} prompts x "
            f"{ctx.spec.generator.group_size} with policy_version {generator.policy_version}")
    with ctx.clock("generate"):
        result = _generate_call(ctx, ctx.store, round, prompts_file, generator, stage)
    ctx.clock.model += result.sample_seconds


def prefetch(ctx: RoundContext, round: int, prompts_file: Path, policy_version: int) -> None:
    """Start round `round`'s generate in a thread with the weights of `policy_version` (the
    engines run in other processes; their calls are in order, so weights loaded later wait
    for these samples). The thread commits through a store of its own (the loop's is read by
    the trainer meanwhile): the round reads its samples from the files."""
    generator = live_generator(ctx, policy_version)
    ctx.log(f"round {round}: generate {pq.read_metadata(prompts_file).num_rows} prompts x "
            f"{ctx.spec.generator.group_size} with policy_version {generator.policy_version}, while round "
            f"{round - 1} trains")
    if ctx.pool is None:
        ctx.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="groupforge-prefetch")
    ctx.prefetch = (round, ctx.pool.submit(_generate_call, ctx, ctx.store.sibling(), round, prompts_file,
                                           generator, "generate"))


def wait_for_prefetch(ctx: RoundContext) -> None:
    """The round's generate, started by `prefetch` while the previous round trained: wait for it
    (its error is raised here) and read its commits."""
    with ctx.clock("generate"):
        tic = time.perf_counter()
        future, ctx.prefetch = ctx.prefetch[1], None
        future.result()
        ctx.clock.model += time.perf_counter() - tic  # only the wait: the rest ran beside training
    ctx.store.catch_up()  # the thread's commits


def _generate_call(ctx: RoundContext, store: RunStore, round: int, prompts_file: Path, generator: Generator,
                   stage: str) -> GenerateResult:
    spec = ctx.spec
    return generate(store, prompts_file, spec.generator.sampling(spec.run.seed), generator=generator,
                    round=round, run_id=spec.run.name, chunk_prompts=spec.generator.chunk_prompts, stage=stage,
                    env=spec.env)


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
    objective trains on pairs, `[run] pairs = "every_round"`, or the run appends preference
    pairs to a dataset (`[export] append_to`); pairs derive from the groups tables alone, so
    `groupforge pair RUN` makes them for every round afterwards."""
    appends = spec.export.append_to is not None and spec.export.format == "preference"
    wanted = spec.run.pairs == "every_round" or spec.train.objective == "pairwise" or appends
    return STAGES if wanted else tuple(stage for stage in STAGES if stage != "pair")


def curate_round(ctx: RoundContext, round: int, stages: Sequence[str] = STAGES) -> None:
    """`stages` (default score -> filter -> label -> pair) on the round, each committed
    through the loop's store before the next runs (which reads it from the store's held parts);
    a stage whose manifest matches its inputs and config is skipped (curation/stages/runner.py)."""
    for stage in stages:
        with ctx.clock(stage):
            run_stage(stage, ctx.store, round, getattr(ctx.spec, stage))


def round_stats(store: RunStore, round: int, paired: bool) -> dict:
    """reward_mean, samples, groups, kept_groups, pairs (None unless the round ran the pair
    stage, `paired`) of `round`: from its tables (held parts from memory); samples from the
    generate manifests."""
    rewards = store.read_columns("scores", ["reward"], round).column("reward")
    groups = store.read_columns("groups", ["prompt_id", "group_kept"], round)
    return {"reward_mean": pc.mean(rewards).as_py() if len(rewards) else None,
            "samples": sum(int(m.get("rows_out") or 0) for m in sampling_manifests(store, round)),
            "groups": pc.count_distinct(groups.column("prompt_id")).as_py(),
            "kept_groups": _kept(groups),
            "pairs": store.read_columns("pairs", ["prompt_id"], round).num_rows if paired else None}


def trajectory_stats(store: RunStore, round: int) -> dict:
    """The record's multi-turn keys (store.run_files.TRAJECTORY_KEYS) of `round`, from its samples'
    trajectory columns (held parts from memory): tool_use_rate, tool_calls, tool_errors,
    mean_turns and stop_reasons; {} when no sample of the round has them (single-turn)."""
    samples = store.read_columns("samples", ["num_turns", "tool_calls", "tool_errors", "stop_reason"], round)
    samples = samples.filter(pc.is_valid(samples.column("num_turns")))
    if not samples.num_rows:
        return {}
    calls = samples.column("tool_calls")
    reasons = pc.value_counts(samples.column("stop_reason")).to_pylist()
    return {"tool_use_rate": pc.mean(pc.greater(calls, 0).cast(pa.float64())).as_py(),
            "tool_calls": pc.sum(calls).as_py(),
            "tool_errors": pc.sum(samples.column("tool_errors")).as_py(),
            "mean_turns": pc.mean(samples.column("num_turns")).as_py(),
            "stop_reasons": {item["values"]: item["counts"] for item in sorted(reasons, key=lambda i: i["values"])}}


def kept_groups(store: RunStore, round: int) -> int:
    """round_stats' kept_groups alone."""
    return _kept(store.read_columns("groups", ["prompt_id", "group_kept"], round))


def _kept(groups: pa.Table) -> int:
    kept = groups.filter(pc.fill_null(groups.column("group_kept"), False))
    return pc.count_distinct(kept.column("prompt_id")).as_py()


@dataclass(frozen=True)
class Trained:
    """What a round's training did (`train_round`)."""

    policy_version: int
    """The policy after the round's steps (the one it started from when it trained none)."""
    decay_steps: int
    """The cosine horizon it trained under."""
    tokens_per_s: list[float]
    """Training tokens per second of each of its optimizer steps (metrics.jsonl step lines)."""


def train_round(ctx: RoundContext, round: int, start_version: int, save: bool) -> Trained:
    """Train round `round`'s steps from `start_version`: `steps_per_round`, or with
    `[train] passes` the steps that draw its rows that many times; the last one checkpoints
    when `save` (`checkpoints`)."""
    spec = ctx.spec
    since = ctx.metrics.position()
    decay_steps = cosine_horizon(spec, ctx.target_rounds)
    cfg = train_config(spec, round, decay_steps)
    steps = spec.run.steps_per_round
    if cfg.passes is not None:
        rows = count_training_rows(ctx.store, cfg.objective, cfg.rounds, cfg.max_staleness, cfg.sft_min_reward)
        steps = steps_for_passes(rows, cfg.batch_size, cfg.passes)
    try:
        ctx.log(f"round {round}: train {spec.train.objective} steps {start_version + 1}..{start_version + steps}")
        end = _train(ctx, cfg, start_version + steps, save).end_step
    except NoTrainingData as exc:
        ctx.log(f"round {round}: no training ({exc})")
        end = start_version
    rates = [s["tokens_per_s"] for s in ctx.metrics.records_since(since)
             if s.get("event") == "step" and start_version < s.get("step", 0) <= end]
    return Trained(end, decay_steps, rates)


def checkpoints(ctx: RoundContext, round: int) -> bool:
    """Whether round `round` checkpoints its weights: every `checkpoint_every` rounds, the last
    round, and with `[run] keep_best` every round that evaluates (otherwise the engine gets the
    trainer's weights from memory)."""
    run = ctx.spec.run
    return round % run.checkpoint_every == 0 or round >= ctx.target_rounds or (run.keep_best and evaluates(ctx, round))


def evaluates(ctx: RoundContext, round: int) -> bool:
    """Whether `round` evaluates: round 0, the last round, and every `[eval] every`-th."""
    return round == 0 or round >= ctx.target_rounds or round % ctx.spec.eval.every == 0


def evaluate(ctx: RoundContext, policy_version: int) -> float:
    """Mean of the eval metric over greedy responses to the eval prompts."""
    spec = ctx.spec
    with ctx.clock("eval"):
        generator = live_generator(ctx, policy_version)
        if ctx.eval_set is None:
            ctx.eval_set = eval_set(spec, generator)
        prompts = ctx.eval_set
        tic = time.perf_counter()
        if spec.env is None:
            responses = generator.greedy(prompts.token_ids, spec.eval.max_tokens or spec.generator.max_tokens)
        else:
            responses = greedy_trajectories(spec, generator, prompts)
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
    if spec.env is not None:  # the metric takes a trajectory's prompt as messages, as the score stage does
        rows = prompts.to_pylist()
        return EvalSet(token_ids=[], prompts=[prompt_messages(row) for row in rows],
                       columns={name: prompts.column(name).to_pylist() for name in ("reference", "metadata")},
                       rows=rows)
    return EvalSet(token_ids=[generator.tokenize(p, m) for p, m in zip(texts, messages)],
                   prompts=[p if p is not None else m for p, m in zip(texts, messages)],
                   columns={name: prompts.column(name).to_pylist() for name in ("reference", "metadata")})


def greedy_trajectories(spec: PipelineSpec, generator: Generator, prompts: EvalSet) -> list[list[dict]]:
    """Each eval prompt's trajectory against the spec's `[env]`, decoded greedily (top_k 1), as
    the metric takes it: the messages after the prompt, ending with the last assistant turn."""
    sampling = SamplingConfig(group_size=1, max_tokens=spec.eval.max_tokens or spec.generator.max_tokens,
                              temperature=1.0, top_k=1, seed=spec.run.seed)
    with opened_environment(spec.env) as environment:
        openings = [environment.reset(row) for row in prompts.rows]
        _, groups = roll_out(generator, generator.tokenizer, environment, openings, [spec.run.seed] * len(openings),
                             sampling, tools=template_tools(environment), max_turns=spec.env.max_turns,
                             max_tokens=spec.env.max_tokens)
    return [group[0].messages_out for group in groups]


@dataclass
class EvalSet:
    """The eval prompts as the engine and the metric take them: read and tokenized once per run."""

    token_ids: list[list[int]]
    prompts: list
    """Each prompt's text, or its messages."""
    columns: dict[str, list]
    """reference and metadata, for the metric."""
    rows: list[dict] = field(default_factory=list)
    """With `[env]`: the prompt rows, which the environment's reset opens."""


def keep_best(ctx: RoundContext, round: int, policy_version: int, accuracy: float) -> BestCheckpoint | None:
    """`[run] keep_best`: name round `round`'s checkpoint in RUN/checkpoints/best.json when its eval
    accuracy beats every earlier round's (rounds >= 1; the earliest wins a tie). The round
    checkpointed its weights (train_round), unless it trained none (no checkpoint to keep).
    Returns the new record, or None when the best stays."""
    earlier = [record["eval_accuracy"] for done, record in ctx.records.items()
               if 1 <= done < round and record.get("eval_accuracy") is not None]
    if earlier and accuracy <= max(earlier):
        return None
    if policy_version not in ckpt.checkpoint_steps(ctx.location):
        ctx.log(f"round {round}: keep_best: no checkpoint of policy_version {policy_version} (nothing trained yet)")
        return None
    best = BestCheckpoint(round=round, policy_version=policy_version, eval_accuracy=accuracy,
                          checkpoint=ckpt.checkpoint_rel(policy_version))
    save_best(ctx.location.storage, best)
    ctx.log(f"round {round}: best eval accuracy so far ({100 * accuracy:.1f}%): kept {best.checkpoint}")
    return best


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


def _train(ctx: RoundContext, cfg: TrainConfig, steps: int, save: bool) -> TrainResult:
    """One trainer call on the live session (reading the round's tables through the loop's
    store: held parts from memory); its new weights are kept for the engine. The micro-batch
    plan is printed when it first appears or changes."""
    with ctx.clock("train"):
        if ctx.spec.train.nproc > 1:
            result = trainer_ranks(ctx).train(ctx.location.url, cfg, steps=steps, model=ctx.spec.model.path,
                                              options=LoopOptions(save=save, return_state=True))
        else:
            options = LoopOptions(save=save, return_state=True, engine_bytes=engine_bytes(ctx))
            result = train(ctx.store, cfg, steps=steps, model=ctx.spec.model.path, session=ctx.session,
                           options=options)
    if result.plan is not None and result.plan.describe() != ctx.micro_batches:
        ctx.micro_batches = result.plan.describe()
        ctx.log(f"trainer: {ctx.micro_batches}")
    ctx.clock.move(result.checkpoint_seconds, "train", "checkpoint")
    ctx.clock.model += result.step_seconds
    if result.state_dict is not None:
        ctx.weights = (result.end_step, result.state_dict)
    return result


def engine_bytes(ctx: RoundContext) -> int:
    """Memory the engine in this process holds, which the trainer's budget leaves out: its weights
    and, for vLLM, its KV cache (VLLM_CPU_KVCACHE_SPACE GiB), or on a GPU its whole share
    (gpu_memory_utilization). 0 for engines on Ray or not started."""
    gen = ctx.spec.generator
    if ctx.generator is None or gen.uses_ray:
        return 0
    if torch.cuda.is_available():
        return int(gen.gpu_memory_utilization * torch.cuda.get_device_properties(0).total_memory) \
            if ctx.generator.name == "vllm" else 0
    kv_cache = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1) * GIB if ctx.generator.name == "vllm" else 0
    dtype_bytes = 4 if gen.dtype == "float32" else 2
    return engine_memory(count_parameters(local_folder(ctx.spec.model.path)), dtype_bytes, int(kv_cache))


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
    have = live.step if live.live else max(ckpt.checkpoint_steps(ctx.location), default=0)
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

