"""The pair stage: preference pairs (chosen, rejected) inside each kept group.

    groups/round=<n> (rows with group_kept)
        ▼ candidate pairs by strategy, then r_chosen >= r_rejected + min_margin
    pairs/round=<n>/part-pair.parquet

Strategies, per group (best = highest reward, worst = lowest; among equal rewards the
lowest sample_idx comes first, so every choice is deterministic):

    max_min            best vs worst: one pair per group
    all_pairs          every (i, j) with r_i > r_j: up to G(G-1)/2 pairs
    max_random         best vs one of the n samples that can pair with it (numbered 0..n-1
                       by sample_idx): number int(md5("<seed>:<prompt_id>")[:15], 16) % n,
                       the first 15 hex digits of the md5 as an integer: a uniform draw
                       that depends on (seed, prompt_id) only, in any version of anything
    top_k_vs_bottom_k  each of the k best vs each of the k worst

Every pair has chosen_reward >= rejected_reward + min_margin and chosen_reward >
rejected_reward (ties never become pairs, whatever min_margin), so chosen != rejected.
margin = chosen_reward - rejected_reward; soft_label = P(chosen > rejected) =
sigmoid(margin / tau), or 1.0 with hard labels; weight = 1.0 ("uniform"), the margin
("margin"), or 1 / (pairs of the group) ("group": every group weighs the same).
Rows come group by group, in the order the groups first appear in the groups table, then by
chosen_idx, rejected_idx.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from curation.stages.common import group_ids
from curation.stages.runner import StageOutput
from store import schema
from store.layout import connect

STAGE = "pair"
READS = ("groups",)
WRITES = ("pairs",)


class PairConfig(BaseModel):
    """Which pairs to make from each group, and how to label and weigh them."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["max_min", "all_pairs", "max_random", "top_k_vs_bottom_k"] = Field(
        "max_min", description="How pairs are drawn from a group (see the module docstring).")
    k: int = Field(2, ge=1, description="top_k_vs_bottom_k: how many of the best and of the worst samples.")
    min_margin: float = Field(
        1e-6, ge=0, description="A pair needs chosen_reward >= rejected_reward + min_margin; ties never pair. "
                                "The default only ignores rounding noise.")
    hard: bool = Field(False, description="soft_label = 1.0 instead of sigmoid(margin / tau).")
    tau: float = Field(
        0.25, gt=0, description="Temperature of the soft label sigmoid(margin / tau); with rewards in [0, 1] a "
                                "margin of 1 gives 0.982, a margin of 0.1 gives 0.599.")
    weight: Literal["uniform", "margin", "group"] = Field(
        "uniform", description="Pair weight: 1.0, the margin, or 1 / (pairs of its group).")
    seed: int = Field(0, description="max_random: the draw is a function of (seed, prompt_id) only.")


CONFIG = PairConfig


def columns(cfg: PairConfig) -> dict[str, list[str]]:
    return {"groups": ["run_id", "round", "prompt_id", "sample_idx", "reward", "group_kept"]}


