"""The generate stage: prompts file + policy -> RUN/samples/round=<n>/ (+ prompts, rejects).

    prompts file ──load_prompts──> prompt_id, prompt|messages, reference, metadata
        │ tokenize; len(prompt) >= max_model_len  ──> rejects (generate, prompt_too_long)
        ▼
    generator.sample(chunk of prompts, per-prompt seeds, n=G) ──> RUN/_staging/generate-round=<n>/chunk-*.parquet
        ▼ (all chunks done)
    one atomic commit: samples/round=<n>/part-generate-<sha>.parquet, rejects/...,
    prompts/part-<fp>-<sha>.parquet, then its Delta versions and its row in RUN/_commits (with the manifest)

A round may sample several prompts files: the first as stage "generate", more (the round
loop's refills) under their own stage names, each with its own commits and part files
(`part-<stage>-<sha>.parquet`; prompts `part-<stage>-<fingerprint>-<sha>.parquet`).

Finished chunks survive a kill and are reused by the rerun (when inputs and config are
unchanged; a prompts file of one chunk is sampled and committed without staging); nothing
reaches a table folder before the last chunk is done. A rerun of a finished round with the
same inputs and config does nothing (the manifest says it is up to date), without starting a
generator. Callers hold the run's lock (`RunStore.lock()`).

A generator is started here by `make_generator(backend, model)` (backend "vllm" or "hf"),
or passed in live (the round loop keeps one across rounds); its defaults are
`curation.generate.base.GENERATOR_DEFAULTS`.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from curation.env.config import EnvConfig
from curation.env.environments import Environment, opened_environment, template_tools
from curation.generate.base import GENERATOR_DEFAULTS, Completion, Generator, SamplingConfig, load_prompts, prompt_seed
from curation.generate.turns import RollOut, Trajectory, prompt_token_ids, roll_out, trajectory_columns
from curation.stages.common import rejects_table
from store.errors import JobError
from store.faults import fault_point
from store.fingerprints import config_hash, known_fingerprint
from store.run_store import RunStore
from store.schema import SCHEMAS, TRAJECTORY_FIELDS, SchemaError, validate
from store.storage import Storage
from store.weights import check_model_folder, count_parameters, weights_fingerprint

STAGE = "generate"
READS = ("prompts file", "model weights")
WRITES = ("samples", "rejects", "prompts")


@dataclass
class GenerateResult:
    """What one `generate` call did (its manifest records the same counts)."""

    round: int
    skipped: bool
    """The round was up to date: nothing was sampled or written."""
    prompts: int = 0
    """Distinct prompts of the prompts file."""
    samples: int = 0
    rejected_prompts: int = 0
    """Prompts as long as the generator's context (rejects, reason prompt_too_long)."""
    response_tokens: int = 0
    seconds: float = 0.0
    """Wall seconds of the call, generator start-up included."""
    resumed_chunks: int = 0
    """Chunks reused from an interrupted earlier call (RUN/_staging)."""
    sample_seconds: float = 0.0
    """Time inside the generator's sampling calls (no start-up, no I/O)."""
    manifest: dict = field(default_factory=dict)


AUTO_HF_MAX_PARAMS = 5_000_000
"""backend "auto" on CPU: models with fewer weights than this get hf, larger ones vLLM.
Measured on 2 CPU cores (BENCHMARKS.md, generate): on the 0.5M toy hf samples 6.9x
vLLM's samples/s (vLLM's per-step overhead dominates a tiny model; hf prefills each prompt once
for its G samples and drops finished rows); at 54M weights vLLM generates 1.52x hf's tokens/s.
The crossover between them is not measured."""


def resolve_backend(backend: str, model: str | Path) -> str:
    """The backend to start: `backend` itself, or for "auto", vllm on a machine with CUDA and
    for models of AUTO_HF_MAX_PARAMS weights or more (read from the safetensors headers), else hf."""
    if backend != "auto":
        return backend
    import torch

    from store.location import local_folder

    if torch.cuda.is_available():
        return "vllm"
    return "vllm" if count_parameters(local_folder(model)) >= AUTO_HF_MAX_PARAMS else "hf"


RAY_KEYS = ("engines", "ray_address", "engine_cpus", "engine_gpus")
"""The `make_generator` keywords that start the engines on Ray (`GeneratorConfig.uses_ray`)."""


