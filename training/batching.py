"""Tables -> token-budget micro-batches (right padding, masks) and the step's global counts.

A micro-batch holds b sequences prompt+response, right-padded with `pad_id` to the longest
one, L tokens: b * L <= token_budget (padded tokens, what the forward pass pays for). A
single sequence (or pair) longer than the budget gets a micro-batch of its own; nothing is
dropped. Sequences are sorted by length (ties by row) before packing, so neighbours have
similar lengths and little padding; `rows` maps each sequence back to its table row.

Positions are next-token positions: column t of `target_mask` / `old_logp` (shape (b, L-1))
is the prediction of token t+1. A row with prompt length p and response length r has
targets at t = p-1 .. p+r-2, the positions `token_logprobs` returns log-probs for.

Multi-turn rows carry a `response_mask` (1 on the model's tokens, 0 on tool/environment tokens;
pairs: `chosen_response_mask`, `rejected_response_mask`). It is ANDed into `target_mask` at the
tokens' next-token positions, so a masked token is still input (the model conditions on it)
but never a target: the losses, importance ratios, KL, correction weights, metrics and the
step's token counts all read `target_mask`, and `old_logp` / `behavior_logp` are 0 there. A
row without the column trains on every response token, as a single-turn row does.

With `share_prompts`, each micro-batch also carries its rows packed so that each prompt is
computed once (training.shared_prompts.SharedPrompts); the loss sees the unpacked (b, L-1)
layout either way.

`step_normalizer` sums the counts over *all* micro-batches of one optimizer step, so each
micro-batch's loss is its share of the step loss and the gradient does not depend on the
split (see `training.objectives.Normalizer`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from training.objectives import Normalizer
from training.ragged import Ragged, read_ragged, spans
from training.shared_prompts import SHARED_MAX_LEN, SharedPrompts, opens_sequence, pack_shared_prompts, prompt_numbers

__all__ = ["MicroBatch", "pair_batches", "policy_batches", "prompt_groups", "step_normalizer"]

@dataclass
class MicroBatch:
    """b right-padded sequences and what the losses need about them."""

    input_ids: torch.LongTensor
    """(b, L) prompt+response token ids, right-padded with pad_id."""
    attention_mask: torch.LongTensor
    """(b, L) 1 on real tokens, 0 on padding."""
    target_mask: torch.BoolTensor
    """(b, L-1) True at positions that predict a response token the model sampled (response_mask
    1; every response token of a row without one)."""
    old_logp: torch.Tensor | None
    """(b, L-1) float32 old log-probs at response positions, 0 elsewhere: the table's
    old_logprobs (recomputed by the trainer: decoupled mode) or else its behavior_logprobs
    (bypass mode); None when it has neither (sft)."""
    advantages: torch.Tensor
    """(b,) float32 sequence advantages (zeros when the table has none, and for pairs)."""
    rows: torch.LongTensor
    """(b,) row of each sequence in the input table (pairs: the pair's row, twice)."""
    soft_label: torch.Tensor | None = None
    """Pairwise: (k,) float32 P(chosen > rejected). Rows 0..k-1 are the chosen sequences,
    rows k..2k-1 the rejected ones of the same pairs, in the same order."""
    weight: torch.Tensor | None = None
    """Pairwise: (k,) float32 pair weights."""
    num_pairs: int = 0
    """Pairwise: k (0 for policy batches)."""
    policy_version: torch.LongTensor | None = None
    """(b,) the policy_version that sampled each sequence, when the table has the column
    (policy batches only)."""
    behavior_logp: torch.Tensor | None = None
    """(b, L-1) the engine's behavior log-probs like old_logp, when old_logp are the
    trainer's own (decoupled mode: the table has both columns); else None."""
    staleness: torch.LongTensor | None = None
    """(b,) rounds between each sequence's round and the newest round of the table, when it
    has a round column (policy batches only)."""
    shared: SharedPrompts | None = None
    """The same sequences with each prompt computed once (policy_batches with share_prompts)."""

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MicroBatch(**{k: v.to(device) if isinstance(v, (torch.Tensor, SharedPrompts)) else v
                             for k, v in moved.items()})


# ---- reading list columns -----------------------------------------------------------------

def _require(table: pa.Table, columns: list[str], what: str) -> None:
    names = set(table.column_names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; the table has {table.column_names}")


def _scalars(table: pa.Table, name: str, default: float | None = None) -> np.ndarray:
    if name not in table.column_names:
        if default is None:
            raise ValueError(f"missing column {name!r}; the table has {table.column_names}")
        return np.full(table.num_rows, default, dtype=np.float64)
    column = table.column(name)
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {name!r}: row {row} is null")
    values = column.to_numpy().astype(np.float64)
    if not np.isfinite(values).all():
        row = int(np.flatnonzero(~np.isfinite(values))[0])
        raise ValueError(f"column {name!r}: row {row} is {values[row]} (must be finite)")
    return values


def _check_nonempty(lengths: np.ndarray, name: str, why: str) -> None:
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"row {int(empty[0])}: {name} is empty ({empty.size} such rows); {why}")


def _read_mask(table: pa.Table, name: str, tokens: Ragged, tokens_name: str) -> Ragged | None:
    """Column `name` (list of 0/1, one per token of `tokens_name`) as a Ragged of bools; None
    when the table has no such column."""
    if name not in table.column_names:
        return None
    mask = read_ragged(table, name)
    _check_logprobs(mask, name, tokens, tokens_name)
    bad = np.flatnonzero((mask.values != 0) & (mask.values != 1))
    if bad.size:
        row = int(np.searchsorted(mask.starts, bad[0], side="right") - 1)
        raise ValueError(f"row {row}: {name} has value {mask.values[bad[0]]} (expected 0: tool/environment "
                         "token or 1: model token)")
    return Ragged(mask.values.astype(bool), mask.starts, mask.lengths)


def _check_logprobs(logprobs: Ragged, name: str, tokens: Ragged, tokens_name: str) -> None:
    bad = np.flatnonzero(logprobs.lengths != tokens.lengths)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"row {i}: {name} has {logprobs.lengths[i]} values but {tokens_name} has "
                         f"{tokens.lengths[i]} tokens ({bad.size} such rows); they must match one to one")


