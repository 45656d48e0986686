"""Token-ratio vs sequence-ratio spread by response length, measured on a finished run.

The GSPO paper (Zheng et al. 2025) argues that GRPO's per-token importance ratios are noisy
over long responses while GSPO's length-normalised sequence ratio is not. This module
measures both on a run's own samples, after the fact, without touching the trainer. For
response i with tokens t = 1..L_i:

    d_it = logp_it - behavior_logp_it         logp: the checkpoint that trained on the round
    r_it = exp(d_it)                          the token ratio (grpo)
    s_i  = exp((1 / L_i) sum_t d_it)          the sequence ratio (gspo): the geometric mean of the r_it

`ratio_spread` is the pure part (numpy arrays in, one row per length bucket out);
`ratio_spread_for_run` reads a run and computes the d_it:

    reads   samples (prompt_token_ids, response_token_ids, behavior_logprobs, policy_version),
            the generate manifests (temperature, top_k, top_p), metrics.jsonl round records,
            checkpoints/step-<k>
    writes  nothing

Which weights: round n trains from the policy version its previous round ended at (or the
samples' own policy_version, whichever is newer: with `[run] overlap` the samples are one
round older) to the version its round record ends at; the first checkpoint in that range is
the one that trained on round n. In the round loop that is the weights after the round's
last optimizer step, the furthest its data got from the sampling policy (at the first step
every ratio is 1, up to the engine's numerics). A round with no such checkpoint
(`checkpoint_every` > 1, `keep_last`), no round record (not finished) or no training steps
is skipped, with a `RatioSpreadSkip` warning naming the reason.

logp uses the distribution the behavior log-probs came from, as the trainer does: the round's
sampling temperature, top_k and top_p from its generate manifest (`training.data`), logits /
T then truncated (`training.logprobs`), float32 on CPU. (A run trained with `[train]
truncated_logprobs = false` had its trainer use the full softmax; this still measures
against the sampling distribution, the one behavior_logprobs belong to.)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

__all__ = ["COLUMNS", "RatioSpreadSkip", "length_buckets", "ratio_spread", "ratio_spread_for_run",
           "token_log_ratios"]

BUCKET_SCHEMA = pa.schema([
    ("length_lo", pa.int64()),               # bucket: response lengths length_lo..length_hi (tokens)
    ("length_hi", pa.int64()),               # null: no upper end (the last bucket)
    ("samples", pa.int64()),
    ("tokens", pa.int64()),
    ("mean_length", pa.float64()),
    ("token_ratio_mean", pa.float64()),      # mean of r_it over the bucket's tokens
    ("token_ratio_std", pa.float64()),       # std of r_it over the bucket's tokens
    ("token_ratio_within_std", pa.float64()),  # mean over samples of the std of r_it within the sample
    ("seq_ratio_mean", pa.float64()),        # mean of s_i over the bucket's samples
    ("seq_ratio_std", pa.float64()),         # std of s_i over the bucket's samples
    ("token_clip_frac", pa.float64()),       # tokens with r_it outside [1 - eps_low, 1 + eps_high] (token_clip)
    ("seq_clip_frac", pa.float64()),         # samples with s_i outside [1 - eps_low, 1 + eps_high] (sequence_clip)
])
RUN_SCHEMA = pa.schema([
    ("round", pa.int64()),
    ("checkpoint_step", pa.int64()),         # the checkpoint logp came from
    ("samples_policy_version", pa.int64()),  # the policy version that sampled the round (newest, if several)
    *BUCKET_SCHEMA,
])
COLUMNS = tuple(RUN_SCHEMA.names)
"""The columns of `ratio_spread_for_run`'s table; `ratio_spread` returns all but the first three."""

DEFAULT_ROUNDS = 4
"""`ratio_spread_for_run` without `rounds`: this many rounds, spread evenly over those it can measure."""


class RatioSpreadSkip(UserWarning):
    """A round `ratio_spread_for_run` cannot measure; the message says why."""


def _clip_range(objective: str) -> tuple[float, float]:
    """The paper clip range (eps_low, eps_high) the loss is registered with (training/objectives.py)."""
    from training.objectives import loss_defaults

    defaults = loss_defaults(objective)
    return defaults.eps_low, defaults.eps_high


def length_buckets(max_length: int) -> list[int]:
    """Powers of two 1, 2, 4, ... up to `max_length`: the lower edges of buckets 1, 2-3, 4-7, ..."""
    edges = [1]
    while edges[-1] * 2 <= max_length:
        edges.append(edges[-1] * 2)
    return edges