def make_generator(backend: str, model: str | Path, **kwargs) -> Generator:
    """Start a generator of `backend` ('vllm', 'hf', or 'auto': `resolve_backend`) on a model
    folder; `kwargs` go to its class (`GeneratorConfig.generator_kwargs(backend)` gives them
    from a spec's settings). With `engines` > 1 or a `ray_address` it is a
    `curation.generate.ray_engines.RayGenerator` over that many engines of `backend`. `model`
    may be an object-store URL: each engine reads its node's copy (`local_folder`)."""
    from store.location import local_folder

    check_model_folder(local_folder(model), trust_remote_code=kwargs.get("trust_remote_code", False))
    backend = resolve_backend(backend, model)
    ray_settings = {key: kwargs.pop(key) for key in RAY_KEYS if key in kwargs}
    if ray_settings.get("engines", 1) > 1 or ray_settings.get("ray_address") is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise JobError(f"generator.engines = {ray_settings.get('engines', 1)} runs the engines on Ray, "
                               "which is not installed: pip install 'groupforge[ray]'") from None
        from curation.generate.ray_engines import RayGenerator

        return RayGenerator(backend, model, **{"engines": 1, **ray_settings}, **kwargs)
    if backend == "vllm":
        from curation.generate.vllm import VLLMGenerator

        return VLLMGenerator(model, **kwargs)
    if backend == "hf":
        from curation.generate.hf import HFGenerator

        return HFGenerator(model, **kwargs)
    raise ValueError(f"unknown generator backend {backend!r}; choose 'vllm', 'hf' or 'auto'")


def generate(
    run: RunStore | str | Path,
    prompts_file: str | Path,
    sampling: SamplingConfig,
    *,
    model: str | Path | None = None,
    backend: str = GENERATOR_DEFAULTS.backend,
    generator: Generator | None = None,
    round: int = 0,
    run_id: str | None = None,
    force: bool = False,
    chunk_prompts: int = GENERATOR_DEFAULTS.chunk_prompts,
    progress=None,
    generator_kwargs: dict | None = None,
    stage: str = STAGE,
    env: EnvConfig | None = None,
) -> GenerateResult:
    """Sample `sampling.group_size` responses for every prompt in `prompts_file` into the run
    (a folder, or the RunStore the commit goes through: the round loop's holds the tables).

    Pass a live `generator` (kept across rounds) or a `model` folder and `backend` name (a
    generator is started, with `generator_kwargs`, only when there is work to do).
    `progress(done, total)` is called as prompts finish. `stage` names the manifest and the
    part files (another name than "generate" adds a second set of samples to the round).
    With `env` each sample is a multi-turn trajectory against that environment
    (curation/generate/turns.py), written with the samples table's trajectory columns.
    """
    if generator is None and model is None:
        raise ValueError("generate needs a model folder or a live generator")
    store = run if isinstance(run, RunStore) else RunStore(run)
    run_id = run_id or store.name
    prompts = load_prompts(prompts_file)
    policy_version = generator.policy_version if generator is not None else 0
    if generator is None:
        backend = resolve_backend(backend, model)  # the manifest names the backend that ran
    inputs = {
        "prompts": known_fingerprint(prompts_file),
        "weights": generator.weights_sha256 if generator is not None else weights_fingerprint(model),
    }
    config = {
        "sampling": sampling.as_dict(),
        "backend": generator.name if generator is not None else backend,
        "run_id": run_id,
        "policy_version": policy_version,
    }
    if env is not None:
        config["env"] = env.model_dump(mode="json")
    if not force and store.is_up_to_date(stage, round, inputs, config):
        return GenerateResult(round=round, skipped=True, manifest=store.load_manifest(stage, round) or {})

    started = time.perf_counter()
    owns_generator = generator is None
    if generator is None:
        generator = make_generator(backend, model, **(generator_kwargs or {}))
    # What the samples record is read now: the round loop may load newer weights into a live
    # generator while this call's samples are still being written (`[run] overlap`).
    call = _Call(store, stage, round, run_id, inputs, config, sampling, generator.fingerprint, env)
    try:
        with opened_environment(env) if env is not None else nullcontext() as environment:
            result = _generate(call, generator, prompts, Path(prompts_file), chunk_prompts, progress, environment)
    finally:
        if owns_generator:
            generator.close()
    result.seconds = time.perf_counter() - started
    return result


