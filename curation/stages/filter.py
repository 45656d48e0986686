"""The filter stage: reject the samples and groups that would teach the policy nothing.

    samples of the round, minus rows an earlier stage rejected, with scores.reward
        │ sample level, first matching reason wins (each check only if enabled):
        │   unscored -> truncated -> too_long -> too_short -> too_many_model_tokens
        │   -> too_few_model_tokens -> too_many_turns -> tool_errors -> duplicate
        ▼
    the survivors, per group (run_id, round, prompt_id), first matching reason wins:
        group_too_small -> zero_variance -> pass_rate
        ▼
    rejects/round=<n>/part-filter.parquet (stage "filter"): one row per dropped sample

Sample-level checks run first, so group-level ones see only what survives them: a group of
8 with 7 truncated responses has 1 sample left and is dropped as group_too_small. A group
check drops whole groups, so the three group checks do not interact; their order only
decides the reason a group gets when several apply (a group of one sample is also of zero
variance; it is reported as group_too_small). Duplicates are looked for among the samples
that pass the other sample checks, and the lowest sample_idx of each response text is kept.

A row with no reward (no scores row, or a null reward) that no earlier stage rejected is
rejected here as `unscored`: every row of the round ends in exactly one of groups or rejects.

Defaults (`groupforge curate` with no config): zero-variance groups dropped (all advantages
would be 0; DAPO's dynamic sampling), groups of one sample dropped (no baseline); truncated
responses kept (their low reward is the signal that teaches the policy to stop; DAPO's
overlong filtering is opt-in), duplicates dropped (distinct responses make distinct pairs;
for GRPO on short-answer tasks consider turning it off, since dropping repeats moves the
group mean away from what the policy samples), no length or pass-rate bounds.

Trajectories (multi-turn samples: the samples table's trajectory columns). max_response_tokens
and min_response_tokens count every response token, the tool/environment turns' too (what the
trajectory takes of the context); max_model_tokens and min_model_tokens count the model's
tokens only (response_mask 1: what training learns from). max_turns bounds the assistant turns
(num_turns), drop_tool_errors drops trajectories with a failed tool call (tool_errors > 0).
Duplicates compare the whole trajectory (messages_out), not only the last turn's text. A
single-turn sample is a one-turn trajectory without tool calls whose every response token is
the model's, so on a single-turn table the four options need no trajectory column: max_turns
(>= 1) and drop_tool_errors drop nothing, and the model-token bounds count its response tokens.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from curation.stages.common import group_moments, nullable_indices, rows_of, unrejected
from curation.stages.runner import StageOutput
from store import schema
from store.schema import KEYS

STAGE = "filter"
READS = ("samples", "scores", "rejects")  # rejects: the earlier stages' parts, not its own
WRITES = ("rejects",)


class FilterConfig(BaseModel):
    """Which filters run. Every dropped row lands in rejects with its reason."""

    model_config = ConfigDict(extra="forbid")

    drop_zero_variance: bool = Field(
        True, description="Drop groups whose remaining rewards are all equal (reason zero_variance).")
    drop_truncated: bool = Field(
        False, description="Drop responses cut at the token limit, finish_reason = 'length' (reason truncated).")
    max_response_tokens: int | None = Field(
        None, ge=0, description="Drop responses with more response tokens than this (reason too_long); None: no bound.")
    min_response_tokens: int | None = Field(
        None, ge=0,
        description="Drop responses with fewer response tokens than this (reason too_short); None: no bound.")
    max_model_tokens: int | None = Field(
        None, ge=0, description="Drop responses with more model tokens (response_mask 1; a single-turn response: "
        "all its tokens) than this (reason too_many_model_tokens); None: no bound.")
    min_model_tokens: int | None = Field(
        None, ge=0, description="Drop responses with fewer model tokens (response_mask 1; a single-turn response: "
        "all its tokens) than this (reason too_few_model_tokens); None: no bound.")
    max_turns: int | None = Field(
        None, ge=1, description="Drop trajectories with more assistant turns (num_turns) than this (reason "
        "too_many_turns; a single-turn sample has one); None: no bound.")
    drop_tool_errors: bool = Field(
        False, description="Drop trajectories with a failed tool call, tool_errors > 0 (reason tool_errors).")
    drop_duplicates: bool = Field(
        True, description="Drop responses whose exact text an earlier sample_idx of the group has (reason duplicate). "
        "On by default (distinct pairs and datasets); for GRPO on short-answer tasks consider turning it off: "
        "dropping repeats moves the group mean away from what the policy samples.")
    min_group_size: int = Field(
        2, ge=1, description="Drop groups with fewer remaining samples than this (reason group_too_small).")
    pass_rate_min: float | None = Field(
        None, description="Keep groups whose mean reward is > this, else reason pass_rate; None: no lower bound.")
    pass_rate_max: float | None = Field(
        None, description="Keep groups whose mean reward is < this, else reason pass_rate; None: no upper bound.")

    @model_validator(mode="after")
    def _bounds_in_order(self) -> FilterConfig:
        lo, hi = self.min_response_tokens, self.max_response_tokens
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_response_tokens ({lo}) > max_response_tokens ({hi}) rejects every response")
        lo, hi = self.min_model_tokens, self.max_model_tokens
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_model_tokens ({lo}) > max_model_tokens ({hi}) rejects every response")
        lo, hi = self.pass_rate_min, self.pass_rate_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"pass_rate_min ({lo}) >= pass_rate_max ({hi}) rejects every group")
        return self


CONFIG = FilterConfig


def columns(cfg: FilterConfig) -> dict[str, list[str]]:
    """The keys, and of the samples only the columns the enabled filters look at (a trajectory
    column: nulls where a part has none)."""
    bounds = cfg.max_response_tokens is not None or cfg.min_response_tokens is not None
    model = cfg.max_model_tokens is not None or cfg.min_model_tokens is not None
    return {"samples": [*KEYS, *(["finish_reason"] if cfg.drop_truncated else []),
                        *(["response_token_ids"] if bounds or model else []),
                        *(["response_mask"] if model else []),
                        *(["num_turns"] if cfg.max_turns is not None else []),
                        *(["tool_errors"] if cfg.drop_tool_errors else []),
                        *(["response", "messages_out"] if cfg.drop_duplicates else [])],
            "scores": [*KEYS, "reward"], "rejects": [*KEYS, "stage"]}


# ---- the transform ---------------------------------------------------------------------------
#
# numpy over Arrow columns, no query engine: a Polars query costs ~0.3-0.5 ms however few the
# rows, several times this stage's work at a round of 512 samples. A row's reason is a code
# into REASONS (0: kept), set only where no earlier check set one: the first matching reason wins.

REASONS = (None, "unscored", "truncated", "too_long", "too_short", "too_many_model_tokens", "too_few_model_tokens",
           "too_many_turns", "tool_errors", "duplicate", "group_too_small", "zero_variance", "pass_rate")
CODE = {reason: code for code, reason in enumerate(REASONS) if reason}


def transform(tables: dict[str, pa.Table], cfg: FilterConfig) -> StageOutput:
    """The rejects (stage "filter") of every sample that an earlier stage did not reject and
    that a filter drops; one row and one reason per dropped sample, in samples order.

    tables["samples"] needs the keys and the columns the enabled filters look at (see
    `columns`; a trajectory column may be absent or null: single-turn rows); tables["rejects"]:
    the rejects so far (rows of stage "filter" are ignored: they are this stage's own).
    rows_in: the samples no earlier stage rejected."""
    samples, scores, rejects_so_far = tables["samples"], tables["scores"], tables["rejects"]
    if rejects_so_far.num_rows:
        rejects_so_far = rejects_so_far.filter(pc.not_equal(rejects_so_far.column("stage"), STAGE))
    view = samples.select(list(KEYS))
    if cfg.drop_truncated:
        view = view.append_column("truncated", pc.equal(samples.column("finish_reason"), "length"))
    if cfg.max_response_tokens is not None or cfg.min_response_tokens is not None:
        view = view.append_column("n_tokens", pc.list_value_length(samples.column("response_token_ids")))
    if cfg.max_model_tokens is not None or cfg.min_model_tokens is not None:
        view = view.append_column("model_tokens", _model_tokens(samples))
    if cfg.max_turns is not None:
        view = view.append_column("turns", _trajectory_count(samples, "num_turns", 1))
    if cfg.drop_tool_errors:
        view = view.append_column("tool_errors", _trajectory_count(samples, "tool_errors", 0))
    if cfg.drop_duplicates:  # a text as an integer code: grouping by integers is faster than by strings
        texts = pc.dictionary_encode(_trajectory_text(samples)).combine_chunks()
        view = view.append_column("response", texts.indices)
    rows = unrejected(view, scores, rejects_so_far, tuple(view.column_names[len(KEYS):]))
    rows_in = rows.num_rows
    gid = rows.column("gid").to_numpy()
    sample_idx = rows.column("sample_idx").to_numpy()
    reward = rows.column("reward")
    unscored = reward.is_null().to_numpy(zero_copy_only=False)
    reward = pc.fill_null(reward, 0.0).to_numpy()
    reason = np.zeros(rows_in, dtype=np.int8)

    def drop(name: str, where: np.ndarray) -> None:
        reason[(reason == 0) & where] = CODE[name]

    # Sample level.
    drop("unscored", unscored)
    if cfg.drop_truncated:
        drop("truncated", rows.column("truncated").to_numpy())
    n_tokens = rows.column("n_tokens").to_numpy() if "n_tokens" in rows.column_names else None
    if cfg.max_response_tokens is not None:
        drop("too_long", n_tokens > cfg.max_response_tokens)
    if cfg.min_response_tokens is not None:
        drop("too_short", n_tokens < cfg.min_response_tokens)
    model_tokens = rows.column("model_tokens").to_numpy() if "model_tokens" in rows.column_names else None
    if cfg.max_model_tokens is not None:
        drop("too_many_model_tokens", model_tokens > cfg.max_model_tokens)
    if cfg.min_model_tokens is not None:
        drop("too_few_model_tokens", model_tokens < cfg.min_model_tokens)
    turns = rows.column("turns").to_numpy() if cfg.max_turns is not None else None
    if cfg.max_turns is not None:
        drop("too_many_turns", turns > cfg.max_turns)
    tool_errors = rows.column("tool_errors").to_numpy() if cfg.drop_tool_errors else None
    if cfg.drop_tool_errors:
        drop("tool_errors", tool_errors > 0)
    first_idx = None
    if cfg.drop_duplicates:  # among the survivors so far; the lowest sample_idx of a text stays
        alive = np.flatnonzero(reason == 0)
        same_text = gid[alive] * len(texts.dictionary) + rows.column("response").to_numpy()[alive]  # (gid, response)
        text = pc.dictionary_encode(pa.array(same_text)).indices.to_numpy(zero_copy_only=False)
        lowest = np.full(len(alive) and int(text.max()) + 1, np.iinfo(np.int32).max, dtype=sample_idx.dtype)
        np.minimum.at(lowest, text, sample_idx[alive])
        first_idx = np.zeros(rows_in, dtype=sample_idx.dtype)
        first_idx[alive] = lowest[text]
        duplicate = np.zeros(rows_in, dtype=bool)
        duplicate[alive] = sample_idx[alive] > first_idx[alive]
        drop("duplicate", duplicate)

    # Group level, on the survivors of the sample-level checks.
    kept = np.flatnonzero(reason == 0)
    stats = group_moments(gid[kept], reward[kept], int(gid.max()) + 1 if rows_in else 0, variance=False)
    left = np.zeros(rows_in, dtype=bool)
    left[kept] = True
    n_left, lo, hi, mean = stats.count[gid], stats.lo[gid], stats.hi[gid], stats.mean[gid]
    drop("group_too_small", left & (n_left < cfg.min_group_size))
    if cfg.drop_zero_variance:
        drop("zero_variance", left & (lo == hi))
    with np.errstate(invalid="ignore"):
        if cfg.pass_rate_min is not None:
            drop("pass_rate", left & (mean <= cfg.pass_rate_min))
        if cfg.pass_rate_max is not None:
            drop("pass_rate", left & (mean >= cfg.pass_rate_max))

    dropped = np.flatnonzero(reason)
    shown = {"n_tokens": n_tokens, "model_tokens": model_tokens, "turns": turns, "tool_errors": tool_errors,
             "first_idx": first_idx, "n_left": n_left, "lo": lo, "mean": mean}
    codes = reason[dropped]
    keys = rows_of(samples.select(list(KEYS)), rows.column("row").to_numpy()[dropped])
    out = schema.as_contract([*keys.columns, pa.repeat(STAGE, len(dropped)).cast(pa.string()),
                              _texts(codes, pa.array(REASONS[1:], pa.string()), 1),
                              _details(codes, {name: v[dropped] for name, v in shown.items() if v is not None})],
                             "rejects")
    return StageOutput({"rejects": schema.validate(out, "rejects")}, rows_in=rows_in, rows_out=rows_in - len(dropped))


# reason -> (the detail's template, the column it shows); other reasons have no detail
DETAILS = {"too_long": ("{} response tokens", "n_tokens"), "too_short": ("{} response tokens", "n_tokens"),
           "too_many_model_tokens": ("{} model tokens", "model_tokens"),
           "too_few_model_tokens": ("{} model tokens", "model_tokens"),
           "too_many_turns": ("{} assistant turns", "turns"), "tool_errors": ("{} tool errors", "tool_errors"),
           "duplicate": ("same response as sample_idx {}", "first_idx"),
           "group_too_small": ("{} sample(s) left", "n_left"), "zero_variance": ("every reward is {}", "lo"),
           "pass_rate": ("group mean reward {}", "mean")}


def _model_tokens(samples: pa.Table) -> pa.Array:
    """Each sample's model tokens: the 1s of its response_mask; every response token of a
    single-turn sample (no response_mask column, or a null one)."""
    n_tokens = pc.list_value_length(samples.column("response_token_ids")).to_numpy(zero_copy_only=False)
    if "response_mask" not in samples.column_names or samples.column("response_mask").null_count == len(samples):
        return pa.array(n_tokens.astype(np.int64))
    mask = samples.column("response_mask").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(mask), 0).to_numpy(zero_copy_only=False)
    ones = pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype(np.int64)
    row = np.repeat(np.arange(len(mask)), lengths)
    counted = np.bincount(row, weights=ones, minlength=len(mask)).astype(np.int64)
    return pa.array(np.where(mask.is_null().to_numpy(zero_copy_only=False), n_tokens, counted))


def _trajectory_count(samples: pa.Table, column: str, single_turn: int) -> pa.Array:
    """A trajectory count column (num_turns, tool_errors) as int64, `single_turn` where a sample
    has none (a single-turn sample: one turn, no tool errors)."""
    if column not in samples.column_names:
        return pa.array(np.full(samples.num_rows, single_turn, dtype=np.int64))
    return pc.fill_null(samples.column(column).cast(pa.int64()), single_turn).combine_chunks()


def _trajectory_text(samples: pa.Table) -> pa.ChunkedArray:
    """What duplicates compare: a trajectory's messages_out, a single-turn sample's response."""
    if "messages_out" not in samples.column_names or samples.column("messages_out").null_count == len(samples):
        return samples.column("response")
    return pc.coalesce(samples.column("messages_out"), samples.column("response"))


def _texts(codes: np.ndarray, dictionary: pa.Array, offset: int = 0) -> pa.Array:
    """dictionary[codes - offset] as a string array, null where codes < offset."""
    return pa.DictionaryArray.from_arrays(nullable_indices(codes.astype(np.int64) - offset),
                                          dictionary).cast(pa.string())


def _details(codes: np.ndarray, shown: dict[str, np.ndarray]) -> pa.Array:
    """The detail of each dropped row (DETAILS) from its reason code and the value it shows,
    each distinct value formatted once: a few distinct numbers fill millions of rows. Numbers
    are written as Polars writes them (pl.format in the first version of this stage): a
    Polars cast to string, of the distinct values only."""
    texts = np.full(len(codes), -1, dtype=np.int64)  # into `dictionary`; -1: no detail
    parts: list[pa.Array] = []
    n_texts = 0
    for name, (template, column) in DETAILS.items():
        where = np.flatnonzero(codes == CODE[name])
        if not len(where):
            continue
        numbers = shown[column][where]
        if numbers.dtype.kind == "f":  # equal bit patterns are equal values, so -0.0 and 0.0 stay apart
            bits = pc.dictionary_encode(pa.array(numbers.view(np.int64)))
            distinct = bits.dictionary.to_numpy(zero_copy_only=False).view(np.float64)
        else:
            bits = pc.dictionary_encode(pa.array(numbers))
            distinct = bits.dictionary.to_numpy(zero_copy_only=False)
        texts[where] = n_texts + bits.indices.to_numpy(zero_copy_only=False)
        before, after = template.split("{}")
        written = pl.Series(distinct).cast(pl.String).to_arrow().cast(pa.string())
        parts.append(pc.binary_join_element_wise(before, written, after, ""))
        n_texts += len(distinct)
    dictionary = pa.concat_arrays(parts) if parts else pa.array([], pa.string())
    return _texts(texts, dictionary)
