"""The rows an objective trains on, read from a run's tables.

    grpo, gspo, gspo_token,  samples JOIN groups  WHERE group_kept            one row per sample
    cispo
    sft                      samples JOIN groups  WHERE advantage > 0          (or reward >= sft_min_reward)
    pairwise                 pairs JOIN samples (chosen) JOIN samples (rejected)   one row per pair

Multi-turn samples (the trajectory columns of `store.schema`) bring their `response_mask` (1 on
the model's tokens, 0 on tool/environment tokens): policy rows carry it as `response_mask`, pair
rows as `chosen_response_mask` and `rejected_response_mask`, and training.batching keeps the
masked tokens out of every loss. When some of the chosen parts have it and others not, the
rows without it get all ones; when none has it, the rows have no such column (single-turn
rows are exactly what they were).

The tables are read through the store's one column reader (`RunStore.read_columns`,
store/table_reads.py): every part file's schema is checked against `store.schema` before it is
read, so a wrong table fails with a message naming the file and column. Rows come out in key
order (round, prompt_id, sample_idx / chosen_idx, rejected_idx; ties in row order), so the same
tables always give the same dataset, and `fingerprint` names it.

The joins run in pyarrow on the few columns they need. `run` is a run folder or a RunStore:
the round loop passes its store, whose held parts (the tables its stages just committed) are
read from memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from store.run_store import RunStore

POLICY_OBJECTIVES = ("grpo", "gspo", "gspo_token", "cispo")
OBJECTIVES = POLICY_OBJECTIVES + ("pairwise", "sft")

class NoTrainingData(ValueError):
    """The chosen rounds hold no rows for the objective (e.g. every group had equal rewards)."""


@dataclass
class TrainingData:
    objective: str
    rounds: list[int]
    table: pa.Table
    """Policy/sft: prompt_token_ids, response_token_ids, behavior_logprobs, advantage, reward,
    policy_version + keys, and response_mask for multi-turn samples. Pairwise: prompt_token_ids,
    chosen_token_ids, rejected_token_ids, chosen_logprobs, rejected_logprobs, soft_label, weight
    + pair keys, and chosen_response_mask, rejected_response_mask for multi-turn samples."""
    fingerprint: str
    """sha256 of the input part files and the selection: equal fingerprints, equal rows."""
    temperature: float | None
    """The sampling temperature of these rounds (from the generate manifests), if recorded."""
    top_k: int = 0
    """The rounds' sampling top_k (0: off), from the generate manifests."""
    top_p: float = 1.0
    """The rounds' sampling top_p (1: off), from the generate manifests."""

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


def select_rounds(store: RunStore, objective: str, rounds: list[int] | None, max_staleness: int | None) -> list[int]:
    """The rounds to train on: the given ones (or every round with labels/pairs), minus those
    more than `max_staleness` rounds older than the newest round of samples in the run. Given
    rounds look only at their own folders, so a call costs the same in round 5 and round 500."""
    source = "pairs" if objective == "pairwise" else "groups"
    if rounds is None:
        chosen = store.rounds(source)
    else:
        chosen = sorted(set(rounds))
        missing = [round for round in chosen if not store.files(source, round)]
        if missing:
            available = store.rounds(source)
            raise ValueError(f"{store.location}: no {source} table for round(s) {missing}; rounds with {source}: "
                             f"{available or 'none'} (run `groupforge curate` first)")
    if max_staleness is not None and chosen:
        newest = _newest_round(store, "samples")
        newest = max(chosen) if newest is None else newest
        chosen = [round for round in chosen if newest - round <= max_staleness]
    return chosen


def _newest_round(store: RunStore, table: str) -> int | None:
    """The newest round of `table` with a live part file."""
    rounds = store.rounds(table)
    return rounds[-1] if rounds else None


def _response_mask(samples: pa.Table) -> pa.ChunkedArray | None:
    """The samples' response_mask (read as nulls from parts without it), all ones for rows
    without one; None when no row has one (single-turn samples)."""
    mask = samples.column("response_mask")
    if mask.null_count == len(mask):
        return None
    if mask.null_count:
        lengths = pc.list_value_length(samples.column("response_token_ids")).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ones = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(int(offsets[-1]), np.int8)))
        mask = pc.coalesce(mask, ones)
    return mask


_SAMPLING_KEYS = ("temperature", "top_k", "top_p")


