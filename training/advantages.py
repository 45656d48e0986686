"""The advantage estimators, registered by name: what a group's advantage is.

Advantage estimators are pure numpy functions of a row's reward and its group's statistics;
the label stage (curation/stages/label.py) calls the one `[label] estimator` names::

    @register_advantage("grpo")
    def grpo_advantage(rows: GroupedRewards, eps: float) -> np.ndarray: ...

    get_advantage("grpo")(rows, eps)

r: a sample's reward; mean, std: over its group's kept samples (std ddof=1); G: their number.

    grpo     (r - mean) / (std + eps)            DeepSeekMath (Shao et al. 2024)
    dr_grpo  r - mean                            Dr. GRPO (Liu et al. 2025): no std division
    rloo     r - mean of the other G-1 samples   RLOO (Ahmadian et al. 2024); = G/(G-1) (r - mean)
    batch    c / (std_batch(c) + eps), c = r - mean
             REINFORCE++-baseline (Hu et al. 2025): centred within the group, then scaled by
             the std of c over every row of a kept group of the same (run_id, round)

An estimator may return anything for the rows of a group that is not kept (rewards all
equal, or a group of one): the label stage sets their advantage to 0. One registered with
`whole_round=True` needs every kept group of a round at once (GroupedRewards.batch filled).

Light: imports numpy and polars, not torch (training/objectives.py, the losses' registry,
re-exports these names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl


@dataclass(frozen=True)
class GroupedRewards:
    """Per row of the label stage's input (numpy arrays of one length): the reward and its
    group's statistics over the group's kept samples."""

    reward: np.ndarray
    mean: np.ndarray
    """The group's mean reward."""
    std: np.ndarray
    """The group's sample std (ddof=1, as TRL's torch.std); NaN for a group of one."""
    size: np.ndarray
    """G, the group's number of samples (float64)."""
    kept: np.ndarray
    """group_kept: the group's rewards are not all equal (max > min)."""
    batch: np.ndarray | None = None
    """An id per row, equal for rows of one (run_id, round); only for whole_round estimators."""


AdvantageFn = Callable[[GroupedRewards, float], np.ndarray]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: `estimator(rows, eps)` is the advantage per row."""

    name: str
    fn: AdvantageFn
    whole_round: bool = False
    """Needs every kept group of the round at once (the label stage does not slice the round)."""

    def __call__(self, rows: GroupedRewards, eps: float) -> np.ndarray:
        return self.fn(rows, eps)


_ADVANTAGES: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str, *, whole_round: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register `fn(rows, eps) -> advantage per row` under `name` (the label stage's
    `estimator`); a name is registered once."""
    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGES[name] = AdvantageEstimator(name, fn, whole_round)
        return fn

    return decorator


def get_advantage(name: str) -> AdvantageEstimator:
    """The estimator registered under `name`; ValueError naming the known ones otherwise."""
    if name not in _ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(advantage_names())}")
    return _ADVANTAGES[name]


def advantage_names() -> tuple[str, ...]:
    """The registered estimators' names, in registration order."""
    return tuple(_ADVANTAGES)


@register_advantage("grpo")
def grpo_advantage(rows: GroupedRewards, eps: float) -> np.ndarray:
    """A = (r - mean) / (std + eps): scale_rewards = "group"."""
    return (rows.reward - rows.mean) / (rows.std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantage(rows: GroupedRewards, eps: float) -> np.ndarray:
    """A = r - mean: scale_rewards = "none" (Dr. GRPO removes the std division, which
    up-weights groups whose rewards barely differ: too easy or too hard prompts)."""
    return rows.reward - rows.mean


@register_advantage("rloo")
def rloo_advantage(rows: GroupedRewards, eps: float) -> np.ndarray:
    """A = r - (sum of the group's rewards - r) / (G - 1) = (r - mean) G / (G - 1)."""
    return (rows.reward - rows.mean) * rows.size / (rows.size - 1)


@register_advantage("batch", whole_round=True)
def batch_advantage(rows: GroupedRewards, eps: float) -> np.ndarray:
    """A = c / (std_batch(c) + eps), c = r - mean, std_batch the sample std (ddof=1) of c over
    the rows of kept groups with the row's batch id: scale_rewards = "batch". A batch is one group whose Welford update
    is sequential over all its rows: a Polars window query."""
    centred = rows.reward - rows.mean
    frame = pl.DataFrame([pl.Series("batch", rows.batch), pl.Series("centred", centred), pl.Series("kept", rows.kept)])
    std = frame.select(pl.when(pl.col("kept")).then(pl.col("centred")).std(ddof=1).over("batch"))
    return centred / (std.to_series().to_numpy() + eps)