@dataclass(frozen=True)
class _Call:
    """One generate call's identity: where it commits and what its manifest records."""

    store: RunStore
    stage: str
    round: int
    run_id: str
    inputs: dict
    config: dict
    sampling: SamplingConfig
    fingerprint: str
    """The generator's fingerprint when the call started (the samples' `generator` column)."""
    env: EnvConfig | None = None
    """A multi-turn generate's environment (None: one response per sample)."""


@dataclass
class _Sampled:
    """The samples of one call's prompts, chunk by chunk."""

    samples: pa.Table
    resumed_chunks: int
    sample_seconds: float


def _generate(call: _Call, generator: Generator, prompts: pa.Table, prompts_file: Path, chunk_prompts: int,
              progress, environment: Environment | None = None) -> GenerateResult:
    """Tokenize, reject prompts as long as the context, sample the rest, commit."""
    prompt_ids = prompts.column("prompt_id").to_pylist()
    openings: list[list[dict]] | None = None
    try:
        if environment is None:
            token_ids = [generator.tokenize(p, m) for p, m in
                         zip(prompts.column("prompt").to_pylist(), prompts.column("messages").to_pylist())]
        else:
            openings = [environment.reset(row) for row in prompts.to_pylist()]
            tools = template_tools(environment)
            token_ids = [prompt_token_ids(generator.tokenizer, messages, tools) for messages in openings]
    except ValueError as exc:  # e.g. messages and a tokenizer without a chat template
        raise SchemaError(f"prompts file ({prompts_file}): {exc}") from None
    # A prompt as long as the context would abort a whole vLLM batch: reject it up front.
    too_long = [i for i, ids in enumerate(token_ids) if len(ids) >= generator.max_model_len]
    todo = [i for i, ids in enumerate(token_ids) if len(ids) < generator.max_model_len]
    rejects = rejects_table(
        call.run_id, call.round, [prompt_ids[i] for i in too_long], [None] * len(too_long), call.stage,
        "prompt_too_long",
        [f"{len(token_ids[i])} prompt tokens >= max_model_len {generator.max_model_len}" for i in too_long])
    turns = None if environment is None else _Turns(environment, openings)
    done = _sample(call, generator, prompt_ids, token_ids, todo, chunk_prompts,
                   None if progress is None else lambda n: progress(n + len(too_long), len(prompt_ids)), turns)
    response_tokens = int(pc.sum(pc.list_value_length(done.samples.column("response_token_ids"))).as_py() or 0)
    prompts_part = call.inputs["prompts"][:16]
    if call.stage != STAGE:
        prompts_part = f"{call.stage}-{prompts_part}"
    with call.store.commit(call.stage, call.round, inputs=call.inputs, config=call.config) as commit:
        commit.write("samples", done.samples)
        commit.write("rejects", rejects)
        commit.write("prompts", prompts, part=prompts_part)
        commit.record(
            rows_in=len(prompt_ids),
            rows_out=done.samples.num_rows,
            drops={"prompt_too_long": len(too_long)} if too_long else {},
            generator=call.fingerprint,
            prompts_file=str(prompts_file),
            response_tokens=response_tokens,
            resumed_chunks=done.resumed_chunks,
            sample_seconds=float(f"{done.sample_seconds:.3f}"),
        )
    return GenerateResult(
        round=call.round,
        skipped=False,
        prompts=len(prompt_ids),
        samples=done.samples.num_rows,
        rejected_prompts=len(too_long),
        response_tokens=response_tokens,
        resumed_chunks=done.resumed_chunks,
        sample_seconds=done.sample_seconds,
        manifest=call.store.load_manifest(call.stage, call.round) or {},
    )


@dataclass
class _Turns:
    """What a multi-turn generate's chunks share: the environment and each prompt's opening messages."""

    environment: Environment
    openings: list[list[dict]]


