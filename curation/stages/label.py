"""The label stage: one groups row per kept sample, with its advantage.

    samples of the round, minus every row rejected by any stage, with scores.reward
        ▼ per group (run_id, round, prompt_id): mean, std, advantage
    groups/round=<n>/part-label.parquet

The advantage estimators (grpo, dr_grpo, rloo, batch, and any other registered with
`register_advantage`) live in training/advantages.py (light: no torch), re-exported by
training/objectives.py beside the losses that use what they compute; `[label] estimator`
names one and the stage calls it:

    get_advantage(estimator_name(cfg))(rows, eps)   # `label` below

grpo, dr_grpo and batch are one formula, A = (r - mean) / scale, with three scales: the
group's std + eps, none (1), the round's std of r - mean + eps. `[label] scale_rewards =
"group" | "none" | "batch"` (TRL's name for that choice, `SCALE_REWARDS`) selects among them
with the default estimator; the estimator names stay as shorthands, so `estimator = "dr_grpo"`
and `scale_rewards = "none"` are the same labels. TRL's "batch" divides by the std of the raw
rewards over the batch, which also counts the spread between prompts' mean rewards and the
groups of equal rewards; groupforge's is the std of the centred rewards over the kept groups
(REINFORCE++-baseline), so it does not depend on the mix of prompt difficulties or on the filter.

An estimator sees every row and may return anything for the rows of a group that is not
kept (rewards all equal, or a group of one): the label stage sets their advantage to 0. It
runs under numpy's errstate(divide="ignore", invalid="ignore") for the same reason. One
registered with `whole_round=True` needs every kept group of a round at once (batch): the
label stage then reads the round whole instead of slice by slice, and fills
GroupedRewards.batch.

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
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from curation.stages.common import group_ids, group_moments, rows_of, unrejected
from curation.stages.runner import StageOutput
from store import schema
from store.schema import KEYS
from training.advantages import GroupedRewards, get_advantage

STAGE = "label"
READS = ("samples", "scores", "rejects")
WRITES = ("groups",)


SCALE_REWARDS = {"group": "grpo", "none": "dr_grpo", "batch": "batch"}
"""scale_rewards -> the estimator that divides r - mean by that scale."""


def estimator_name(cfg: "LabelConfig") -> str:
    """The estimator the label stage runs: cfg.estimator, or the one scale_rewards names."""
    return cfg.estimator if cfg.scale_rewards is None else SCALE_REWARDS[cfg.scale_rewards]


# -- the stage ---------------------------------------------------------------------------------


class LabelConfig(BaseModel):
    """How advantages are computed."""

    model_config = ConfigDict(extra="forbid")

    estimator: str = Field(
        "grpo", description="Advantage estimator: grpo, dr_grpo, rloo, batch, or another name registered with "
                            "register_advantage (training/advantages.py).")
    eps: float = Field(
        1e-4, ge=0, description="Added to the std before dividing (grpo, batch); TRL's default.")
    # Left out of the dump while unset, so that a config without it keeps its hash (manifests).
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None, exclude_if=lambda value: value is None,
        description="TRL's name for what divides r - mean: group (the group's std: estimator grpo), none (Dr. "
                    "GRPO: dr_grpo), batch (the std of r - mean over the round's kept groups: batch). Unset: the "
                    "estimator's own. With estimator grpo it selects; with dr_grpo or batch it must agree.")

    @field_validator("estimator")
    @classmethod
    def _registered(cls, name: str) -> str:
        get_advantage(name)  # a one-line error naming the registered estimators
        return name

    @model_validator(mode="after")
    def _scale_agrees(self) -> "LabelConfig":
        scale = self.scale_rewards
        if scale is None or self.estimator in ("grpo", SCALE_REWARDS[scale]):
            return self
        if self.estimator in SCALE_REWARDS.values():
            own = next(name for name, est in SCALE_REWARDS.items() if est == self.estimator)
            raise ValueError(f"estimator {self.estimator!r} is grpo with scale_rewards = {own!r}, not {scale!r}: "
                             f"set estimator = 'grpo' and scale_rewards = {scale!r}")
        raise ValueError(f"scale_rewards applies to the grpo estimator (r - mean over a scale), not "
                         f"{self.estimator!r}: leave it unset")


CONFIG = LabelConfig


def sliceable(cfg: LabelConfig) -> bool:
    """An estimator registered with whole_round (batch: a std over every kept group of the
    round) needs the round at once."""
    return not get_advantage(estimator_name(cfg)).whole_round


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
    functions, without a query's fixed ~0.4 ms), then the registered estimator `estimator_name(cfg)`.
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
    estimator = get_advantage(estimator_name(cfg))
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

