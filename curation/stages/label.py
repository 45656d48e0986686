"""The label stage: one groups row per kept sample, with its advantage.

    samples of the round, minus every row rejected by any stage, with scores.reward
        ▼ per group (run_id, round, prompt_id): mean, std, advantage
    groups/round=<n>/part-label.parquet

Advantage estimators: grpo, dr_grpo, rloo, batch, and any registered with
`curation.stages.advantages.register_advantage` (the formulas are there); `estimator` names one.

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

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from curation import schema
from curation.schema import KEYS
from curation.stages.advantages import GroupedRewards, get_advantage
from curation.stages.common import group_ids, group_moments, rows_of, unrejected
from curation.stages.runner import StageOutput

STAGE = "label"
READS = ("samples", "scores", "rejects")
WRITES = ("groups",)


class LabelConfig(BaseModel):
    """How advantages are computed."""

    model_config = ConfigDict(extra="forbid")

    estimator: str = Field(
        "grpo", description="Advantage estimator: grpo, dr_grpo, rloo, batch, or another name registered with "
                            "curation.stages.advantages.register_advantage (formulas there).")
    eps: float = Field(
        1e-4, ge=0, description="Added to the std before dividing (grpo, batch); TRL's default.")

    @field_validator("estimator")
    @classmethod
    def _registered(cls, name: str) -> str:
        get_advantage(name)  # a one-line error naming the registered estimators
        return name


CONFIG = LabelConfig


def sliceable(cfg: LabelConfig) -> bool:
    """An estimator registered with whole_round (batch: a std over every kept group of the
    round) needs the round at once."""
    return not get_advantage(cfg.estimator).whole_round


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
    unscored = rows.column("reward").null_count
    if unscored:
        raise ValueError(f"{unscored} sample(s) have no reward and no rejects row; "
                         f"run the filter stage first (it rejects them as unscored)")
    row = rows.column("row").to_numpy()
    kept = samples.select(list(KEYS)) if len(row) == samples.num_rows else rows_of(samples.select(list(KEYS)), row)
    return kept.append_column("reward", rows.column("reward")), rows.column("gid").to_numpy()


def label(table: pa.Table, cfg: LabelConfig, gid: np.ndarray | None = None) -> pa.Table:
    """The groups table: keys, reward, advantage, group_mean, group_std, group_kept; one row
    per input row, in input order. Input: keys + reward (non-null) of the kept samples, and
    optionally a group id per row (equal for rows of one run_id, round, prompt_id; default:
    common.group_ids).

    numpy over per-group statistics (common.group_moments: the same bits as Polars' window
    functions, without a query's fixed ~0.4 ms), then the registered estimator `cfg.estimator`.
    """
    if table.column("reward").null_count:
        raise ValueError(f"label needs a reward for every row; {table.column('reward').null_count} are null")
    reward = table.column("reward").cast(pa.float64()).to_numpy()
    gid = group_ids(table).to_numpy() if gid is None else np.asarray(gid, dtype=np.int64)
    if len(gid) and gid.max() >= len(gid):  # packed codes (common.group_ids' general case): make them dense
        gid = np.unique(gid, return_inverse=True)[1]
    n_groups = int(gid.max()) + 1 if len(gid) else 0
    stats = group_moments(gid, reward, n_groups)
    kept = (stats.hi > stats.lo)[gid]  # max > min: exact, free of rounding (NaN for no rows: False)
    estimator = get_advantage(cfg.estimator)
    with np.errstate(divide="ignore", invalid="ignore"):
        std = np.sqrt(stats.var)[gid]
        rows = GroupedRewards(reward=reward, mean=stats.mean[gid], std=std, size=stats.count[gid].astype(np.float64),
                              kept=kept, batch=group_ids(table, by=("run_id", "round")).to_numpy()
                              if estimator.whole_round else None)
        advantage = estimator(rows, cfg.eps)
    columns = table.select([*KEYS, "reward"]).columns
    columns += [pa.array(np.where(kept, advantage, 0.0)), pa.array(rows.mean), pa.array(np.where(kept, std, 0.0)),
                pa.array(kept)]
    return schema.validate(schema.as_contract(columns, "groups"), "groups")

