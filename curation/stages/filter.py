"""The filter stage: reject the samples and groups that would teach the policy nothing.

    samples of the round, minus rows an earlier stage rejected, with scores.reward
        │ sample level, first matching reason wins (each check only if enabled):
        │   unscored -> truncated -> too_long -> too_short -> duplicate
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
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from curation import schema
from curation.schema import KEYS
from curation.stages.common import nullable_indices, rows_of, unrejected
from curation.stages.runner import StageOutput

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
        lo, hi = self.pass_rate_min, self.pass_rate_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"pass_rate_min ({lo}) >= pass_rate_max ({hi}) rejects every group")
        return self


CONFIG = FilterConfig


def columns(cfg: FilterConfig) -> dict[str, list[str]]:
    """The keys, and of the samples only the columns the enabled filters look at."""
    bounds = cfg.max_response_tokens is not None or cfg.min_response_tokens is not None
    return {"samples": [*KEYS, *(["finish_reason"] if cfg.drop_truncated else []),
                        *(["response_token_ids"] if bounds else []), *(["response"] if cfg.drop_duplicates else [])],
            "scores": [*KEYS, "reward"], "rejects": [*KEYS, "stage"]}


# ---- the transform ---------------------------------------------------------------------------


def _first_reason(checks: list[tuple[str, pl.Expr]]) -> pl.Expr:
    """The reason of the first check that holds, else null."""
    reason = pl.lit(None, dtype=pl.String)
    for name, condition in reversed(checks):
        reason = pl.when(condition).then(pl.lit(name)).otherwise(reason)
    return reason


def transform(tables: dict[str, pa.Table], cfg: FilterConfig) -> StageOutput:
    """The rejects (stage "filter") of every sample that an earlier stage did not reject and
    that a filter drops; one row and one reason per dropped sample, in samples order.

    tables["samples"] needs the keys and the columns the enabled filters look at (see
    `columns`); tables["rejects"]: the rejects so far (rows of stage "filter" are ignored:
    they are this stage's own). rows_in: the samples no earlier stage rejected."""
    samples, scores, rejects_so_far = tables["samples"], tables["scores"], tables["rejects"]
    rejects_so_far = rejects_so_far.filter(pc.not_equal(rejects_so_far.column("stage"), STAGE))
    view = samples.select(list(KEYS))
    if cfg.drop_truncated:
        view = view.append_column("truncated", pc.equal(samples.column("finish_reason"), "length"))
    if cfg.max_response_tokens is not None or cfg.min_response_tokens is not None:
        view = view.append_column("n_tokens", pc.list_value_length(samples.column("response_token_ids")))
    if cfg.drop_duplicates:  # a text as an integer code: grouping by integers is faster than by strings
        texts = pc.dictionary_encode(samples.column("response")).combine_chunks()
        view = view.append_column("response", texts.indices)
    rows = unrejected(view, scores, rejects_so_far, tuple(view.column_names[len(KEYS):]))
    rows_in = rows.height
    rows = rows.lazy()

    # Sample level.
    reward, n_tokens = pl.col("reward"), pl.col("n_tokens")
    checks = [("unscored", reward.is_null())]
    if cfg.drop_truncated:
        checks.append(("truncated", pl.col("truncated")))
    if cfg.max_response_tokens is not None:
        checks.append(("too_long", n_tokens > cfg.max_response_tokens))
    if cfg.min_response_tokens is not None:
        checks.append(("too_short", n_tokens < cfg.min_response_tokens))
    rows = rows.with_columns(reason=_first_reason(checks), first_idx=pl.lit(None, dtype=pl.Int32))
    if cfg.drop_duplicates:  # among the survivors so far; the lowest sample_idx of a text stays
        alive = pl.col("reason").is_null()
        same_text = pl.col("gid") * len(texts.dictionary) + pl.col("response")  # one int64 key: (gid, response)
        rows = rows.with_columns(first_idx=pl.when(alive).then(pl.col("sample_idx")).min().over(same_text))
        rows = rows.with_columns(reason=pl.when(alive & (pl.col("sample_idx") > pl.col("first_idx")))
                                 .then(pl.lit("duplicate")).otherwise(pl.col("reason")))

    # Group level, on the survivors of the sample-level checks (a null reward is not counted).
    rows = rows.with_columns(kept_reward=pl.when(pl.col("reason").is_null()).then(reward))
    kept_reward = pl.col("kept_reward")
    pass_rate = cfg.pass_rate_min is not None or cfg.pass_rate_max is not None
    rows = rows.with_columns(
        n_left=kept_reward.count().over("gid"),
        lo=kept_reward.min().over("gid"),
        hi=kept_reward.max().over("gid"),
        mean=kept_reward.mean().over("gid") if pass_rate else pl.lit(None, dtype=pl.Float64),
    )
    group_checks = [("group_too_small", pl.col("n_left") < cfg.min_group_size)]
    if cfg.drop_zero_variance:
        group_checks.append(("zero_variance", pl.col("lo") == pl.col("hi")))
    if cfg.pass_rate_min is not None:
        group_checks.append(("pass_rate", pl.col("mean") <= cfg.pass_rate_min))
    if cfg.pass_rate_max is not None:
        group_checks.append(("pass_rate", pl.col("mean") >= cfg.pass_rate_max))
    rows = rows.with_columns(reason=pl.coalesce("reason", pl.when(kept_reward.is_not_null())
                                                .then(_first_reason(group_checks))))

    n_tokens_shown = ["n_tokens"] if "n_tokens" in view.column_names else []  # what DETAILS show
    dropped = rows.filter(pl.col("reason").is_not_null()).select(
        "row", "reason", "first_idx", "n_left", "lo", "mean", *n_tokens_shown).collect()
    keys = rows_of(samples.select(list(KEYS)), dropped.get_column("row"))
    out = keys.append_column("stage", pa.repeat(STAGE, len(dropped)))
    out = out.append_column("reason", dropped.get_column("reason").to_arrow())
    out = out.append_column("detail", _details(dropped))
    return StageOutput({"rejects": schema.validate(out, "rejects")}, rows_in=rows_in, rows_out=rows_in - len(dropped))


# reason -> (the detail's template, the column it shows); other reasons have no detail
DETAILS = {"too_long": ("{} response tokens", "n_tokens"), "too_short": ("{} response tokens", "n_tokens"),
           "duplicate": ("same response as sample_idx {}", "first_idx"),
           "group_too_small": ("{} sample(s) left", "n_left"), "zero_variance": ("every reward is {}", "lo"),
           "pass_rate": ("group mean reward {}", "mean")}


def _details(dropped: pl.DataFrame) -> pa.Array:
    """The detail of each dropped row (DETAILS), each distinct value formatted once: a few
    distinct numbers fill millions of rows, and pl.format costs ~50 ns a row."""
    reason = dropped.get_column("reason")
    codes = np.full(dropped.height, -1, dtype=np.int64)  # into `texts`; -1: no detail
    texts: list[pl.Series] = []
    n_texts = 0
    for name, (template, column) in DETAILS.items():
        where = (reason == name).arg_true().to_numpy()
        if not len(where):
            continue
        values = dropped.get_column(column).gather(where)
        if values.null_count():  # not expected; format each row
            codes[where] = n_texts + np.arange(len(where))
            distinct = values
        else:  # equal bit patterns are equal values, so -0.0 and 0.0 stay apart
            numbers = values.to_numpy()
            encoded = pc.dictionary_encode(pa.array(numbers.view(f"i{numbers.itemsize}")))
            codes[where] = n_texts + encoded.indices.to_numpy(zero_copy_only=False)
            distinct = encoded.dictionary.to_numpy(zero_copy_only=False).view(numbers.dtype)
            distinct = pl.Series(distinct, dtype=values.dtype)
        texts.append(pl.select(pl.format(template, pl.lit(distinct))).to_series())
        n_texts += len(distinct)
    dictionary = pl.concat(texts).to_arrow().cast(pa.string()) if texts else pa.array([], pa.string())
    return pa.DictionaryArray.from_arrays(nullable_indices(codes), dictionary).cast(pa.string())