def round_sampling(store: RunStore, rounds: list[int]) -> dict[str, float | None]:
    """The rounds' temperature, top_k and top_p from their generate manifests: one value per
    setting, or None when no manifest records it; rounds that differ are an error."""
    values: dict[str, set[float]] = {key: set() for key in _SAMPLING_KEYS}
    for round in rounds:
        manifest = store.load_manifest("generate", round)
        sampling = ((manifest or {}).get("config") or {}).get("sampling") or {}
        for key in _SAMPLING_KEYS:
            if key in sampling:
                values[key].add(float(sampling[key]))
    for key, found in values.items():
        if len(found) > 1:
            what, hint = (("at different temperatures", "set `temperature`") if key == "temperature" else
                          (f"with different {key} values", "set `truncated_logprobs = false`"))
            raise ValueError(f"{store.location}: rounds {rounds} were sampled {what} {sorted(found)}; "
                             f"train on them separately or {hint}")
    return {key: found.pop() if found else None for key, found in values.items()}


_KEYS = ["run_id", "round", "prompt_id"]  # + sample_idx (policy) or chosen_idx / rejected_idx (pairs)
_SAMPLE_COLUMNS = ["run_id", "round", "prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids",
                   "behavior_logprobs", "policy_version", "response_mask"]
_PAIR_COLUMNS = ["run_id", "round", "prompt_id", "chosen_idx", "rejected_idx", "chosen_reward", "rejected_reward",
                 "soft_label", "weight"]


def _match(left: pa.Table, left_on: list[str], right: pa.Table, right_on: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (i, j) of every pair of rows with left[i][left_on] == right[j][right_on] (an
    inner join: duplicates give every combination, a null key matches nothing), in (i, j)
    order. Each key column of both sides is numbered by Arrow's hash (equal values, equal
    numbers), the numbered keys are matched with a sort and a binary search, and the caller
    `take`s the columns it needs (a hash join would also cost ~4x as much here)."""
    n = left.num_rows
    key, distinct, valid = np.zeros(n + right.num_rows, dtype=np.int64), 1, np.ones(n + right.num_rows, dtype=bool)
    for a, b in zip(left_on, right_on):  # key = number of the key tuple so far, in mixed radix
        encoded = pc.dictionary_encode(pa.concat_arrays(left.column(a).chunks + right.column(b).chunks))
        valid &= encoded.indices.is_valid().to_numpy(zero_copy_only=False)
        size = max(len(encoded.dictionary), 1)
        if distinct * size >= 2**62:  # renumber the tuples so far densely before they overflow
            key = np.unique(key, return_inverse=True)[1].reshape(-1)
            distinct = int(key.max()) + 1
        key = key * size + encoded.indices.fill_null(0).to_numpy()
        distinct *= size
    key[~valid] = -1
    left_key, right_key = key[:n], key[n:]
    order = np.flatnonzero(right_key >= 0)
    order = order[np.argsort(right_key[order], kind="stable")]  # right rows by key, row order within
    ordered = right_key[order]
    lo, hi = np.searchsorted(ordered, left_key, "left"), np.searchsorted(ordered, left_key, "right")
    counts = np.where(left_key >= 0, hi - lo, 0)
    ends = np.cumsum(counts)
    within = np.arange(int(ends[-1]) if n else 0) - np.repeat(ends - counts, counts)
    return np.repeat(np.arange(n), counts), order[np.repeat(lo, counts) + within]


def _in_key_order(table: pa.Table, keys: list[str]) -> pa.Table:
    """`table` sorted by `keys` (stable: ties stay in row order)."""
    return table.take(pc.sort_indices(table, sort_keys=[(key, "ascending") for key in keys]))


def _kept_groups(groups: pa.Table, objective: str, sft_min_reward: float | None) -> pa.Table:
    """The groups rows the objective trains on: kept groups (policy), advantage > 0 or reward
    >= sft_min_reward (sft); a null never passes."""
    if objective == "sft":
        keep = pc.greater(groups["advantage"], 0.0) if sft_min_reward is None else \
            pc.greater_equal(groups["reward"], float(sft_min_reward))
    else:
        keep = groups["group_kept"]
    return groups.filter(keep)


def _policy_rows(store: RunStore, rounds: list[int], objective: str, sft_min_reward: float | None,
                 count: bool = False) -> pa.Table | int:
    """samples JOIN groups on the keys, the objective's groups rows only, in key order: the
    sample columns then advantage and reward; with `count`, only how many rows."""
    filter_column = "group_kept" if objective != "sft" else "advantage" if sft_min_reward is None else "reward"
    keys = _KEYS + ["sample_idx"]
    groups = _kept_groups(store.read_columns("groups", list(dict.fromkeys(
        keys + ([] if count else ["advantage", "reward"]) + [filter_column])), rounds), objective, sft_min_reward)
    samples = store.read_columns("samples", keys if count else _SAMPLE_COLUMNS, rounds)
    s, g = _match(samples, keys, groups, keys)
    if count:
        return int(s.size)
    mask = _response_mask(samples)
    rows = samples.drop_columns(["response_mask"]).take(s)
    if mask is not None:
        rows = rows.append_column(pa.field("response_mask", mask.type), mask.take(s))
    for name in ("advantage", "reward"):
        rows = rows.append_column(name, groups[name].take(g))
    return _in_key_order(rows, ["round", "prompt_id", "sample_idx"])


def _pair_rows(store: RunStore, rounds: list[int], count: bool = False) -> pa.Table | int:
    """pairs JOIN samples (chosen) JOIN samples (rejected), in key order: the pair's keys, the
    prompt and both responses with their behavior log-probs, rewards, soft_label, weight; with
    `count`, only how many rows."""
    pairs = store.read_columns("pairs", _KEYS + ["chosen_idx", "rejected_idx"] if count else _PAIR_COLUMNS, rounds)
    samples = store.read_columns("samples", _KEYS + ["sample_idx"] if count else _SAMPLE_COLUMNS, rounds)
    p_c, c = _match(pairs, _KEYS + ["chosen_idx"], samples, _KEYS + ["sample_idx"])
    p_r, r = _match(pairs, _KEYS + ["rejected_idx"], samples, _KEYS + ["sample_idx"])
    # each pair row with each of its chosen and each of its rejected matches (one and one)
    both = pa.table({"p": p_c, "c": c}).join(pa.table({"p": p_r, "r": r}), keys="p", join_type="inner",
                                             use_threads=False)
    both = _in_key_order(both, ["p", "c", "r"])
    if count:
        return both.num_rows
    chosen, rejected = samples.take(both["c"]), samples.take(both["r"])
    kept = pairs.take(both["p"])
    mask = _response_mask(samples)
    masks = {} if mask is None else {"chosen_response_mask": mask.take(both["c"]),
                                     "rejected_response_mask": mask.take(both["r"])}
    rows = pa.table({
        **{name: kept[name] for name in _PAIR_COLUMNS[:5]},
        "prompt_token_ids": chosen["prompt_token_ids"],
        "chosen_token_ids": chosen["response_token_ids"], "chosen_logprobs": chosen["behavior_logprobs"],
        "rejected_token_ids": rejected["response_token_ids"], "rejected_logprobs": rejected["behavior_logprobs"],
        **{name: kept[name] for name in _PAIR_COLUMNS[5:]},
        **masks,
    })
    return _in_key_order(rows, ["round", "prompt_id", "chosen_idx", "rejected_idx"])


def _inputs(run: RunStore | str | Path, objective: str, rounds: list[int] | None,
            max_staleness: int | None) -> tuple[RunStore, list[int], dict[str, list[str]]]:
    """The run's store, the chosen rounds and their part files per table."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    store = run if isinstance(run, RunStore) else RunStore(run)
    chosen = select_rounds(store, objective, rounds, max_staleness)
    source = "pairs" if objective == "pairwise" else "groups"
    return store, chosen, {"samples": store.files("samples", chosen), source: store.files(source, chosen)}


