"""The embedded default: two-digit addition, a character-level tokenizer, a tiny Llama.

No model can be downloaded on a fresh machine, so groupforge builds its own. `build_toy`
writes, atomically and once per (config, seed):

    out/model/          an ordinary Hugging Face folder (config.json, model.safetensors,
                        generation_config.json, tokenizer.json, tokenizer_config.json) that
                        transformers (AutoModelForCausalLM / AutoTokenizer) and vLLM load
    out/train.parquet   prompt ("37+48="), reference ("85"); disjoint from eval
    out/eval.parquet    the held-out prompts
    out/toy.json        the build config, seed, version and the measured accuracies

The model is warm-started by teacher-forced supervised training on the answer (and EOS)
tokens, and stopped as soon as greedy eval accuracy reaches `target_accuracy`: partial
accuracy, with the right answer often among samples at temperature 1 (pass@8 well above
greedy accuracy), which is the regime where group-relative RL has something to learn from.
The reward is exact match: `response.strip() == reference`.

With the defaults and seed 0 (2 CPU cores): 529k parameters, the warm start stops at step
190 with greedy eval accuracy 0.34 and pass@8 (temperature 1) 0.69, in ~15 s; vLLM's greedy
output equals transformers' on every eval prompt. A plain on-policy GRPO loop (128 train
prompts x 8 samples per step, lr 1e-4) lifts greedy eval accuracy to 0.74 in 140 steps.

`VARIANTS` names configs that differ in a way that matters for RL; recipes are tuned on all
of them together. Seed 0, 400 eval prompts each (greedy / pass@8 from the build, transformers):

    variant  differs from default                  params  build  greedy  pass@8
    default  -                                       529k   16 s   0.34    0.69
    deep     num_layers 4                           1054k   31 s   0.30    0.67
    noisy    label_noise 0.25, target 0.25           529k   24 s   0.25    0.59
    small    n_train 768, target 0.20                529k   17 s   0.21    0.45
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_validator

from curation.errors import disk_write
from curation.fingerprints import config_hash

# torch, transformers and pipelines.toy_model are imported by the build only: the CLI
# generates `groupforge toy build`'s flags from ToyConfig and must stay light.

TOY_VERSION = 1
"""Bump when the build changes in a way `ToyConfig` does not capture (invalidates caches)."""

MODEL_DIR = "model"
TRAIN_FILE = "train.parquet"
EVAL_FILE = "eval.parquet"
META_FILE = "toy.json"

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM's CPU attention supports (`CPUAttentionBackend.get_supported_head_sizes`)."""