def _std(values: np.ndarray) -> float:
    """Population std (ddof 0), two passes: a constant array gives exactly 0."""
    return float(np.sqrt(np.mean((values - values.mean()) ** 2)))


def _outside(ratio: np.ndarray, clip: tuple[float, float]) -> np.ndarray:
    eps_low, eps_high = clip
    return (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)


def ratio_spread(log_ratios: np.ndarray | Sequence[float], lengths: np.ndarray | Sequence[int],
                 buckets: Sequence[int] | None = None, token_clip: tuple[float, float] | None = None,
                 sequence_clip: tuple[float, float] | None = None) -> pa.Table:
    """The spread of token and sequence importance ratios per response-length bucket.

    `log_ratios`: every sample's per-token log-ratios d_it = logp_it - behavior_logp_it,
    concatenated sample after sample (sum(lengths) values); `lengths`: each sample's response
    length L_i >= 1. `buckets`: ascending lower edges e_0 < e_1 < ...; bucket b holds the
    samples with e_b <= L_i < e_{b+1} (the last one has no upper end); default
    `length_buckets(max L_i)`; e_0 <= min L_i. One row per non-empty bucket B (BUCKET_SCHEMA),
    with r_it = exp(d_it), s_i = exp(mean_t d_it) (= (prod_t r_it)^(1/L_i)), T_B the tokens
    and N_B the samples of B, and std the population std (ddof 0):

        token_ratio_mean        = mean_{(i,t) in T_B} r_it
        token_ratio_std         = std_{(i,t) in T_B} r_it
        token_ratio_within_std  = mean_{i in N_B} std_t r_it           (0 for a one-token sample)
        seq_ratio_mean          = mean_{i in N_B} s_i
        seq_ratio_std           = std_{i in N_B} s_i                   (0 for a one-sample bucket)
        token_clip_frac         = |{(i,t) in T_B: r_it outside [1 - eps_low, 1 + eps_high]}| / |T_B|
        seq_clip_frac           = |{i in N_B: s_i outside [1 - eps_low, 1 + eps_high]}| / |N_B|

    Clip ranges: `token_clip` (default grpo's, 0.2 / 0.2) and `sequence_clip` (default gspo's,
    3e-4 / 4e-4), each (eps_low, eps_high); pass the same to both to compare at one range.
    "Outside the range" is what the range would clip for an advantage of either sign: the
    loss clips one side only (r < 1 - eps_low when A < 0, r > 1 + eps_high when A > 0), so its
    clip_frac_low + clip_frac_high is at most this.
    """
    x = np.asarray(log_ratios, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if x.ndim != 1 or lengths.ndim != 1:
        raise ValueError(f"log_ratios and lengths must be 1-D, got shapes {x.shape} and {lengths.shape}")
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"every response needs at least one token; sample {int(np.argmin(lengths))} has "
                         f"length {int(lengths.min())}")
    if int(lengths.sum()) != x.size:
        raise ValueError(f"log_ratios has {x.size} values but the lengths sum to {int(lengths.sum())}")
    if not np.isfinite(x).all():
        token = int(np.flatnonzero(~np.isfinite(x))[0])
        sample = int(np.searchsorted(np.cumsum(lengths), token, side="right"))
        raise ValueError(f"sample {sample}: a log-ratio is {x[token]} (token {token} of the concatenation)")
    edges = np.asarray(length_buckets(int(lengths.max(initial=1))) if buckets is None else buckets, dtype=np.int64)
    if edges.ndim != 1 or edges.size == 0 or (np.diff(edges) <= 0).any():
        raise ValueError(f"buckets must be ascending lower edges, got {list(edges)}")
    if lengths.size and lengths.min() < edges[0]:
        raise ValueError(f"buckets start at length {int(edges[0])}, but a sample has length {int(lengths.min())}")
    token_clip = _clip_range("grpo") if token_clip is None else token_clip
    sequence_clip = _clip_range("gspo") if sequence_clip is None else sequence_clip

    n = lengths.size
    sample_of_token = np.repeat(np.arange(n), lengths)
    r = np.exp(x)
    s = np.exp(np.bincount(sample_of_token, weights=x, minlength=n) / lengths)
    r_sample_mean = np.bincount(sample_of_token, weights=r, minlength=n) / lengths
    within_std = np.sqrt(np.bincount(sample_of_token, weights=(r - r_sample_mean[sample_of_token]) ** 2,
                                     minlength=n) / lengths)
    bucket_of_sample = np.searchsorted(edges, lengths, side="right") - 1
    bucket_of_token = bucket_of_sample[sample_of_token]

    rows = []
    for b in np.unique(bucket_of_sample):
        in_b, tokens_in_b = bucket_of_sample == b, bucket_of_token == b
        rb, sb = r[tokens_in_b], s[in_b]
        rows.append({
            "length_lo": int(edges[b]), "length_hi": int(edges[b + 1]) - 1 if b + 1 < edges.size else None,
            "samples": int(in_b.sum()), "tokens": int(rb.size), "mean_length": float(lengths[in_b].mean()),
            "token_ratio_mean": float(rb.mean()), "token_ratio_std": _std(rb),
            "token_ratio_within_std": float(within_std[in_b].mean()),
            "seq_ratio_mean": float(sb.mean()), "seq_ratio_std": _std(sb),
            "token_clip_frac": float(_outside(rb, token_clip).mean()),
            "seq_clip_frac": float(_outside(sb, sequence_clip).mean()),
        })
    return pa.Table.from_pylist(rows, schema=BUCKET_SCHEMA)