def count_training_rows(run: RunStore | str | Path, objective: str, rounds: list[int] | None = None,
                        max_staleness: int | None = None, sft_min_reward: float | None = None) -> int:
    """How many rows `load_training_data` would return, without reading token lists or hashing
    files (only the key and filter columns are read): the round loop sizes a round's
    training (`training.config.steps_for_passes`) before it starts. 0 when there are none."""
    store, chosen, files = _inputs(run, objective, rounds, max_staleness)
    if not (chosen and all(files.values())):
        return 0
    if objective == "pairwise":
        return _pair_rows(store, chosen, count=True)
    return _policy_rows(store, chosen, objective, sft_min_reward, count=True)


def load_training_data(run: RunStore | str | Path, objective: str, rounds: list[int] | None = None,
                       max_staleness: int | None = None, sft_min_reward: float | None = None) -> TrainingData:
    """The rows `objective` trains on from `rounds` of the run (see the module docstring)."""
    store, chosen, files = _inputs(run, objective, rounds, max_staleness)
    table = None
    if chosen and all(files.values()):
        table = _pair_rows(store, chosen) if objective == "pairwise" else \
            _policy_rows(store, chosen, objective, sft_min_reward)
    h = hashlib.sha256(f"{objective}|{sft_min_reward}|".encode())
    for table_name in sorted(files):
        for rel, digest in store.part_fingerprints(files[table_name]).items():
            h.update(f"{rel}={digest}\n".encode())
    if table is None or table.num_rows == 0:
        raise NoTrainingData(f"{store.location}: nothing to train on for objective {objective!r} in rounds "
                         f"{chosen or 'none'} (no {'pairs' if objective == 'pairwise' else 'kept groups'}"
                         f"{'' if max_staleness is None else f' within max_staleness={max_staleness}'})")
    sampling = round_sampling(store, chosen)
    return TrainingData(objective=objective, rounds=chosen, table=table, fingerprint=h.hexdigest(),
                        temperature=sampling["temperature"], top_k=int(sampling["top_k"] or 0),
                        top_p=1.0 if sampling["top_p"] is None else sampling["top_p"])
