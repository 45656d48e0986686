"""The embedded default: two-digit addition (or a long-response scratchpad, or a short-answer
family of pipelines/toy/families.py), a character-level tokenizer, a tiny Llama.

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

`--task scratchpad` is a second task with long responses, where token-level and
sequence-level importance ratios differ: three-digit addition written column by column,

    347+586=  ->  7+6+0=13 4+8+1=13 3+5+1=09 #### 933     (36-37 tokens with EOS)

rewarded by `final_answer` (the text after `####` equals the reference; partial credit:
`scratchpad_steps`, both in curation/rewards/scratchpad.py). Its defaults (TASK_DEFAULTS): a
134k-parameter model (width 64), 20,000 train prompts, one torch thread. Seed 0 (2 shared CPU
cores): the warm start stops at step 215 with greedy eval accuracy 0.285 and 99.75% of greedy
responses well-formed, in ~130-145 s; at temperature 0.7, 12% of samples are right, 97%
well-formed, pass@8 0.55 (at 1.0 errors compound: pass@8 0.32). Variants apply to it as the
fields they change (`--task scratchpad --variant deep`: runs/toy-scratchpad-deep).

The short-answer families (multiply, reverse, sort, max; pipelines/toy/families.py) are
warm-started on 8,192 prompts (`warm_start_prompts`) whatever `n_train`, so a train set of 256
and one of 8,192 start RL from the same model, and `SHAPES` names model shapes for any task.
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

from curation.rewards.scratchpad import WELL_FORMED
from pipelines.toy.families import FAMILIES
from pipelines.toy.task import (
    TASK_DESCRIPTIONS,
    VARIANTS,
    ToyConfig,
    check_toy_config,
    make_problems,
    response_answer,
    supervised_responses,
    variant_config,
    warm_start_problems,
)
from store.errors import disk_write
from store.fingerprints import config_hash
from store.storage import process_alive

# torch, transformers and pipelines.toy.model are imported by the build only: importing
# this module stays as light as pipelines.toy.task.

TOY_VERSION = 1
"""Bump when the build changes in a way `ToyConfig` does not capture (invalidates caches)."""

MODEL_DIR = "model"
TRAIN_FILE = "train.parquet"
EVAL_FILE = "eval.parquet"
META_FILE = "toy.json"


# ---------------------------------------------------------------------------------------
# Build (cached, atomic)
# ---------------------------------------------------------------------------------------


def default_out(config: ToyConfig, runs: str | Path = "runs") -> Path:
    """Where a config is built unless told: runs/toy for "default", runs/toy-<variant> for
    another variant, runs/toy-scratchpad[-<variant>] for the scratchpad task, runs/toy-<config
    hash> for any other config (so a config of its own never replaces a variant's cached build)."""
    for name in VARIANTS:
        try:
            known = variant_config(name, config.task)
        except ValueError:  # a variant the task has not (noisy: label noise is addition's)
            continue
        if config == known:
            parts = ["toy"] + [config.task] * (config.task != "addition") + [name] * (name != "default")
            return Path(runs) / "-".join(parts)
    return Path(runs) / f"toy-{config_hash(config.model_dump())[:10]}"


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
    check_toy_config(config)
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
            if pid.isdigit() and not process_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


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

    from pipelines.toy.model import greedy_responses, make_model, make_tokenizer, pass_at_k, warm_start

    started = time.perf_counter()
    train, eval_ = make_problems(config, seed)
    pq.write_table(train, folder / TRAIN_FILE)
    pq.write_table(eval_, folder / EVAL_FILE)
    warm_problems = warm_start_problems(config, seed)
    responses = supervised_responses(warm_problems, config, seed)
    supervised = warm_problems.set_column(1, "reference", pa.array(responses, pa.string()))
    n_wrong = sum(response_answer(config, a) != r
                  for a, r in zip(responses, warm_problems.column("reference").to_pylist()))

    with _torch_threads(config.num_threads):
        torch.manual_seed(seed)
        tokenizer = make_tokenizer(config.max_position_embeddings, FAMILIES[config.task].characters)
        model = make_model(config, tokenizer)
        warm = warm_start(model, tokenizer, supervised, eval_, config, seed, progress)
        model_dir = folder / MODEL_DIR
        model.save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
        for path in model_dir.iterdir():
            path.chmod(0o644)  # safetensors writes its file private; this is a shared model
        greedy, references = greedy_responses(model_dir, folder / EVAL_FILE, config=config)
        eval_accuracy = float(np.mean([response_answer(config, g) == r for g, r in zip(greedy, references)]))
        eval_pass_at_8 = pass_at_k(model_dir, folder / EVAL_FILE, k=8, temperature=1.0, seed=seed, config=config)
        measures = _scratchpad_measures(model, tokenizer, eval_, config, seed, responses, greedy) \
            if config.task == "scratchpad" else {}
    if eval_accuracy < config.target_accuracy / 2:
        warnings.warn(
            f"toy warm start ended at greedy eval accuracy {eval_accuracy:.3f} after "
            f"{warm['steps']} steps, far below the target {config.target_accuracy}",
            stacklevel=3,
        )

    return {
        **_fingerprint(config, seed),
        "task": TASK_DESCRIPTIONS[config.task],
        "model": {
            "architecture": "LlamaForCausalLM",
            "parameters": sum(p.numel() for p in model.parameters()),
            "head_dim": config.hidden_size // config.num_heads,
            "vocab_size": len(tokenizer),
        },
        "rows": {"train": train.num_rows, "eval": eval_.num_rows,
                 # present when the warm start learned more prompts than train holds
                 **({"warm_start": warm_problems.num_rows} if warm_problems.num_rows > train.num_rows else {})},
        **({"wrong_supervised_answers": n_wrong} if n_wrong else {}),  # absent when every answer is right
        "warm_start": warm,
        "eval_greedy_accuracy": eval_accuracy,
        "eval_pass_at_8": eval_pass_at_8,
        **measures,
        "build_seconds": round(time.perf_counter() - started, 1),
    }


SCRATCHPAD_TEMPERATURE = 0.7
"""The sampling temperature of pipelines/specs/toy-scratchpad-grpo.toml: at 1.0 errors compound
over ~37 tokens (seed 0: 6% of samples right, 60% well-formed), at 0.7 samples stay in the
format and differ in their digits, which gives group RL its mixed groups."""


def _scratchpad_measures(model, tokenizer, eval_: pa.Table, config: ToyConfig, seed: int, supervised: list[str],
                         greedy: list[str]) -> dict:
    """How long the reference responses are (tokens with EOS), how well the warm start learned
    the format (greedy eval responses that are well-formed), and what 8 samples per eval prompt
    at SCRATCHPAD_TEMPERATURE look like."""
    from pipelines.toy.model import generate_responses, max_new_tokens

    lengths = [len(r) + 1 for r in supervised]  # one token per character
    references = eval_.column("reference").to_pylist()
    samples = generate_responses(model, tokenizer, eval_.column("prompt").to_pylist(), num_samples=8,
                                 temperature=SCRATCHPAD_TEMPERATURE, max_new_tokens=max_new_tokens(config),
                                 generator_seed=seed)
    right = [[response_answer(config, x) == ref for x in group] for group, ref in zip(samples, references)]
    flat = [x for group in samples for x in group]
    return {
        "response_tokens": {"min": min(lengths), "max": max(lengths), "mean": round(float(np.mean(lengths)), 2)},
        "eval_well_formed": float(np.mean([WELL_FORMED.match(g) is not None for g in greedy])),
        "eval_samples": {
            "temperature": SCRATCHPAD_TEMPERATURE,
            "accuracy": float(np.mean(right)),
            "pass_at_8": float(np.mean([any(group) for group in right])),
            "well_formed": float(np.mean([WELL_FORMED.match(x) is not None for x in flat])),
        },
    }