def token_log_ratios(model, samples: pa.Table, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     token_budget: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """(d, lengths) for `ratio_spread`: d the per-token logp - behavior_logprobs of every row of
    `samples` (prompt_token_ids, response_token_ids, behavior_logprobs), in row order, float64;
    logp from `model` under softmax(logits / temperature) truncated to top_k / top_p
    (`training.logprobs.token_logprobs`, the trainer's computation), no gradient, in micro-batches
    of at most `token_budget` padded tokens (`training.batching.policy_batches`)."""
    import torch

    from training.batching import policy_batches
    from training.logprobs import token_logprobs

    columns = ["prompt_token_ids", "response_token_ids", "behavior_logprobs"]
    pad_id = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0
    per_row: list[np.ndarray | None] = [None] * samples.num_rows
    with torch.inference_mode():
        for mb in policy_batches(samples.select(columns), token_budget, pad_id=pad_id):
            logp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask,
                                  temperature=temperature, top_k=top_k, top_p=top_p)
            d = (logp.double() - mb.old_logp.double()).numpy()
            mask = mb.target_mask.numpy()
            for j, row in enumerate(mb.rows.tolist()):
                per_row[row] = d[j][mask[j]]
    lengths = np.array([len(v) for v in per_row], dtype=np.int64)
    return (np.concatenate(per_row) if per_row else np.zeros(0)), lengths


def _load_policy(folder: Path, trust_remote_code: bool):
    """The checkpoint's model, frozen, float32 on CPU (a LoRA checkpoint: its adapter on the base model)."""
    from training import checkpoint as ckpt
    from training import lora

    if not lora.is_adapter_folder(folder):
        return ckpt.load_model(folder, trust_remote_code=trust_remote_code)
    base = ckpt.load_model(ckpt.load_trainer_state(folder)["base_model"], trust_remote_code=trust_remote_code)
    return lora.load(base, folder, trainable=False)


def _trained_checkpoints(store, records: dict[int, dict], checkpoints: list[int]) -> dict[int, tuple[int, int] | str]:
    """Per round with samples: (checkpoint step that trained on it, samples' policy version), or why none."""
    found: dict[int, tuple[int, int] | str] = {}
    for round in store.rounds("samples"):
        versions = store.read_columns("samples", ["policy_version"], round).column("policy_version")
        sampled = int(max(versions.to_pylist()))
        record = records.get(round)
        if record is None:
            found[round] = "no round record in metrics.jsonl (the round has not finished)"
            continue
        previous = records.get(round - 1)
        start = max(sampled, int(previous["policy_version"]) if previous else sampled)
        end = int(record["policy_version"])
        if end <= start:
            found[round] = f"no training steps after its samples' policy version {sampled}"
            continue
        step = next((k for k in checkpoints if start < k <= end), None)
        found[round] = ((step, sampled) if step is not None else
                        f"no checkpoint of steps {start + 1}..{end}, which trained on it "
                        "(checkpoint_every > 1 or keep_last removed it)")
    return found


def _spread_rounds(rounds: list[int], k: int) -> list[int]:
    """At most k of `rounds`, evenly spread, first and last included."""
    if len(rounds) <= k:
        return rounds
    return [rounds[i] for i in sorted({round(x) for x in np.linspace(0, len(rounds) - 1, k)})]


