"""The trainer: read a run's curated tables, take optimizer steps, checkpoint, log metrics.

    groupforge train RUN --objective grpo --steps 100

`train(run_dir, config, model=..., steps=N)` trains until global optimizer step N (the
step count is the policy_version of the weights, continued across calls and rounds):

    resume   the newest complete checkpoint in RUN/checkpoints/ (or the base model at step 0)
    data     training.data: the rows of the objective in the chosen rounds
    model    Hugging Face causal LM (safetensors), AdamW, warmup then constant or cosine lr
    loop     per step: `batch_size` rows from a seeded permutation of the rows, token-budget
             micro-batches, gradient accumulation normalised by the step's totals (so any
             split gives the one-batch gradient), grad clipping, one optimizer step, one line
             in RUN/metrics.jsonl
    save     RUN/checkpoints/step-<k>/ every `save_every` steps and at the end

Resume reproduces an uninterrupted run: which rows a step uses depends only on (seed, the
step, the step at which these rows were first trained on); the optimizer state and the
weights are restored exactly; and the metrics lines of steps after the checkpoint are
dropped before they are recomputed. Callers hold the run's lock (`RunStore.lock()`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

from curation.store import RunStore
from training import checkpoint as ckpt
from training.batching import pair_batches, policy_batches, step_normalizer
from training.config import TrainConfig
from training.data import POLICY_OBJECTIVES, load_training_data
from training.logprobs import token_logprobs
from training.objectives import ObjectiveConfig, get_pair_loss, get_policy_loss

METRICS_FILE = "metrics.jsonl"
# Fault injection for resume tests: SIGKILL this process right after step k is logged.
KILL_AFTER_STEP_ENV = "GROUPFORGE_KILL_AFTER_STEP"

@dataclass
class TrainResult:
    start_step: int
    end_step: int
    skipped: bool
    checkpoint: Path | None = None
    rows: int = 0
    rounds: list[int] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup, then constant or cosine."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay = cfg.decay_steps or total_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rows(num_rows: int, batch_size: int, seed: int, segment_start: int, step: int) -> np.ndarray:
    """Row indices of optimizer step `step`: consecutive slices of a stream of seeded
    permutations of the rows (epoch e uses permutation e), counted from `segment_start`,
    the step after which these rows were first trained on. Depends on nothing else, so a
    resumed run draws exactly the rows an uninterrupted one would."""
    size = min(batch_size, num_rows)
    first = (step - segment_start - 1) * size
    out = []
    for epoch in range(first // num_rows, (first + size - 1) // num_rows + 1):
        perm = np.random.default_rng([seed, segment_start, epoch]).permutation(num_rows)
        lo, hi = max(first - epoch * num_rows, 0), min(first + size - epoch * num_rows, num_rows)
        out.append(perm[lo:hi])
    return np.concatenate(out)


def train(run_dir: str | Path, cfg: TrainConfig, *, steps: int, model: str | Path | None = None,
          progress: Callable[[int, int, dict], None] | None = None) -> TrainResult:
    """Train until optimizer step `steps`, starting from the newest checkpoint of the run or,
    when there is none, from the model folder `model`."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    store = RunStore(run_dir)

    # -- resume or start ------------------------------------------------------------------
    latest = ckpt.latest_checkpoint(run_dir)
    state = ckpt.load_trainer_state(latest) if latest else {}
    start_step = int(state.get("step", 0))
    base_model = Path(state.get("base_model") or model or "")
    if latest is None and (model is None or not (Path(model) / "config.json").is_file()):
        raise ValueError(f"{run_dir}: no checkpoint to resume and no base model folder (got {model!r}; "
                         "it needs a config.json)")
    if start_step >= steps:
        return TrainResult(start_step, start_step, skipped=True, checkpoint=latest,
                           seconds=time.perf_counter() - started)
    _drop_metrics_after(run_dir / METRICS_FILE, start_step)

    # -- data -------------------------------------------------------------------------------
    data = load_training_data(run_dir, cfg.objective, cfg.rounds, cfg.max_staleness, cfg.sft_min_reward)
    temperature = cfg.temperature or data.temperature or 1.0
    segment = state.get("data") or {}
    if segment.get("fingerprint") != data.fingerprint:
        segment = {"fingerprint": data.fingerprint, "start_step": start_step, "rounds": data.rounds,
                   "rows": data.num_rows}

    # -- model and optimizer -------------------------------------------------------------
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    policy = _load_model(latest or base_model, device, trainable=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.adam_betas,
                                  weight_decay=cfg.weight_decay)
    if latest is not None:
        ckpt.load_optimizer(optimizer, latest)
    autocast = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    reference = _load_model(cfg.ref_model or base_model, device) if cfg.uses_reference() else None
    pad_id = policy.config.pad_token_id if isinstance(policy.config.pad_token_id, int) else 0
    table = data.table
    ocfg = cfg.objective_config(longest_response=_longest_response(table))
    if cfg.old_logprobs == "recompute" and cfg.objective in POLICY_OBJECTIVES:
        table = _with_recomputed_logprobs(run_dir, table, segment, start_step, policy, cfg, temperature,
                                          pad_id, device, autocast)

    # -- the loop ---------------------------------------------------------------------------
    metrics: dict[str, Any] = {}
    kill_after = int(os.environ.get(KILL_AFTER_STEP_ENV, "0") or 0)
    saved = None
    with open(run_dir / METRICS_FILE, "a") as log:
        for step in range(start_step + 1, steps + 1):
            tic = time.perf_counter()
            rows = step_rows(table.num_rows, cfg.batch_size, cfg.seed, segment["start_step"], step)
            batch = table.take(pa.array(rows))
            lr = lr_at(step, cfg, steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            metrics = _accumulate_step(policy, reference, batch, cfg, ocfg, temperature, pad_id, device,
                                       autocast, policy_version=step - 1)
            params = [p for p in policy.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
            optimizer.step()
            seconds = time.perf_counter() - tic
            metrics.update(event="step", step=step, objective=cfg.objective, lr=lr, grad_norm=float(grad_norm),
                           rows=len(rows), seconds=round(seconds, 4),
                           tokens_per_s=round(metrics["tokens"] / seconds, 1), rounds=data.rounds)
            log.write(json.dumps(metrics, sort_keys=True) + "\n")
            log.flush()
            if step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == steps or (cfg.save_every and step % cfg.save_every == 0):
                saved = ckpt.save_checkpoint(
                    run_dir, step, policy, optimizer,
                    {"base_model": str(base_model), "data": segment, "config": cfg.model_dump(mode="json"),
                     "temperature": temperature},
                    tokenizer_from=base_model, keep_last=cfg.keep_last or None)
            if progress is not None:
                progress(step - start_step, steps - start_step, metrics)
    return TrainResult(start_step, steps, skipped=False, checkpoint=saved, rows=table.num_rows,
                       rounds=data.rounds, last_metrics=metrics, seconds=time.perf_counter() - started)


def _accumulate_step(policy, reference, batch: pa.Table, cfg: TrainConfig, ocfg: ObjectiveConfig,
                     temperature: float, pad_id: int, device, autocast: bool, policy_version: int) -> dict:
    """Forward and backward over the step's micro-batches; returns the step's metrics (the
    loss is the full-batch loss; objective metrics are averaged, weighted by sequences)."""
    pairwise = cfg.objective == "pairwise"
    batches = (pair_batches if pairwise else policy_batches)(batch, cfg.token_budget, pad_id=pad_id)
    norm = step_normalizer(batches)
    loss_fn = get_pair_loss("pairwise") if pairwise else get_policy_loss(cfg.objective)
    versions = None if pairwise else batch.column("policy_version").to_numpy()
    totals: dict[str, float] = {}
    weight_total = 0.0
    loss_total = 0.0
    tokens = response_tokens = 0
    gap_sum, gap_tokens = 0.0, 0
    for mb in batches:
        mb = mb.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logp = token_logprobs(policy, mb.input_ids, mb.attention_mask, mb.target_mask, temperature=temperature)
            ref_logp = None
            if reference is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(reference, mb.input_ids, mb.attention_mask, mb.target_mask,
                                              temperature=temperature)
        mask = mb.target_mask.to(logp.dtype)
        if pairwise:
            k = mb.num_pairs
            loss, m = loss_fn(logp[:k], logp[k:], mask[:k], mask[k:], mb.soft_label, mb.weight, ocfg,
                              ref_chosen_logp=None if ref_logp is None else ref_logp[:k],
                              ref_rejected_logp=None if ref_logp is None else ref_logp[k:], norm=norm)
            share = k
        else:
            loss, m = loss_fn(logp, mb.old_logp, mb.advantages, mask, ocfg, ref_logp=ref_logp, norm=norm)
            share = mb.input_ids.shape[0]
            if mb.old_logp is not None and cfg.old_logprobs == "generator":
                # The known train/sample mismatch (top-p not re-applied, kernels differ), measured
                # where the weights are the ones that sampled: samples of this policy version.
                same = torch.from_numpy(versions[mb.rows.cpu().numpy()] == policy_version).to(device)
                if same.any():
                    sel = mb.target_mask & same[:, None]
                    gap_sum += float((logp.detach() - mb.old_logp).abs()[sel].sum())
                    gap_tokens += int(sel.sum())
        loss.backward()
        loss_total += float(loss.detach())
        for key, value in m.items():
            totals[key] = totals.get(key, 0.0) + float(value) * share
        weight_total += share
        tokens += int(mb.attention_mask.sum())
        response_tokens += int(mb.target_mask.sum())
    metrics = {key: value / weight_total for key, value in totals.items()}
    metrics.update(loss=loss_total, tokens=tokens, response_tokens=response_tokens, micro_batches=len(batches))
    if gap_tokens:
        metrics["behavior_logp_gap"] = gap_sum / gap_tokens
    return metrics


def _load_model(folder: str | Path, device: torch.device, trainable: bool = False):
    """A causal LM from a safetensors folder (no remote code), fp32 master weights."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder}: no *.safetensors files (pickled weights are not loaded)")
    with ckpt.quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False,
                                                     use_safetensors=True)
    model.to(device)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def _with_recomputed_logprobs(run_dir: Path, table: pa.Table, segment: dict, start_step: int, policy, cfg,
                              temperature: float, pad_id: int, device, autocast: bool) -> pa.Table:
    """`table` with behavior_logprobs replaced by the log-probs of the policy at the start of
    this segment. Computed once and cached under RUN/_train/, so a resumed run uses the same
    values rather than those of its (already updated) weights."""
    from safetensors.torch import load_file, save_file

    cache = run_dir / "_train" / f"old_logprobs-{segment['fingerprint'][:16]}-step{segment['start_step']}.safetensors"
    if cache.is_file():
        flat = load_file(cache)["logprobs"]
    elif segment["start_step"] != start_step:
        raise ValueError(f"{cache} is missing: the recomputed old log-probs of a segment started at step "
                         f"{segment['start_step']} cannot be rebuilt from step {start_step}'s weights")
    else:
        flat_parts = [None] * table.num_rows
        policy.eval()
        with torch.no_grad():
            for mb in policy_batches(table, cfg.token_budget, pad_id=pad_id):
                mb = mb.to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    logp = token_logprobs(policy, mb.input_ids, mb.attention_mask, mb.target_mask,
                                          temperature=temperature)
                for i, row in enumerate(mb.rows.tolist()):
                    flat_parts[row] = logp[i][mb.target_mask[i]].float().cpu()
        policy.train()
        flat = torch.cat(flat_parts)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        save_file({"logprobs": flat.contiguous()}, tmp)
        os.replace(tmp, cache)
    lengths = [len(x) for x in table.column("response_token_ids").to_pylist()]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.numpy(), pa.float32()))
    index = table.schema.get_field_index("behavior_logprobs")
    return table.set_column(index, "behavior_logprobs", column)


def _longest_response(table: pa.Table) -> int:
    import pyarrow.compute as pc

    columns = ["chosen_token_ids", "rejected_token_ids"] if "chosen_token_ids" in table.column_names \
        else ["response_token_ids"]
    return max(int(pc.max(pc.list_value_length(table.column(c))).as_py() or 1) for c in columns)


def _drop_metrics_after(path: Path, step: int) -> None:
    """Remove step records after `step` (written by a run killed before its next checkpoint);
    they are recomputed, identically, by the resumed run. Other records are kept."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and not _is_step_after(line, step)]
    if len(kept) == len([line for line in lines if line.strip()]):
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _is_step_after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return True  # a line cut by a kill
    return record.get("event") == "step" and int(record.get("step", 0)) > step
