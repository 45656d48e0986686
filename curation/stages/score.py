"""The score stage: samples + prompts -> RUN/scores/round=<n>/part-score.parquet (+ rejects).

    samples ──(prompt_id)── prompts: prompt | messages, reference, metadata
        │  for each reward function (a column): reuse the existing value when the row's
        │  scorer fingerprint for that column is unchanged, else compute it:
        │    vectorized(...) over Arrow columns        (exact_match, length penalties)
        │    in this process, batched                  (reward_model)
        │    in worker processes, one item at a time   (everything else: math, regex, users')
        ▼
    scores: keys + one float64 column per reward (null = not applicable)
            + reward = sum_i weight_i * x_i over the non-null x_i (null when all are null)
            + scorer = {"column": "name@version#kwargs-hash", ...} as JSON
    rejects (score, invalid_reward): a reward raised, timed out, crashed its worker or gave
            NaN/inf; detail = "column: error". Such a row gets no scores row.

A rerun computes only the (row, column) pairs it lacks: a new reward is one new column, a
changed fingerprint (version or kwargs) rescores that column, a weight change only
recomputes `reward`. Existing scores are reused only while the round's samples files are
the ones they were computed from (a regenerated round is rescored); `force` rescores all.
A changed reference for an already scored prompt (same prompt_id) needs `force`. The
manifest records, per reward column, the rows computed and reused.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from curation.rewards.pool import default_workers, run_inline, run_isolated
from curation.rewards.registry import TRAJECTORY_COLUMNS, TRL_COLUMNS, column_name, get_reward, reward_fingerprint
from curation.stages.common import rejects_table, rows_of
from curation.stages.runner import StageOutput, as_dict
from store.layout import part_name
from store.run_store import RunStore
from store.schema import KEYS, SCHEMAS, SchemaError, empty, validate

STAGE = "score"
READS = ("samples", "prompts")
WRITES = ("scores", "rejects")
RESERVED_COLUMNS = set(KEYS) | {"reward", "scorer"}


class RewardSpec(BaseModel):
    """One reward function of the score stage, and the scores column it fills."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="A registered reward (exact_match, math, regex, length_penalty, overlong_penalty, "
                                  "reward_model) or 'module:function' with TRL's signature.")
    weight: float = Field(1.0, description="Weight of this column in the total `reward`.")
    column: str | None = Field(None, description="Scores column name; default: the name with non-identifier "
                                                 "characters replaced by '_'.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the reward factory "
                                   "(or bound to a 'module:function'); part of the scorer fingerprint.")
    timeout_s: float = Field(10.0, gt=0, description="Per-item time limit in the worker pool; an item past it "
                                                     "is rejected with 'timeout after Xs'.")

    @property
    def column_name(self) -> str:
        return self.column or column_name(self.name)


class ScoreConfig(BaseModel):
    """The score stage's configuration (the `[score]` spec section)."""

    model_config = ConfigDict(extra="forbid")

    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="exact_match")], min_length=1,
                                      description="Reward functions; `reward` is their weighted sum.")
    workers: int | None = Field(None, ge=1, description="Worker processes for isolated rewards; default: the "
                                "usable CPUs, at most 8. Not part of the config hash (results do not depend on it).")
    memory_mb: int | None = Field(4096, ge=64, description="Address-space limit of each reward worker process "
                                  "(RLIMIT_AS); a reward past it gets a MemoryError and its row is rejected. None: "
                                  "no limit. Not part of the config hash.")
    cpu_seconds: float | None = Field(None, gt=0, description="CPU seconds each item may use in a reward worker "
                                      "(RLIMIT_CPU); default: the reward's timeout_s. Not part of the config hash.")

    @model_validator(mode="after")
    def _columns_are_distinct(self) -> ScoreConfig:
        seen: set[str] = set()
        for spec in self.rewards:
            name = spec.column_name
            if not name.isidentifier():
                raise ValueError(f"reward {spec.name!r}: column {name!r} is not an identifier")
            if name in RESERVED_COLUMNS:
                raise ValueError(f"reward {spec.name!r}: column {name!r} is reserved; set `column`")
            if name in seen:
                raise ValueError(f"two rewards write column {name!r}; give one of them another `column`")
            seen.add(name)
        return self