def ratio_spread_for_run(run_dir: str | Path, rounds: Sequence[int] | None = None,
                         buckets: Sequence[int] | None = None, token_clip: tuple[float, float] | None = None,
                         sequence_clip: tuple[float, float] | None = None, token_budget: int = 8192,
                         trust_remote_code: bool = False) -> pa.Table:
    """`ratio_spread` of rounds of the run at `run_dir`, one row per (round, length bucket),
    columns COLUMNS (see the module docstring for which checkpoint and distribution).

    `rounds`: default DEFAULT_ROUNDS rounds spread over those that can be measured; a round
    asked for that cannot be is skipped with a RatioSpreadSkip warning. `buckets`: lower
    edges (see `ratio_spread`), default powers of two up to the longest response of the
    chosen rounds, the same for every round. Reads a snapshot of the committed tables, so it
    can run beside a job.
    """
    from store.run_files import MetricsLog
    from store.run_store import RunStore
    from training.checkpoint import checkpoint_dir, checkpoint_steps
    from training.data import round_sampling  # the trainer's reading of the generate manifests

    run_dir = Path(run_dir)
    store = RunStore(run_dir).snapshot()
    records = {int(r["round"]): r for r in MetricsLog(run_dir).rounds()}
    found = _trained_checkpoints(store, records, checkpoint_steps(run_dir))
    measurable = [r for r, v in found.items() if not isinstance(v, str)]
    if rounds is None:
        chosen = _spread_rounds(measurable, DEFAULT_ROUNDS)
    else:
        chosen = []
        for round in sorted(set(rounds)):
            why = found.get(round, "no samples")
            if isinstance(why, str):
                warnings.warn(f"{run_dir}: round {round} skipped: {why}", RatioSpreadSkip, stacklevel=2)
            else:
                chosen.append(round)

    columns = ["prompt_token_ids", "response_token_ids", "behavior_logprobs"]
    samples = {round: store.read_columns("samples", columns, round) for round in chosen}
    if buckets is None and chosen:
        longest = max(max(t.column("response_token_ids").combine_chunks().value_lengths().to_pylist(), default=1)
                      for t in samples.values())
        buckets = length_buckets(longest)
    parts = []
    for round in chosen:
        step, sampled = found[round]
        sampling = round_sampling(store, [round])
        model = _load_policy(checkpoint_dir(run_dir, step), trust_remote_code)
        d, lengths = token_log_ratios(model, samples[round], temperature=sampling["temperature"] or 1.0,
                                      top_k=int(sampling["top_k"] or 0),
                                      top_p=1.0 if sampling["top_p"] is None else sampling["top_p"],
                                      token_budget=token_budget)
        del model
        table = ratio_spread(d, lengths, buckets, token_clip, sequence_clip)
        n = table.num_rows
        for i, (name, value) in enumerate((("round", round), ("checkpoint_step", step),
                                           ("samples_policy_version", sampled))):
            table = table.add_column(i, RUN_SCHEMA.field(name), pa.array([value] * n, pa.int64()))
        parts.append(table)
    return pa.concat_tables(parts) if parts else RUN_SCHEMA.empty_table()


# -- pooled over rounds, for the study's report ------------------------------------------

RATIO_OBJECTIVES = ("grpo", "gspo", "gspo_token", "cispo")
"""Objectives whose loss weighs samples by importance ratios: the study measures their spread."""


def pooled_spread(rows: list[dict]) -> list[dict]:
    """Rows of `ratio_spread_for_run` (one per round and length bucket) pooled over rounds, one
    per bucket: samples and tokens summed; the token columns weighted by tokens, the sequence
    columns by samples, each round's own statistic (so a pooled std is the mean of the rounds'
    stds, not the std of the pooled ratios)."""
    by_bucket: dict[tuple, list[dict]] = {}
    for row in rows:
        by_bucket.setdefault((row["length_lo"], row["length_hi"]), []).append(row)
    out = []
    for (lo, hi), group in sorted(by_bucket.items(), key=lambda item: item[0][0]):
        samples, tokens = sum(r["samples"] for r in group), sum(r["tokens"] for r in group)
        if not samples:
            continue
        out.append({"length_lo": lo, "length_hi": hi, "samples": samples, "tokens": tokens,
                    "mean_length": tokens / samples, "rounds": sorted({r["round"] for r in group}),
                    **{k: _weighted(group, k, "tokens") for k in ("token_ratio_std", "token_clip_frac")},
                    **{k: _weighted(group, k, "samples")
                       for k in ("token_ratio_within_std", "seq_ratio_std", "seq_clip_frac")}})
    return out


def _weighted(rows: list[dict], key: str, weight: str) -> float:
    total = sum(r[weight] for r in rows)
    return sum(r[key] * r[weight] for r in rows) / total if total else float("nan")
