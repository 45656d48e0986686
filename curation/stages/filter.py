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

import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from curation import schema
from curation.schema import KEYS
from curation.stages.common import StageReport, as_dict, drop_counts, input_fingerprints, read_samples
from curation.store import RunStore

STAGE = "filter"
GROUP = ("run_id", "round", "prompt_id")


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
        None, ge=0, description="Drop responses with fewer response tokens than this (reason too_short); None: no bound.")
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


# ---- shared with label and pair (candidates for stages/common.py) ---------------------


def group_ids(table: pa.Table, by: tuple[str, ...] = GROUP) -> pl.Series:
    """One int64 `gid` per row, equal for rows with equal `by` columns (a group: run_id,
    round, prompt_id). Grouping by one integer is ~3x faster than by three key columns, and
    the key strings never enter Polars.

    Fast path: each group is one run of adjacent rows, as the generate stage writes samples
    (gid = number of the run). Otherwise: the columns' dictionary codes packed into one number.
    """
    n = table.num_rows
    starts_run = np.ones(n, dtype=bool)
    if n > 1:
        starts_run[1:] = False
        for column in by:
            values = table.column(column)
            starts_run[1:] |= pc.not_equal(values.slice(1), values.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    at_starts = pl.Series(table.column(by[-1]).take(np.flatnonzero(starts_run)))
    if at_starts.n_unique() == len(at_starts):  # no two runs share a key: each group is one run
        return pl.Series("gid", np.cumsum(starts_run, dtype=np.int64) - 1)
    ids = np.zeros(n, dtype=np.int64)
    for column in by:
        encoded = pc.dictionary_encode(table.column(column)).combine_chunks()  # one dictionary
        ids = ids * len(encoded.dictionary) + encoded.indices.to_numpy(zero_copy_only=False)
    return pl.Series("gid", ids)


def lookup_group_ids(table: pa.Table, gid: pl.Series, other: pa.Table) -> pl.Series:
    """The gid (see group_ids) that `table`'s rows have for each row of `other`; null where
    `table` has no such group."""
    if gid.is_sorted():  # the fast path of group_ids: a group's first row is where gid steps up
        first_rows = pl.Series("row", np.flatnonzero(np.diff(gid.to_numpy(), prepend=-1)))
    else:
        first_rows = pl.DataFrame(gid).with_row_index("row").group_by("gid").agg(pl.col("row").min())["row"].sort()
    index = pl.from_arrow(rows_of(table.select(list(GROUP)), first_rows)).with_columns(gid.gather(first_rows))
    keys = pl.from_arrow(other.select(list(GROUP)))
    return keys.join(index, on=list(GROUP), how="left", maintain_order="left").get_column("gid")


def rows_of(table: pa.Table, rows: pl.Series) -> pa.Table:
    """The rows at the ascending positions `rows` (a boolean filter: much faster than take)."""
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[rows.to_numpy()] = True
    return table.filter(mask)


def _same_keys(a: pa.Table, b: pa.Table) -> bool:
    return a.num_rows == b.num_rows and all(pc.all(pc.equal(a.column(k), b.column(k))).as_py() for k in KEYS)


def unrejected(samples: pa.Table, scores: pa.Table, rejects: pa.Table, columns: tuple[str, ...] = ()) -> pl.DataFrame:
    """The samples that no rejects row names, in samples order: `row` (position in samples),
    `gid` (see group_ids), sample_idx, reward (null when unscored) and `columns` of samples.

    A rejects row names one sample, or every sample of its prompt when its sample_idx is null.
    """
    gid = group_ids(samples)
    rows = pl.from_arrow(samples.select(["sample_idx", *columns])).with_columns(
        pl.int_range(samples.num_rows, dtype=pl.Int64).alias("row"), gid)
    if _same_keys(samples, scores):  # as the score stage writes them: no join needed
        rows = rows.with_columns(pl.Series("reward", scores.column("reward"), dtype=pl.Float64))
    else:
        rewards = pl.DataFrame([lookup_group_ids(samples, gid, scores),
                                pl.Series("sample_idx", scores.column("sample_idx")),
                                pl.Series("reward", scores.column("reward"), dtype=pl.Float64)])
        rewards = rewards.filter(pl.col("gid").is_not_null())
        try:
            rows = rows.join(rewards, on=["gid", "sample_idx"], how="left", validate="m:1", maintain_order="left")
        except pl.exceptions.ComputeError:  # m:1 failed
            raise ValueError("scores table: a (run_id, round, prompt_id, sample_idx) appears more than once; "
                             "a sample has one reward") from None
    if rejects.num_rows:
        named = pl.DataFrame([lookup_group_ids(samples, gid, rejects),
                              pl.Series("sample_idx", rejects.column("sample_idx"))]).filter(pl.col("gid").is_not_null())
        whole_prompts = named.filter(pl.col("sample_idx").is_null()).get_column("gid")
        rows = rows.filter(~pl.col("gid").is_in(whole_prompts.implode()))
        by_sample = named.filter(pl.col("sample_idx").is_not_null()).unique()
        rows = rows.join(by_sample, on=["gid", "sample_idx"], how="anti", maintain_order="left")
    return rows


# ---- the pure function ---------------------------------------------------------------------


def _first_reason(checks: list[tuple[str, pl.Expr]]) -> pl.Expr:
    """The reason of the first check that holds, else null."""
    reason = pl.lit(None, dtype=pl.String)
    for name, condition in reversed(checks):
        reason = pl.when(condition).then(pl.lit(name)).otherwise(reason)
    return reason


def filter_samples(samples: pa.Table, scores: pa.Table, rejects_so_far: pa.Table, cfg: FilterConfig) -> pa.Table:
    """The rejects (stage "filter") of every sample that an earlier stage did not reject and
    that a filter drops; one row and one reason per dropped sample, in samples order."""
    view = samples.select(list(KEYS)).append_column(
        "truncated", pc.equal(samples.column("finish_reason"), "length")).append_column(
        "n_tokens", pc.list_value_length(samples.column("response_token_ids")))
    if cfg.drop_duplicates:
        view = view.append_column("response", samples.column("response"))
    columns = ("truncated", "n_tokens", *(["response"] if cfg.drop_duplicates else []))
    rows = unrejected(view, scores, rejects_so_far, columns).lazy()

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
        rows = rows.with_columns(first_idx=pl.when(alive).then(pl.col("sample_idx")).min().over("gid", "response"))
        rows = rows.with_columns(reason=pl.when(alive & (pl.col("sample_idx") > pl.col("first_idx")))
                                 .then(pl.lit("duplicate")).otherwise(pl.col("reason")))

    # Group level, on the survivors of the sample-level checks (a null reward is not counted).
    rows = rows.with_columns(kept_reward=pl.when(pl.col("reason").is_null()).then(reward))
    kept_reward = pl.col("kept_reward")
    rows = rows.with_columns(
        n_left=kept_reward.count().over("gid"),
        lo=kept_reward.min().over("gid"),
        hi=kept_reward.max().over("gid"),
        mean=kept_reward.mean().over("gid"),
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

    reason = pl.col("reason")
    dropped = rows.filter(reason.is_not_null()).select(
        "row", "reason",
        detail=pl.when(reason.is_in(["too_long", "too_short"])).then(pl.format("{} response tokens", n_tokens))
        .when(reason == "duplicate").then(pl.format("same response as sample_idx {}", pl.col("first_idx")))
        .when(reason == "group_too_small").then(pl.format("{} sample(s) left", pl.col("n_left")))
        .when(reason == "zero_variance").then(pl.format("every reward is {}", pl.col("lo")))
        .when(reason == "pass_rate").then(pl.format("group mean reward {}", pl.col("mean"))),
    ).collect()
    keys = rows_of(samples.select(list(KEYS)), dropped.get_column("row"))
    out = keys.append_column("stage", pa.repeat(STAGE, len(dropped)))
    out = out.append_column("reason", dropped.get_column("reason").to_arrow())
    out = out.append_column("detail", dropped.get_column("detail").to_arrow())
    return schema.validate(out, "rejects")


# ---- the stage -----------------------------------------------------------------------------


def run(run_dir: str | Path, round: int, config: FilterConfig | None = None, force: bool = False) -> StageReport:
    """Filter one round: read samples, scores and the earlier stages' rejects, commit
    rejects/round=<n>/part-filter.parquet. Skipped when the manifest is up to date."""
    cfg = config or FilterConfig()
    store = RunStore(run_dir)
    inputs = input_fingerprints(store, ["samples", "scores", "rejects"], round, exclude_parts=(STAGE,))
    if not force and store.is_up_to_date(STAGE, round, inputs, as_dict(cfg)):
        manifest = store.load_manifest(STAGE, round) or {}
        return StageReport(STAGE, round, skipped=True, rows_in=manifest.get("rows_in") or 0,
                           rows_out=manifest.get("rows_out") or 0, drops=manifest.get("drops", {}))

    started = time.perf_counter()
    columns = [*KEYS, "finish_reason", "response_token_ids", *(["response"] if cfg.drop_duplicates else [])]
    samples = read_samples(store, round, columns)
    scores = store.read("scores", round)
    rejects_so_far = store.read("rejects", round)
    rejects_so_far = rejects_so_far.filter(pc.not_equal(rejects_so_far.column("stage"), STAGE))
    rejects = filter_samples(samples, scores, rejects_so_far, cfg)
    rows_in = samples.num_rows
    if rejects_so_far.num_rows:
        rows_in = unrejected(samples.select(list(KEYS)), scores, rejects_so_far).height
    drops = drop_counts(rejects)
    with store.commit(STAGE, round, inputs=inputs, config=as_dict(cfg)) as commit:
        commit.write("rejects", rejects, part=STAGE)
        commit.record(rows_in=rows_in, rows_out=rows_in - rejects.num_rows, drops=drops)
    return StageReport(STAGE, round, skipped=False, rows_in=rows_in, rows_out=rows_in - rejects.num_rows,
                       drops=drops, seconds=time.perf_counter() - started)