def _sample(call: _Call, generator: Generator, prompt_ids: list[str], token_ids: list[list[int]], todo: list[int],
            chunk_prompts: int, progress, turns: _Turns | None = None) -> _Sampled:
    """The samples of the prompts at positions `todo`, `chunk_prompts` at a time; with several
    chunks each is staged as it finishes (a killed call resumes from them), one is kept in memory.
    A multi-turn call stages every chunk, and a chunk's trajectories after each environment turn
    (`RollOut`), which a killed call goes on from."""
    chunks = [todo[s : s + chunk_prompts] for s in range(0, len(todo), chunk_prompts)]
    staging = _staging(call.store, call.stage, call.round, call.inputs, call.config) \
        if len(chunks) > 1 or turns is not None else None
    resumed, done_prompts, sample_seconds, parts = 0, 0, 0.0, []
    for k, chunk in enumerate(chunks):
        chunk_file = f"chunk-{k:06d}.parquet"
        staged = staging.read_if_exists(chunk_file) if staging is not None else None
        if staged is not None:
            resumed += 1
            parts.append(pq.read_table(pa.BufferReader(staged)))
        else:
            seeds = [prompt_seed(call.sampling.seed, call.round, prompt_ids[i]) for i in chunk]
            tic = time.perf_counter()
            if turns is None:
                groups = generator.sample([token_ids[i] for i in chunk], seeds, call.sampling)
            else:
                turn_file = f"chunk-{k:06d}.turn.json"
                staged_turn = staging.read_if_exists(turn_file)

                def stage_turn(state: RollOut, turn_file: str = turn_file) -> None:
                    staging.write(turn_file, state.to_json())
                    fault_point("generate.turn")

                _, groups = roll_out(generator, generator.tokenizer, turns.environment,
                                     [turns.openings[i] for i in chunk], seeds, call.sampling,
                                     tools=template_tools(turns.environment),
                                     max_turns=call.env.max_turns, max_tokens=call.env.max_tokens,
                                     resume=None if staged_turn is None else RollOut.from_json(staged_turn),
                                     on_turn=stage_turn)
            sample_seconds += time.perf_counter() - tic
            parts.append(_samples_table(call.run_id, call.round, call.sampling, call.fingerprint,
                                        call.config["policy_version"], [prompt_ids[i] for i in chunk],
                                        [token_ids[i] for i in chunk], seeds, groups))
            if staging is not None:
                sink = pa.BufferOutputStream()
                pq.write_table(parts[-1], sink)
                staging.write(chunk_file, sink.getvalue())
                fault_point("generate.chunk_staged")
        done_prompts += len(chunk)
        if progress is not None:
            progress(done_prompts)
    samples = pa.concat_tables(parts, promote_options="permissive") if parts else SCHEMAS["samples"].empty_table()
    return _Sampled(validate(samples, "samples"), resumed, sample_seconds)


def _staging(store: RunStore, stage: str, round: int, inputs: dict, config: dict) -> Storage:
    """The staging folder of this round, emptied when it holds chunks of other inputs/config."""
    staging = store.staging(stage, round)
    key = {"inputs": inputs, "config_hash": config_hash(config)}
    meta = staging.read_if_exists("staging.json")
    if meta is not None and json.loads(meta) == key:
        return staging
    staging.delete_all(e.rel for e in staging.list())
    staging.write("staging.json", json.dumps(key, sort_keys=True).encode())
    return staging


def _samples_table(run_id, round, sampling, fingerprint, policy_version, prompt_ids, token_ids, seeds,
                   groups) -> pa.Table:
    """The samples rows of `groups` (per prompt: its completions, or its trajectories with the
    trajectory columns added)."""
    rows: dict[str, list] = {name: [] for name in SCHEMAS["samples"].names}
    trajectories: list[Trajectory] = []
    for prompt_id, ids, seed, group in zip(prompt_ids, token_ids, seeds, groups):
        for idx, sample in enumerate(group):
            if isinstance(sample, Trajectory):
                trajectories.append(sample)
                completion = Completion(sample.token_ids, sample.logprobs, sample.last_text, sample.finish_reason)
            else:
                completion = sample
            rows["run_id"].append(run_id)
            rows["round"].append(round)
            rows["prompt_id"].append(prompt_id)
            rows["sample_idx"].append(idx)
            rows["group_size"].append(sampling.group_size)
            rows["prompt_token_ids"].append(ids)
            rows["response"].append(completion.text)
            rows["response_token_ids"].append(completion.token_ids)
            rows["behavior_logprobs"].append(completion.logprobs)
            rows["finish_reason"].append(completion.finish_reason)
            rows["policy_version"].append(policy_version)
            rows["generator"].append(fingerprint)
            rows["seed"].append(seed)
    if not trajectories:
        return pa.Table.from_pydict(rows, schema=SCHEMAS["samples"])
    return pa.Table.from_pydict({**rows, **trajectory_columns(trajectories)},
                                schema=pa.schema([*SCHEMAS["samples"], *TRAJECTORY_FIELDS]))