CONFIG = ScoreConfig

# The samples columns rewards see (TRL_COLUMNS and the response); the token-id and log-prob
# lists of the prompt are never read, which is most of a samples file's bytes.
SAMPLE_COLUMNS = list(KEYS) + ["response", "group_size", "finish_reason", "policy_version", "response_token_ids"]


def columns(cfg: ScoreConfig) -> dict[str, list[str] | None]:
    """The samples columns rewards see, with the trajectory columns they get (TRAJECTORY_COLUMNS:
    nulls in a single-turn table, which then leave the rewards' arguments as they are)."""
    return {"samples": SAMPLE_COLUMNS + list(TRAJECTORY_COLUMNS), "prompts": None}


# ---- the transform ------------------------------------------------------------------


def transform(tables: dict[str, pa.Table], cfg: ScoreConfig) -> StageOutput:
    """scores and rejects of tables["samples"] (SAMPLE_COLUMNS at least, contract types) with
    their prompts (tables["prompts"]), reusing the values of tables["scores"] (earlier scores,
    optional) whose scorer fingerprint is unchanged."""
    samples, existing = tables["samples"], tables.get("scores")
    rows = _inputs(samples, validate(tables["prompts"], "prompts"))
    n = rows.num_rows
    in_existing = _existing_rows(rows, existing)
    failed = np.zeros(n, dtype=bool)
    details: dict[int, str] = {}
    arrays: dict[str, pa.Array] = {}  # reward column -> its values
    fingerprints: dict[str, str] = {}
    stats: dict[str, dict[str, float]] = {}
    for spec in cfg.rewards:
        tic = time.perf_counter()
        fn = get_reward(spec.name, **spec.kwargs)
        column = spec.column_name
        fingerprints[column] = reward_fingerprint(spec.name, fn, spec.kwargs)
        values, null = np.zeros(n), np.ones(n, dtype=bool)
        reused = _reusable(in_existing, existing, column, fingerprints[column])
        if reused.any():
            old = existing.column(column).take(pa.array(in_existing[reused]))
            values[reused], null[reused] = _to_numpy(old)
        todo = np.flatnonzero(~reused & ~failed)  # rows that failed an earlier reward are rejected anyway
        if len(todo):
            part = rows if len(todo) == n else rows_of(rows, todo)
            got_values, got_null, errors = _compute(fn, part, spec.timeout_s, cfg)
            where = slice(None) if len(todo) == n else todo  # a slice: no fancy indexing of all rows
            values[where], null[where] = got_values, got_null
            for i, error in errors.items():
                failed[todo[i]] = True
                details[int(todo[i])] = f"{column}: {error}"
        arrays[column] = _from_numpy(values, null)
        stats[column] = {"computed": int(len(todo)), "reused": int(reused.sum()),
                         "seconds": round(time.perf_counter() - tic, 3)}

    total = _weighted_total(arrays, {s.column_name: s.weight for s in cfg.rewards})
    scorer = pa.repeat(pa.scalar(json.dumps(fingerprints, sort_keys=True)), n)
    # in the order validate gives (the contract's columns, then one per reward) and with its
    # schema, so that validate has nothing to rebuild
    fields = [*SCHEMAS["scores"], *(pa.field(column, pa.float64()) for column in arrays)]
    scores = pa.Table.from_arrays([*rows.select(list(KEYS)).columns, total, scorer, *arrays.values()],
                                  schema=pa.schema(fields))
    if failed.any():
        scores = scores.filter(pa.array(~failed))
    scores = validate(scores, "scores")
    bad_rows = sorted(details)
    if bad_rows:
        lost = rows_of(rows.select(list(KEYS)), np.array(bad_rows, dtype=np.int64)).to_pydict()
        rejects = rejects_table(lost["run_id"], lost["round"], lost["prompt_id"], lost["sample_idx"],
                                STAGE, "invalid_reward", [details[i] for i in bad_rows])
    else:
        rejects = empty("rejects")
    return StageOutput({"scores": scores, "rejects": rejects}, rows_in=n, rows_out=scores.num_rows,
                       extra={"scorer": fingerprints, "reward_columns": stats})