class ToyConfig(BaseModel):
    """Everything that determines the built toy, together with the seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- task ---
    operand_min: int = Field(10, description="Smallest operand (inclusive).")
    operand_max: int = Field(99, description="Largest operand (inclusive).")
    n_eval: int = Field(400, description="Prompts held out for eval; train prompts come from the rest.")
    # Fields added after TOY_VERSION 1 leave the dump (the cache key) while at their default,
    # so the default toy's key is what it always was and its existing caches stay valid.
    n_train: int | None = Field(
        None,
        ge=1,
        exclude_if=lambda v: v is None,
        description="Train prompts: the first n of the seeded shuffle after the eval prompts "
        "(512 to 7,700 with the default operands); unset: all of them.",
    )

    # --- model ---
    hidden_size: int = Field(128, description="Width of the residual stream.")
    num_layers: int = Field(2, description="Transformer blocks.")
    num_heads: int = Field(
        4,
        description="Attention heads; head_dim = hidden_size / num_heads must be one vLLM's "
        "CPU attention supports (32, 64, 80, 96, 112, 128, ...).",
    )
    intermediate_size: int = Field(512, description="MLP width.")
    max_position_embeddings: int = Field(
        64, description="Longest sequence (prompt + response) the model accepts."
    )

    # --- warm start ---
    batch_size: int = Field(128, description="Sequences per optimizer step.")
    learning_rate: float = Field(1e-3, description="AdamW learning rate (constant after warmup).")
    warmup_steps: int = Field(20, description="Linear learning-rate warmup.")
    max_steps: int = Field(1500, description="Give up on reaching the target after this many.")
    eval_every: int = Field(5, description="Steps between greedy eval-accuracy checks.")
    target_accuracy: float = Field(
        0.30, description="Stop at the first check whose greedy eval accuracy reaches this."
    )
    label_noise: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        exclude_if=lambda v: v == 0.0,
        description="Fraction of the warm start's supervised answers replaced by a wrong one "
        "(off by 1-10, chosen by the seed); train.parquet keeps the right references.",
    )
    num_threads: int = Field(2, description="torch intra-op threads (fixed for determinism).")

    @model_validator(mode="after")
    def _buildable(self) -> ToyConfig:
        check_config(self)
        return self


def check_config(config: ToyConfig) -> None:
    """One-line ValueError unless vLLM can load the model and the prompts can be split as
    asked (also run on configs that skipped validation, e.g. `model_copy(update=...)`)."""
    head_dim, rem = divmod(config.hidden_size, config.num_heads)
    if rem:
        raise ValueError(f"hidden_size {config.hidden_size} not divisible by num_heads {config.num_heads}")
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim = hidden_size / num_heads = {config.hidden_size} / {config.num_heads} = {head_dim} "
            f"is not a head size vLLM's CPU attention supports: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}"
        )
    n_problems = (config.operand_max - config.operand_min + 1) ** 2
    if not 0 < config.n_eval < n_problems:
        raise ValueError(f"n_eval={config.n_eval} must be between 1 and {n_problems - 1}")
    if config.n_train is not None and config.n_train > n_problems - config.n_eval:
        raise ValueError(
            f"n_train={config.n_train} is more than the {n_problems - config.n_eval} prompts left after "
            f"n_eval={config.n_eval} (operands {config.operand_min}..{config.operand_max})"
        )


# ---------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------


def make_problems(config: ToyConfig, seed: int) -> tuple[pa.Table, pa.Table]:
    """All `a+b=` prompts over the operand range, split into (train, eval) by the seed: eval
    is the first `n_eval` of a seeded shuffle, train the next `n_train` (all the rest when
    unset), so every train-set size shares the same eval prompts."""
    check_config(config)
    operands = np.arange(config.operand_min, config.operand_max + 1)
    a, b = (x.ravel() for x in np.meshgrid(operands, operands, indexing="ij"))
    order = np.random.default_rng(seed).permutation(len(a))
    n_train = config.n_train or len(a) - config.n_eval

    def table(idx: np.ndarray) -> pa.Table:
        return pa.table(
            {
                "prompt": pa.array([f"{a[i]}+{b[i]}=" for i in idx], pa.string()),
                "reference": pa.array([str(a[i] + b[i]) for i in idx], pa.string()),
            }
        )

    return table(order[config.n_eval : config.n_eval + n_train]), table(order[: config.n_eval])


def supervised_answers(train: pa.Table, config: ToyConfig, seed: int) -> list[str]:
    """The answers the warm start learns: the references, except for a seeded `label_noise`
    fraction of rows whose answer is off by 1-10 (a plausible slip, never the right one)."""
    answers = train.column("reference").to_pylist()
    n_wrong = round(config.label_noise * len(answers))
    if n_wrong == 0:
        return answers
    rng = np.random.default_rng([seed, 1])  # a stream apart from the split's
    rows = rng.choice(len(answers), size=n_wrong, replace=False)
    offsets = rng.integers(1, 11, size=n_wrong) * rng.choice([-1, 1], size=n_wrong)
    for row, offset in zip(rows.tolist(), offsets.tolist()):
        right = int(answers[row])
        answers[row] = str(right + offset if right + offset >= 0 else right - offset)
    return answers


# ---------------------------------------------------------------------------------------
# Named variants: the same task with another model, train set or warm start
# ---------------------------------------------------------------------------------------

VARIANTS: dict[str, ToyConfig] = {
    # today's toy: 2 layers x 128, all 7,700 train prompts, clean warm start to 30%
    "default": ToyConfig(),
    # twice the depth: a model with more capacity, warm-started to the same accuracy
    "deep": ToyConfig(num_layers=4),
    # a quarter of the supervised answers wrong: a miscalibrated start, ~25% greedy
    "noisy": ToyConfig(label_noise=0.25, target_accuracy=0.25),
    # 768 train prompts and a weaker start: RL must generalise from few prompts
    "small": ToyConfig(n_train=768, target_accuracy=0.20),
}
"""Task variants for benchmarks: recipe defaults are chosen on these together, never on one."""


def variant_config(variant: str) -> ToyConfig:
    """The config of a named variant; a one-line error naming the variants otherwise."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown toy variant {variant!r}: one of {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def default_out(config: ToyConfig, runs: str | Path = "runs") -> Path:
    """Where a config is built unless told: runs/toy for "default", runs/toy-<variant> for
    another variant, runs/toy-<config hash> for any other config (so a config of its own
    never replaces a variant's cached build)."""
    for name, known in VARIANTS.items():
        if config == known:
            return Path(runs) / ("toy" if name == "default" else f"toy-{name}")
    return Path(runs) / f"toy-{config_hash(config.model_dump())[:10]}"


# ---------------------------------------------------------------------------------------
# Build (cached, atomic)
# ---------------------------------------------------------------------------------------