# ---- packing -------------------------------------------------------------------------------

def _check_budget(token_budget: int) -> None:
    if not isinstance(token_budget, (int, np.integer)) or token_budget <= 0:
        raise ValueError(f"token_budget must be a positive int (padded tokens per micro-batch), got {token_budget!r}")


def _pack(lengths: np.ndarray, token_budget: int, seqs_per_item: int) -> list[np.ndarray]:
    """Items (rows) sorted by length, ties by row, cut greedily into groups whose padded
    size (sequences x longest length) fits the budget; an item over the budget alone."""
    order = np.lexsort((np.arange(lengths.size), lengths))
    padded = seqs_per_item * lengths[order].astype(np.int64)
    groups, start = [], 0
    while start < order.size:
        # ascending order: the k-th item from `start` is the longest of a group of k, which
        # costs k x its length; that grows with k, so the greedy cut is a binary search
        window = min(order.size - start, token_budget // max(int(padded[start]), 1) + 1)  # no group is longer
        cost = np.arange(1, window + 1) * padded[start : start + window]
        size = max(1, int(np.searchsorted(cost, token_budget, side="right")))
        groups.append(order[start : start + size])
        start += size
    return groups


def _pack_by_prompt(prompts: Ragged, responses: Ragged, token_budget: int, max_len: int) -> list[np.ndarray]:
    """share_prompts: rows cut into micro-batches as pack_shared_prompts will lay them out, so
    that a prompt's rows meet: rows ordered by prompt (first seen), then length; a micro-batch
    takes rows while its packed sequences (a prompt, then responses, at most `max_len` tokens
    each) padded to the longest fit `token_budget`; a row over the budget alone."""
    rows = np.arange(prompts.lengths.size)
    prompt_of = prompt_numbers(prompts, rows)
    order = np.lexsort((rows, responses.lengths, prompt_of))
    groups, current = [], []
    sequences, longest, last, length = 0, 0, -1, 0
    for j in order.tolist():
        p, r = int(prompts.lengths[j]), int(responses.lengths[j])
        opens = opens_sequence(int(prompt_of[j]), last, length, r, max_len)
        new_length = p + r if opens else length + r
        cost = (sequences + opens) * max(longest, new_length)
        if current and cost > token_budget:
            groups.append(np.array(current, dtype=np.int64))
            current, sequences, longest, opens, new_length = [], 0, 0, True, p + r
        current.append(j)
        sequences += opens
        length, last = new_length, prompt_of[j]
        longest = max(longest, length)
    if current:
        groups.append(np.array(current, dtype=np.int64))
    return groups


def _fill(prompts: Ragged, responses: Ragged, logprobs: Ragged | None, items: np.ndarray, first: int,
          ids: np.ndarray, attention: np.ndarray, targets: np.ndarray, old: np.ndarray | None,
          masks: Ragged | None = None) -> None:
    """Table rows `items` into buffer rows first, first+1, ...: the prompt then the response
    (prompt length p, response length r), attention on both, targets at t = p-1 .. p+r-2 (with
    `masks`, only where the response token's mask is True), and with `old` the response's
    log-probs at the targets (0 elsewhere)."""
    slots = slice(first, first + items.size)
    p, r = prompts.lengths[items], responses.lengths[items]
    row, k, at = spans(prompts.starts[items], p)
    ids[first + row, k] = prompts.values[at]
    row, k, at = spans(responses.starts[items], r)
    ids[first + row, p[row] + k] = responses.values[at]
    columns = np.arange(ids.shape[1])
    attention[slots] = columns < (p + r)[:, None]
    targets[slots] = (columns[:-1] >= (p - 1)[:, None]) & (columns[:-1] < (p + r - 1)[:, None])
    if masks is not None:
        row, k, at = spans(masks.starts[items], masks.lengths[items])
        targets[first + row, p[row] - 1 + k] = masks.values[at]
    if old is not None:
        _place(logprobs, items, first, p, old)
        if masks is not None:
            _zero_outside(old, targets, slots)


def _zero_outside(buffer: np.ndarray, targets: np.ndarray, slots: slice) -> None:
    """buffer rows `slots` set to 0 where they are not targets (masked response tokens)."""
    buffer[slots] = np.where(targets[slots], buffer[slots], 0.0)


def _place(logprobs: Ragged, items: np.ndarray, first: int, p: np.ndarray, buffer: np.ndarray) -> None:
    """Rows `items`' response log-probs into buffer rows first, first+1, ... at their
    next-token positions (prompt lengths p)."""
    row, k, at = spans(logprobs.starts[items], logprobs.lengths[items])
    buffer[first + row, p[row] - 1 + k] = logprobs.values[at]


def _tensors(ids, attention, targets, old):
    return (torch.from_numpy(ids), torch.from_numpy(attention), torch.from_numpy(targets),
            None if old is None else torch.from_numpy(old))


def _buffers(b: int, L: int, pad_id: int, with_old: bool):
    return (np.full((b, L), pad_id, dtype=np.int64), np.zeros((b, L), dtype=np.int64),
            np.zeros((b, L - 1), dtype=bool), np.zeros((b, L - 1), dtype=np.float32) if with_old else None)


# ---- public --------------------------------------------------------------------------------

def policy_batches(table: pa.Table, token_budget: int, pad_id: int = 0, share_prompts: bool = False,
                   shared_max_len: int = SHARED_MAX_LEN) -> list[MicroBatch]:
    """Micro-batches of a samples-like table for the policy losses (grpo, gspo, sft).

    Columns: prompt_token_ids, response_token_ids (list<int>); optional response_mask (list of
    0/1, one per response token: only the 1s are targets, see the module docstring); optional
    old_logprobs and
    behavior_logprobs (list<float>, one per response token) -> old_logp (old_logprobs if
    there, else behavior_logprobs) and behavior_logp (when both are there); optional
    advantage (float) -> advantages (zeros when absent); optional policy_version (int) ->
    policy_version; optional round (int) -> staleness. Every row lands in exactly one
    micro-batch. `share_prompts`: each micro-batch also carries `shared` (SharedPrompts, packed
    sequences no longer than `shared_max_len`), which the log-probs are computed from.
    """
    _check_budget(token_budget)
    _require(table, ["prompt_token_ids", "response_token_ids"], "policy_batches")
    prompts, responses = read_ragged(table, "prompt_token_ids"), read_ragged(table, "response_token_ids")
    _check_nonempty(prompts.lengths, "prompt_token_ids", "the first response token needs at least one "
                    "prompt token (e.g. BOS) to be predicted from")
    _check_nonempty(responses.lengths, "response_token_ids", "there is no token to train on")
    logprobs = {}
    for name in ("old_logprobs", "behavior_logprobs"):
        if name in table.column_names:
            logprobs[name] = read_ragged(table, name)
            _check_logprobs(logprobs[name], name, responses, "response_token_ids")
    old = logprobs.get("old_logprobs", logprobs.get("behavior_logprobs"))
    behavior = logprobs.get("behavior_logprobs") if "old_logprobs" in logprobs else None
    masks = _read_mask(table, "response_mask", responses, "response_token_ids")
    advantage = _scalars(table, "advantage", default=0.0)
    versions = table.column("policy_version").to_numpy() if "policy_version" in table.column_names else None
    staleness = None
    if "round" in table.column_names and table.num_rows:
        rounds = table.column("round").to_numpy().astype(np.int64)
        staleness = rounds.max() - rounds

    batches = []
    cuts = (_pack_by_prompt(prompts, responses, token_budget, shared_max_len) if share_prompts
            else _pack(prompts.lengths + responses.lengths, token_budget, seqs_per_item=1))
    for group in cuts:
        L = int((prompts.lengths[group] + responses.lengths[group]).max())
        ids, attention, targets, old_buf = _buffers(len(group), L, pad_id, old is not None)
        _fill(prompts, responses, old, group, 0, ids, attention, targets, old_buf, masks)
        behavior_buf = None if behavior is None else np.zeros_like(old_buf)
        if behavior_buf is not None:
            _place(behavior, group, 0, prompts.lengths[group], behavior_buf)
            if masks is not None:
                _zero_outside(behavior_buf, targets, slice(0, len(group)))
        batches.append(MicroBatch(*_tensors(ids, attention, targets, old_buf),
                                  advantages=torch.from_numpy(advantage[group].astype(np.float32)),
                                  rows=torch.from_numpy(group.astype(np.int64)),
                                  policy_version=None if versions is None
                                  else torch.from_numpy(versions[group].astype(np.int64)),
                                  behavior_logp=None if behavior_buf is None else torch.from_numpy(behavior_buf),
                                  staleness=None if staleness is None else torch.from_numpy(staleness[group]),
                                  shared=pack_shared_prompts(prompts, responses, group, pad_id, shared_max_len,
                                                             masks) if share_prompts else None))
    return batches


def pair_batches(table: pa.Table, token_budget: int, pad_id: int = 0) -> list[MicroBatch]:
    """Micro-batches of preference pairs for the pairwise loss; a pair never splits.

    Columns: prompt_token_ids, chosen_token_ids, rejected_token_ids (list<int>), soft_label,
    weight (float); optional chosen_logprobs and rejected_logprobs (both or neither) ->
    old_logp; optional chosen_response_mask and rejected_response_mask (both or neither; list
    of 0/1 per token: only the 1s are targets, so a sequence's log-prob sums the model's
    tokens). A micro-batch of k pairs has 2k sequences: rows 0..k-1 chosen, k..2k-1 the
    rejected of the same pairs; budget: 2k x (longest of its 2k sequences) <= token_budget.
    """
    _check_budget(token_budget)
    _require(table, ["prompt_token_ids", "chosen_token_ids", "rejected_token_ids", "soft_label", "weight"],
             "pair_batches")
    prompts = read_ragged(table, "prompt_token_ids")
    chosen, rejected = read_ragged(table, "chosen_token_ids"), read_ragged(table, "rejected_token_ids")
    _check_nonempty(prompts.lengths, "prompt_token_ids", "the first response token needs at least one "
                    "prompt token (e.g. BOS) to be predicted from")
    _check_nonempty(chosen.lengths, "chosen_token_ids", "there is no token to train on")
    _check_nonempty(rejected.lengths, "rejected_token_ids", "there is no token to train on")
    has = ["chosen_logprobs" in table.column_names, "rejected_logprobs" in table.column_names]
    if any(has) and not all(has):
        raise ValueError("pair_batches: chosen_logprobs and rejected_logprobs come together; the table has "
                         f"only {'chosen_logprobs' if has[0] else 'rejected_logprobs'}")
    chosen_lp = rejected_lp = None
    if all(has):
        chosen_lp, rejected_lp = read_ragged(table, "chosen_logprobs"), read_ragged(table, "rejected_logprobs")
        _check_logprobs(chosen_lp, "chosen_logprobs", chosen, "chosen_token_ids")
        _check_logprobs(rejected_lp, "rejected_logprobs", rejected, "rejected_token_ids")
    has = ["chosen_response_mask" in table.column_names, "rejected_response_mask" in table.column_names]
    if any(has) and not all(has):
        raise ValueError("pair_batches: chosen_response_mask and rejected_response_mask come together; the table "
                         f"has only {'chosen_response_mask' if has[0] else 'rejected_response_mask'}")
    chosen_mask = _read_mask(table, "chosen_response_mask", chosen, "chosen_token_ids")
    rejected_mask = _read_mask(table, "rejected_response_mask", rejected, "rejected_token_ids")
    soft_label, weight = _scalars(table, "soft_label"), _scalars(table, "weight")

    batches = []
    pair_lengths = prompts.lengths + np.maximum(chosen.lengths, rejected.lengths)
    for group in _pack(pair_lengths, token_budget, seqs_per_item=2):
        k, L = len(group), int(pair_lengths[group].max())
        ids, attention, targets, old = _buffers(2 * k, L, pad_id, chosen_lp is not None)
        _fill(prompts, chosen, chosen_lp, group, 0, ids, attention, targets, old, chosen_mask)
        _fill(prompts, rejected, rejected_lp, group, k, ids, attention, targets, old, rejected_mask)
        batches.append(MicroBatch(*_tensors(ids, attention, targets, old),
                                  advantages=torch.zeros(2 * k, dtype=torch.float32),
                                  rows=torch.from_numpy(np.concatenate([group, group]).astype(np.int64)),
                                  soft_label=torch.from_numpy(soft_label[group].astype(np.float32)),
                                  weight=torch.from_numpy(weight[group].astype(np.float32)),
                                  num_pairs=k))
    return batches


def prompt_groups(table: pa.Table) -> np.ndarray:
    """A group id per row of a table with prompt_token_ids: rows with the same prompt share one
    (numbered as first seen), the key share_prompts packs by."""
    return prompt_numbers(read_ragged(table, "prompt_token_ids"), np.arange(table.num_rows))


def step_normalizer(batches: list[MicroBatch]) -> Normalizer:
    """Totals over all micro-batches of one optimizer step: num_seqs (sequences; pairwise:
    pairs), num_tokens (target tokens: the model's tokens, both sides of a pair), weight_sum
    (pairwise only)."""
    if not batches:
        raise ValueError("step_normalizer: no micro-batches")
    pairwise = {b.num_pairs > 0 for b in batches}
    if len(pairwise) > 1:
        raise ValueError("step_normalizer: one step mixes pair and policy micro-batches")
    num_tokens = float(sum(int(b.target_mask.sum()) for b in batches))
    if pairwise.pop():
        return Normalizer(num_seqs=float(sum(b.num_pairs for b in batches)), num_tokens=num_tokens,
                          weight_sum=float(sum(float(b.weight.double().sum()) for b in batches)))
    return Normalizer(num_seqs=float(sum(b.input_ids.shape[0] for b in batches)), num_tokens=num_tokens)