def _compute(fn, part: pa.Table, timeout_s: float,
             cfg: ScoreConfig) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """(values, null mask, {row: error}) of one reward function over the rows of `part`."""
    if hasattr(fn, "vectorized"):
        got = fn.vectorized(part.column("response"), **{c: part.column(c) for c in TRL_COLUMNS})
        if len(got) != part.num_rows:
            raise ValueError(f"{fn!r}.vectorized returned {len(got)} scores for {part.num_rows} rows")
        errors: dict[int, str] = {}
    else:
        if getattr(fn, "isolate", True):
            scores, texts = run_isolated(fn, part, timeout_s=timeout_s, workers=cfg.workers or default_workers(),
                                         memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_seconds or timeout_s)
        else:
            scores, texts = run_inline(fn, part)
        got = pa.array(scores, pa.float64())
        errors = {i: text for i, text in enumerate(texts) if text is not None}
    values, null = _to_numpy(got)
    for i in np.flatnonzero(~null & ~np.isfinite(values)):
        errors[int(i)] = str(float(values[i]))  # "nan", "inf" or "-inf"
    return values, null, errors


def _inputs(samples: pa.Table, prompts: pa.Table) -> pa.Table:
    """The samples (in order) with their prompt's prompt, messages, reference and metadata, and
    the TRAJECTORY_COLUMNS when some rows are trajectories (not when every row is single-turn)."""
    prompts = _one_row_per_prompt(prompts)
    ids = samples.column("prompt_id")
    n = samples.num_rows
    # A group's rows are adjacent (as generate writes them): look each run of equal ids up once.
    starts = np.ones(n, dtype=bool)
    if n > 1:
        starts[1:] = pc.not_equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    at_starts = ids.filter(starts)
    if len(at_starts) == prompts.num_rows and at_starts.equals(prompts.column("prompt_id")):
        index = pa.array(np.arange(prompts.num_rows))  # the round's prompts, in order (as the loop writes them)
    else:
        index = pc.index_in(at_starts, value_set=prompts.column("prompt_id"))
    if index.null_count:
        missing = at_starts.filter(index.is_null())
        raise SchemaError(f"samples table: {len(missing)} group(s) have a prompt_id that is not in the prompts "
                          f"table (first: {missing[0].as_py()})")
    run_lengths = np.diff(np.flatnonzero(starts), append=n)
    per_row = np.repeat(index.to_numpy(zero_copy_only=False), run_lengths)
    joined = prompts.select(["prompt", "messages", "reference", "metadata"]).take(pa.array(per_row))
    rows = samples.select(SAMPLE_COLUMNS)
    if "messages_out" in samples.column_names and samples.column("messages_out").null_count < n:
        for name in TRAJECTORY_COLUMNS:  # trajectories: the rewards get them (registry.trl_arguments)
            rows = rows.append_column(samples.schema.field(name), samples.column(name))
    for name in joined.column_names:
        rows = rows.append_column(name, joined.column(name))
    return rows


def _one_row_per_prompt(prompts: pa.Table) -> pa.Table:
    """Prompts deduplicated by prompt_id (a prompt listed by several prompts parts), preferring a
    row with a reference; two different references for one prompt are an error."""
    ids = prompts.column("prompt_id")
    unique = pc.unique(ids)
    if len(unique) == len(ids):
        return prompts
    per_prompt = prompts.group_by("prompt_id").aggregate([("reference", "count_distinct")])
    conflicts = per_prompt.filter(pc.greater(per_prompt.column("reference_count_distinct"), 1))
    if conflicts.num_rows:
        raise SchemaError(f"prompts table: {conflicts.num_rows} prompt(s) have different references in "
                          f"different rows (first: {conflicts.column('prompt_id')[0].as_py()})")
    prompts = prompts.take(pc.sort_indices(prompts.column("reference").is_null()))  # stable: references first
    return prompts.take(pc.index_in(unique, value_set=prompts.column("prompt_id")))