def _fingerprint(config: ToyConfig, seed: int) -> dict:
    return {"version": TOY_VERSION, "seed": seed, "config": config.model_dump()}


def read_toy_meta(out: str | Path) -> dict | None:
    """The toy.json of a complete build at `out`, or None."""
    path = Path(out) / META_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _is_cached(out: Path, config: ToyConfig, seed: int) -> bool:
    meta = read_toy_meta(out)
    if meta is None or {k: meta.get(k) for k in ("version", "seed", "config")} != _fingerprint(config, seed):
        return False
    return all((out / name).exists() for name in (MODEL_DIR, TRAIN_FILE, EVAL_FILE))


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_toy(
    out: str | Path = "runs/toy",
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    config: ToyConfig | None = None,
) -> Path:
    """Build (or reuse, if already built with the same config) the toy: returns `out`.

    The build happens in a temporary folder beside `out` and is renamed into place, so a
    killed build leaves no half-built toy; a finished build is reused whenever its
    toy.json records the same config, seed and TOY_VERSION (unless `force`)."""
    out = Path(out)
    config = config or ToyConfig()
    check_config(config)
    if not force and _is_cached(out, config, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(out)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out, "building"), dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the toy is an ordinary folder
        from training.checkpoint import quiet_transformers

        with disk_write(out), quiet_transformers():
            meta = _build_into(tmp, config, seed, progress)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if not force and _is_cached(out, config, seed):
            return out  # a concurrent build finished first; keep its files
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _temp_prefix(out: Path, kind: str, pid: int | None = None) -> str:
    return f".{out.name}.{kind}-{socket.gethostname()}-{pid or os.getpid()}-"


def _remove_abandoned_builds(out: Path) -> None:
    """Delete temp folders beside `out` left by builds on this host whose process is gone
    (a killed build cannot clean up after itself)."""
    for kind in ("building", "old"):
        for path in out.parent.glob(f".{out.name}.{kind}-{socket.gethostname()}-*-*"):
            pid = path.name.removeprefix(f".{out.name}.{kind}-{socket.gethostname()}-").split("-")[0]
            if pid.isdigit() and not _process_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _replace_dir(new: Path, out: Path) -> None:
    """Move `new` to `out`; an existing `out` is moved aside first and then deleted, so
    `out` is at every moment either absent, the old build or the new one."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=_temp_prefix(out, "old"), dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)


def _build_into(folder: Path, config: ToyConfig, seed: int, progress: bool) -> dict:
    import torch

    from pipelines.toy_model import greedy_accuracy, make_model, make_tokenizer, pass_at_k, warm_start

    started = time.perf_counter()
    train, eval_ = make_problems(config, seed)
    pq.write_table(train, folder / TRAIN_FILE)
    pq.write_table(eval_, folder / EVAL_FILE)
    answers = supervised_answers(train, config, seed)
    supervised = train.set_column(1, "reference", pa.array(answers, pa.string()))
    n_wrong = sum(a != r for a, r in zip(answers, train.column("reference").to_pylist()))

    with _torch_threads(config.num_threads):
        torch.manual_seed(seed)
        tokenizer = make_tokenizer(config.max_position_embeddings)
        model = make_model(config, tokenizer)
        warm = warm_start(model, tokenizer, supervised, eval_, config, seed, progress)
        model_dir = folder / MODEL_DIR
        model.save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
        for path in model_dir.iterdir():
            path.chmod(0o644)  # safetensors writes its file private; this is a shared model
        eval_accuracy = greedy_accuracy(model_dir, folder / EVAL_FILE)
        eval_pass_at_8 = pass_at_k(model_dir, folder / EVAL_FILE, k=8, temperature=1.0, seed=seed)
    if eval_accuracy < config.target_accuracy / 2:
        warnings.warn(
            f"toy warm start ended at greedy eval accuracy {eval_accuracy:.3f} after "
            f"{warm['steps']} steps, far below the target {config.target_accuracy}",
            stacklevel=3,
        )

    return {
        **_fingerprint(config, seed),
        "task": "two-digit addition; reward = exact match of response.strip() with reference",
        "model": {
            "architecture": "LlamaForCausalLM",
            "parameters": sum(p.numel() for p in model.parameters()),
            "head_dim": config.hidden_size // config.num_heads,
            "vocab_size": len(tokenizer),
        },
        "rows": {"train": train.num_rows, "eval": eval_.num_rows},
        **({"wrong_supervised_answers": n_wrong} if n_wrong else {}),  # absent when clean, as before
        "warm_start": warm,
        "eval_greedy_accuracy": eval_accuracy,
        "eval_pass_at_8": eval_pass_at_8,
        "build_seconds": round(time.perf_counter() - started, 1),
    }
