"""bench/curation.py's pandas baselines: the curation a data engineer writes without
groupforge, in the idiomatic vectorised style and in the groupby(...).apply loop style.
bench/curation.py times them against the stages and checks that all three agree."""

from __future__ import annotations

import contextlib

import numpy as np

GROUP = ["run_id", "round", "prompt_id"]
KEYS = [*GROUP, "sample_idx"]


def pandas_curate(s, p, drop_duplicates: bool, style: str, timed=None) -> dict:
    """score (exact_match) -> filter (duplicate, group_too_small, zero_variance) -> label (grpo)
    -> pair (max_min, soft labels) in pandas, as a data engineer writes it without groupforge:

        vectorised  merge, ==, groupby transforms, idxmax/idxmin: the idiomatic way
        apply       the loop style most pandas code has: groupby(...).apply(one Python
                    function per group) for filter, label and pair (score as vectorised)

    Returns {scores, rejects, groups, pairs} DataFrames with groupforge's column names."""
    import pandas as pd

    timed = timed or (lambda name, rows: contextlib.nullcontext({}))
    n = len(s)
    with timed("score", n):
        s = s.merge(p, on="prompt_id", how="left")
        s["reward"] = (s["response"].str.strip() == s["reference"].str.strip()).astype("float64")
    by = s.groupby(GROUP, sort=False, group_keys=False)
    with timed("filter", n):
        if style == "vectorised":
            reason = pd.Series(None, index=s.index, dtype="object")
            if drop_duplicates:
                reason[s.duplicated([*GROUP, "response"])] = "duplicate"
            alive = s[reason.isna()]
            rewards = alive.groupby(GROUP, sort=False)["reward"]
            size, lo, hi = rewards.transform("size"), rewards.transform("min"), rewards.transform("max")
            reason[alive.index[size < 2]] = "group_too_small"
            reason[alive.index[(size >= 2) & (lo == hi)]] = "zero_variance"
        else:
            def reasons_of(group):  # one group's rows -> a reason (or None) per row
                reason = pd.Series(None, index=group.index, dtype="object")
                if drop_duplicates:
                    reason[group["response"].duplicated()] = "duplicate"
                alive = group.loc[reason.isna(), "reward"]
                if len(alive) < 2:
                    reason[alive.index] = "group_too_small"
                elif alive.min() == alive.max():
                    reason[alive.index] = "zero_variance"
                return reason

            reason = by[["response", "reward"]].apply(reasons_of).reindex(s.index)
        rejects = s.loc[reason.notna(), KEYS].assign(stage="filter", reason=reason[reason.notna()])
        kept = s.loc[reason.isna(), [*KEYS, "reward"]]
    with timed("label", n):
        if style == "vectorised":
            rewards = kept.groupby(GROUP, sort=False)["reward"]
            kept["group_mean"], kept["group_std"] = rewards.transform("mean"), rewards.transform("std")
            kept["group_kept"] = rewards.transform("max") > rewards.transform("min")
            advantage = (kept["reward"] - kept["group_mean"]) / (kept["group_std"] + 1e-4)
            kept["advantage"] = advantage.where(kept["group_kept"], 0.0)
            kept["group_std"] = kept["group_std"].where(kept["group_kept"], 0.0)
        else:
            def label_of(group):  # one group's rows -> its stats and each row's advantage
                reward = group["reward"]
                mean, std, varied = reward.mean(), reward.std(), reward.max() > reward.min()
                return pd.DataFrame({"group_mean": mean, "group_std": std if varied else 0.0, "group_kept": varied,
                                     "advantage": (reward - mean) / (std + 1e-4) if varied else 0.0},
                                    index=group.index)

            kept = kept.join(kept.groupby(GROUP, sort=False, group_keys=False)[["reward"]].apply(label_of))
    with timed("pair", len(kept)):
        if style == "vectorised":
            rewards = kept[kept["group_kept"]].groupby(GROUP, sort=False)["reward"]
            best = kept.loc[rewards.idxmax()].reset_index(drop=True)
            worst = kept.loc[rewards.idxmin()].reset_index(drop=True)
            pairs = best[GROUP].assign(chosen_idx=best["sample_idx"], rejected_idx=worst["sample_idx"],
                                       chosen_reward=best["reward"], rejected_reward=worst["reward"])
            pairs["margin"] = pairs["chosen_reward"] - pairs["rejected_reward"]
            pairs = pairs[pairs["margin"] >= 1e-6]
            pairs["soft_label"], pairs["weight"] = 1 / (1 + np.exp(-pairs["margin"] / 0.25)), 1.0
        else:
            def pair_of(group):  # one group's rows -> its (best, worst) pair, or nothing
                best, worst = group.loc[group["reward"].idxmax()], group.loc[group["reward"].idxmin()]
                margin = best["reward"] - worst["reward"]
                if margin < 1e-6:
                    return None
                return pd.Series({"chosen_idx": best["sample_idx"], "rejected_idx": worst["sample_idx"],
                                  "chosen_reward": best["reward"], "rejected_reward": worst["reward"], "margin": margin,
                                  "soft_label": 1 / (1 + np.exp(-margin / 0.25)), "weight": 1.0})

            pairs = kept[kept["group_kept"]].groupby(GROUP, sort=False)[["sample_idx", "reward"]].apply(pair_of)
            pairs = pairs.reset_index().astype({"chosen_idx": "int32", "rejected_idx": "int32"})
    scores = s[[*KEYS, "reward"]]
    return {"scores": scores, "rejects": rejects, "groups": kept, "pairs": pairs}
