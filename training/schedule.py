"""Which rows an optimizer step trains on, and at which learning rate: functions of the
step number and the seed alone, so a resumed run takes exactly the steps an uninterrupted
one would (training.trainer).

    step_rows     consecutive slices of a stream of seeded permutations of the rows (with
                  share_prompts, of whole prompt groups: `group_units`)
    lr_at         linear warmup, then constant or cosine down to min_lr_ratio x lr
"""

from __future__ import annotations

import math

import numpy as np

from training.config import TrainConfig

__all__ = ["group_units", "lr_at", "step_rows"]


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup, then constant or cosine."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay = cfg.decay_steps or total_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rows(num_rows: int, batch_size: int, seed: int, segment_start: int, step: int,
              units: np.ndarray | None = None) -> np.ndarray:
    """Row indices of optimizer step `step`: consecutive slices of a stream of seeded
    permutations of the rows (epoch e uses permutation e), counted from `segment_start`,
    the step after which these rows were first trained on. Depends on nothing else, so a
    resumed run draws exactly the rows an uninterrupted one would. `units` (a unit id per
    row, 0..n_units-1; `group_units`): epoch e permutes the units instead, each unit's rows
    together in row order, so a step holds whole units (one may straddle two steps)."""
    size = min(batch_size, num_rows)
    first = (step - segment_start - 1) * size
    out = []
    for epoch in range(first // num_rows, (first + size - 1) // num_rows + 1):
        rng = np.random.default_rng([seed, segment_start, epoch])
        if units is None:
            perm = rng.permutation(num_rows)
        else:
            rank = np.empty(int(units.max()) + 1, dtype=np.int64)
            rank[rng.permutation(rank.size)] = np.arange(rank.size)
            perm = np.lexsort((np.arange(num_rows), rank[units]))
        lo, hi = max(first - epoch * num_rows, 0), min(first + size - epoch * num_rows, num_rows)
        out.append(perm[lo:hi])
    return np.concatenate(out)


def group_units(groups: np.ndarray, per_group: int | None = None) -> np.ndarray:
    """step_rows' units: a group id per row, or with `per_group` a unit per run of that many
    rows of a group (its 1st..per_group-th rows in row order, the next ones, ...)."""
    if per_group is None:
        return groups
    order = np.lexsort((np.arange(groups.size), groups))
    starts = np.flatnonzero(np.r_[True, groups[order][1:] != groups[order][:-1]])
    position = np.empty(groups.size, dtype=np.int64)
    position[order] = np.arange(groups.size) - np.repeat(starts, np.diff(np.r_[starts, groups.size]))
    _, units = np.unique(groups * (groups.size + 1) + position // per_group, return_inverse=True)
    return units
