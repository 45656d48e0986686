"""The label stage: one groups row per kept sample, with its advantage.

    samples of the round, minus every row rejected by any stage, with scores.reward
        ▼ per group (run_id, round, prompt_id): mean, std, advantage
    groups/round=<n>/part-label.parquet

Advantage estimators (r: a sample's reward; mean, std: over its group's kept samples; G:
their number):

    grpo     (r - mean) / (std + eps)            DeepSeekMath (Shao et al. 2024)
    dr_grpo  r - mean                            Dr. GRPO (Liu et al. 2025): no std division
    rloo     r - mean of the other G-1 samples   RLOO (Ahmadian et al. 2024); = G/(G-1) (r - mean)
    batch    c / (std_batch(c) + eps), c = r - mean
             REINFORCE++-baseline (Hu et al. 2025): centred within the group, then scaled by
             the std of c over every row of a kept group of the same (run_id, round)

Conventions. std is the sample std (ddof=1, Bessel-corrected), as TRL computes it
(torch.std); eps = 1e-4, TRL's value. group_std is that std of the group's rewards and
group_kept is True when it is > 0: the rewards are not all equal, so the group carries a
learning signal. group_kept is computed as max > min (exact, free of rounding); a group
with group_kept False has group_std 0 and advantage 0 under every estimator (a group of one
sample too). batch leaves those groups out of std_batch, so its advantages do not depend on
whether the filter stage dropped zero-variance groups.

Every sample of the round ends in exactly one of groups (here) or rejects (earlier stages).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from curation import schema
from curation.schema import KEYS
from curation.stages.common import group_ids, rows_of, unrejected
from curation.stages.runner import StageOutput

STAGE = "label"
READS = ("samples", "scores", "rejects")
WRITES = ("groups",)


class LabelConfig(BaseModel):
    """How advantages are computed."""

    model_config = ConfigDict(extra="forbid")

    estimator: Literal["grpo", "dr_grpo", "rloo", "batch"] = Field(
        "grpo", description="Advantage estimator: grpo, dr_grpo, rloo or batch (see the module docstring).")
    eps: float = Field(
        1e-4, ge=0, description="Added to the std before dividing (grpo, batch); TRL's default.")


CONFIG = LabelConfig


def sliceable(cfg: LabelConfig) -> bool:
    """batch scales by a std over every kept group of the round, so it needs them all at once."""
    return cfg.estimator != "batch"


def columns(cfg: LabelConfig) -> dict[str, list[str]]:
    return {"samples": list(KEYS), "scores": [*KEYS, "reward"], "rejects": list(KEYS)}


def transform(tables: dict[str, pa.Table], cfg: LabelConfig) -> StageOutput:
    """The groups table of the samples that no stage rejected. rows_in = rows_out = those
    samples (label drops nothing); the manifest adds rows_in_kept_groups (group_kept rows)."""
    kept, gid = kept_with_rewards(tables["samples"], tables["scores"], tables["rejects"])
    groups = label(kept, cfg, gid)
    in_kept_groups = int(groups.column("group_kept").to_numpy(zero_copy_only=False).sum())
    return StageOutput({"groups": groups}, rows_in=kept.num_rows, rows_out=groups.num_rows,
                       extra={"rows_in_kept_groups": in_kept_groups})


def kept_with_rewards(samples: pa.Table, scores: pa.Table, rejects: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """(keys and reward of every sample that no rejects row names, in samples order; the
    group id of each of its rows, see common.SampleIndex).

    Raises ValueError when such a sample has no reward: the filter stage rejects those as
    unscored, so this means it has not run on these tables.
    """
    rows = unrejected(samples, scores, rejects)
    unscored = rows.get_column("reward").null_count()
    if unscored:
        raise ValueError(f"{unscored} sample(s) have no reward and no rejects row; "
                         f"run the filter stage first (it rejects them as unscored)")
    kept = rows_of(samples.select(list(KEYS)), rows.get_column("row"))
    return kept.append_column("reward", rows.get_column("reward").to_arrow()), rows.get_column("gid").to_numpy()


def label(table: pa.Table, cfg: LabelConfig, gid: np.ndarray | None = None) -> pa.Table:
    """The groups table: keys, reward, advantage, group_mean, group_std, group_kept; one row
    per input row, in input order. Input: keys + reward (non-null) of the kept samples, and
    optionally a group id per row (equal for rows of one run_id, round, prompt_id; default:
    common.group_ids)."""
    if table.column("reward").null_count:
        raise ValueError(f"label needs a reward for every row; {table.column('reward').null_count} are null")
    reward = pl.Series("reward", table.column("reward"), dtype=pl.Float64)
    gid = group_ids(table).to_numpy() if gid is None else gid
    rows = pl.DataFrame([pl.Series("gid", gid), reward]).lazy()
    if cfg.estimator == "batch":
        rows = rows.with_columns(group_ids(table, by=("run_id", "round")).alias("batch"))

    r, g = pl.col("reward"), "gid"
    rows = rows.with_columns(
        n_kept=pl.len().over(g),
        group_mean=r.mean().over(g),
        group_std=r.std(ddof=1).over(g),
        group_kept=r.max().over(g) > r.min().over(g),
    )
    kept, n, centred = pl.col("group_kept"), pl.col("n_kept"), r - pl.col("group_mean")
    advantage = {
        "grpo": centred / (pl.col("group_std") + cfg.eps),
        "dr_grpo": centred,
        "rloo": centred * n / (n - 1),
        "batch": centred / (pl.when(kept).then(centred).std(ddof=1).over("batch") + cfg.eps),
    }[cfg.estimator]
    out = rows.select(
        advantage=pl.when(kept).then(advantage).otherwise(0.0),
        group_mean="group_mean",
        group_std=pl.when(kept).then(pl.col("group_std")).otherwise(0.0),
        group_kept=kept,
    ).collect()
    groups = table.select([*KEYS, "reward"])
    for column in out.columns:
        groups = groups.append_column(column, out.get_column(column).to_arrow())
    return schema.validate(groups, "groups")