def _existing_rows(rows: pa.Table, existing: pa.Table | None) -> np.ndarray:
    """For each row: its row number in `existing` (same keys), or -1."""
    found = np.full(rows.num_rows, -1, dtype=np.int64)
    if existing is None or existing.num_rows == 0 or rows.num_rows == 0:
        return found
    existing = validate(existing, "scores")
    if existing.num_rows == rows.num_rows and all(rows.column(k).equals(existing.column(k)) for k in KEYS):
        return np.arange(rows.num_rows)  # the usual rerun: same rows, same order, no join needed
    left = rows.select(list(KEYS)).append_column("_row", pa.array(np.arange(rows.num_rows)))
    right = existing.select(list(KEYS)).append_column("_old", pa.array(np.arange(existing.num_rows)))
    joined = left.join(right, keys=list(KEYS), join_type="inner", use_threads=True)
    found[joined.column("_row").to_numpy()] = joined.column("_old").to_numpy()
    return found


def _reusable(in_existing: np.ndarray, existing: pa.Table | None, column: str, fingerprint: str) -> np.ndarray:
    """Rows whose existing `column` value was computed with `fingerprint`."""
    if existing is None or column not in existing.column_names or not (in_existing >= 0).any():
        return np.zeros(len(in_existing), dtype=bool)
    scorer = existing.column("scorer")
    same = [s for s in pc.unique(scorer).to_pylist() if json.loads(s).get(column) == fingerprint]
    valid = pc.is_in(scorer, value_set=pa.array(same, pa.string())).to_numpy(zero_copy_only=False)
    return (in_existing >= 0) & valid[np.maximum(in_existing, 0)]


def _to_numpy(array: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values with nulls as 0.0, null mask) of a numeric Arrow array."""
    array = array.cast(pa.float64())
    return (pc.fill_null(array, 0.0).to_numpy(zero_copy_only=False),
            array.is_null().to_numpy(zero_copy_only=False))


def _from_numpy(values: np.ndarray, null: np.ndarray) -> pa.Array:
    """A float64 Arrow array from values and a null mask (pa.array(mask=) is ~50x slower)."""
    validity = pa.py_buffer(np.packbits(~null, bitorder="little")) if null.any() else None
    return pa.Array.from_buffers(pa.float64(), len(values), [validity, pa.py_buffer(np.ascontiguousarray(values))])


def _weighted_total(columns: dict[str, pa.Array], weights: dict[str, float]) -> pa.Array:
    """sum_i weight_i * x_i over the non-null x_i; null where every x_i is null."""
    total = np.zeros(len(next(iter(columns.values()))))
    present = np.zeros(len(total), dtype=bool)
    for column, array in columns.items():
        values, null = _to_numpy(array)
        total += weights[column] * values  # nulls are 0.0 here
        present |= ~null
    return _from_numpy(total, ~present)


# ---- the runner's hooks: its own earlier scores, and `workers` left out of the hash ------------


def hashed_config(cfg: ScoreConfig) -> dict:
    """The config as hashed and recorded: `workers` changes no result, and the resource limits
    only the rows of a reward that runs past them, so they are left out."""
    config = dict(as_dict(cfg))
    for key in ("workers", "memory_mb", "cpu_seconds"):
        config.pop(key, None)
    return config


def reused_tables(store: RunStore, round: int, inputs: dict[str, str]) -> dict[str, pa.Table]:
    """{"scores": this round's committed scores} when they were computed from the same
    samples files (a regenerated round is rescored), else {}."""
    manifest = store.load_manifest(STAGE, round)
    if manifest is None:
        return {}
    samples_of = lambda fingerprints: {k: v for k, v in fingerprints.items() if k.startswith("samples/")}  # noqa: E731
    own = [rel for rel in manifest.get("outputs", []) if rel.startswith("scores/") and part_name(rel) == STAGE]
    if samples_of(manifest.get("inputs", {})) != samples_of(inputs) or len(own) != 1:
        return {}
    return {"scores": store.read_part(own[0], "scores")}