# Candidate pairs of each strategy, from `kept` (the rows of kept groups); the margin rule
# is applied to all of them afterwards. A group is one `gid` (run_id, round, prompt_id as one
# integer, see common.group_ids); `row` is a row's position in the groups table.
_CANDIDATES = {
    "max_min": """
        WITH extremes AS (SELECT gid, max(reward) AS chosen_reward, min(reward) AS rejected_reward
                          FROM kept GROUP BY gid)
        SELECT gid, any_value(row) AS row, chosen_reward, rejected_reward,
               min(sample_idx) FILTER (reward = chosen_reward) AS chosen_idx,  -- lowest sample_idx of a tie
               min(sample_idx) FILTER (reward = rejected_reward) AS rejected_idx
        FROM kept JOIN extremes USING (gid) GROUP BY gid, chosen_reward, rejected_reward""",
    "all_pairs": """
        SELECT gid, w.row, w.sample_idx AS chosen_idx, w.reward AS chosen_reward,
               l.sample_idx AS rejected_idx, l.reward AS rejected_reward
        FROM kept w JOIN kept l USING (gid)""",
    "max_random": """
        WITH top AS (SELECT gid, max(reward) AS chosen_reward FROM kept GROUP BY gid),
        best AS (  -- the draw uses md5, not hash(): the same in every DuckDB version
            SELECT gid, any_value(row) AS row, chosen_reward,
                   min(sample_idx) FILTER (reward = chosen_reward) AS chosen_idx,
                   ('0x' || md5(concat($seed, ':', any_value(prompt_id)))[1:15])::BIGINT AS draw
            FROM kept JOIN top USING (gid) GROUP BY gid, chosen_reward),
        lower AS (  -- the samples that can pair with the best, numbered 0.. by sample_idx
            SELECT b.*, l.sample_idx AS rejected_idx, l.reward AS rejected_reward,
                   row_number() OVER (PARTITION BY gid ORDER BY l.sample_idx) - 1 AS nth,
                   count(*) OVER (PARTITION BY gid) AS n_lower
            FROM best b JOIN kept l USING (gid)
            WHERE l.reward + $min_margin <= b.chosen_reward AND l.reward < b.chosen_reward)
        SELECT * EXCLUDE (draw, nth, n_lower) FROM lower WHERE nth = draw % n_lower""",
    "top_k_vs_bottom_k": """
        WITH ranked AS (
            SELECT *, row_number() OVER (PARTITION BY gid ORDER BY reward DESC, sample_idx) AS top,
                      row_number() OVER (PARTITION BY gid ORDER BY reward, sample_idx) AS bottom
            FROM kept)
        SELECT gid, w.row, w.sample_idx AS chosen_idx, w.reward AS chosen_reward,
               l.sample_idx AS rejected_idx, l.reward AS rejected_reward
        FROM ranked w JOIN ranked l USING (gid)
        WHERE w.top <= $k AND l.bottom <= $k""",
}

_WEIGHT = {
    "uniform": "1.0::DOUBLE",
    "margin": "chosen_reward - rejected_reward",
    "group": "1.0 / count(*) OVER (PARTITION BY gid)",
}


def transform(tables: dict[str, pa.Table], cfg: PairConfig) -> StageOutput:
    """The pairs table of the kept rows (group_kept) of tables["groups"], ordered by group (as
    they first appear in the groups table), chosen_idx, rejected_idx. rows_in: the kept rows."""
    groups = tables["groups"]
    sql = f"""
        WITH kept AS (SELECT gid, row, prompt_id, sample_idx, reward FROM groups WHERE group_kept),
        candidates AS ({_CANDIDATES[cfg.strategy]})
        SELECT row, chosen_idx, rejected_idx, chosen_reward, rejected_reward,
               chosen_reward - rejected_reward AS margin,
               CASE WHEN $hard THEN 1.0::DOUBLE
                    ELSE 1.0 / (1.0 + exp(-(chosen_reward - rejected_reward) / $tau)) END AS soft_label,
               {_WEIGHT[cfg.weight]} AS weight
        FROM candidates
        WHERE chosen_reward >= rejected_reward + $min_margin AND chosen_reward > rejected_reward
        ORDER BY gid, chosen_idx, rejected_idx"""
    params = {"min_margin": cfg.min_margin, "hard": cfg.hard, "tau": cfg.tau}
    if cfg.strategy == "max_random":
        params["seed"] = str(cfg.seed)
    if cfg.strategy == "top_k_vs_bottom_k":
        params["k"] = cfg.k
    table = pa.table({"gid": group_ids(groups).to_arrow(), "row": pa.array(np.arange(groups.num_rows)),
                      "prompt_id": groups.column("prompt_id"), "sample_idx": groups.column("sample_idx"),
                      "reward": groups.column("reward"), "group_kept": groups.column("group_kept")})
    con = connect()  # a private connection on the process database: ~1.5 ms, not ~17
    try:
        con.register("groups", table)
        pairs = con.sql(sql, params=params).to_arrow_table()
    finally:
        con.close()
    keys = groups.select(["run_id", "round", "prompt_id"]).take(pairs.column("row"))
    for column in pairs.column_names[1:]:
        keys = keys.append_column(column, pairs.column(column))
    rows_in = int(groups.column("group_kept").to_numpy(zero_copy_only=False).sum())
    return StageOutput({"pairs": schema.validate(keys, "pairs")}, rows_in=rows_in, rows_out=keys.num_rows)
