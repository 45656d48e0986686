"""Rollout correction: the three policies of an off-policy step, and the weight that corrects
for the engine that sampled not being the trainer.

    behavior   the engine's log-probs of the tokens it sampled, stored with them
               (samples.behavior_logprobs): its own kernels, dtype and sampling settings
    old        the trainer's log-probs of the same tokens under the weights that sampled them
               (`[train] old_logprobs = "recompute"`: computed once, when a set of rows is
               first trained on)
    current    the policy being trained

Two modes, set by `old_logprobs`:

    bypass     ("generator", the default) the PPO ratio is current / behavior: the engine's
               numerics sit inside the clipped ratio; there is no correction weight
    decoupled  ("recompute") the PPO ratio is current / old, times a correction weight w
               built from old / behavior, as `rollout_correction` says:

    token      w_it = exp(old_it - behavior_it)
    sequence   w_i  = exp(mean_t (old_it - behavior_it))    (`correction_sequence = "mean"`:
                                                             the geometric mean, the default)
               w_i  = exp(sum_t (old_it - behavior_it))     ("sum": the product of the
                                                             token ratios)
    truncate   w <- min(w, cap)                             (TIS, Yao et al. 2025)
    mask       w <- w if floor <= w <= cap, else 0          (MIS / IcePop: the token or the
                                                             sequence leaves the loss)

The weights are constants (computed without gradient) that multiply the policy term of each
token (grpo, gspo_token, cispo) or sequence (gspo: the mean of its tokens' weights, w_i itself at
sequence level) before aggregation; a masked token still counts in the loss's denominator.

Not the pairwise loss: it has no importance ratio (its gradient does not involve the
sampling distribution: DPO-style, each pair's log-likelihood margin against the reference),
so there is nothing for old / behavior to correct; weighting pairs by it would change which
pairs the loss learns from, not fix a bias. sft likewise has no ratio.

The mismatch itself is measured whenever both log-probs are there (decoupled mode), with the
correction on or off: with r = old / behavior on tokens sampled from behavior,
KL(behavior || old) ~ mean(-log r) (k1) and mean(r - 1 - log r) (k3, >= 0, Schulman 2020).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

Mode = Literal["off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass(frozen=True)
class CorrectionConfig:
    """How the correction weight is built (TrainConfig's rollout_correction fields)."""

    mode: Mode = "off"
    cap: float = 2.0
    """truncate: w is capped here; mask: a w above it is masked."""
    floor: float = 0.0
    """mask: a w below it is masked (0: no lower bound)."""
    sequence: Literal["mean", "sum"] = "mean"
    """Sequence level: w_i from the mean (geometric mean) or the sum (product) of the token log-ratios."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown rollout_correction {self.mode!r}; known: {', '.join(MODES)}")
        if not self.cap > 0 or self.floor < 0 or self.floor >= self.cap:
            raise ValueError(f"rollout correction needs 0 <= floor < cap, got floor {self.floor}, cap {self.cap}")
        if self.sequence not in ("mean", "sum"):
            raise ValueError(f"correction_sequence must be 'mean' or 'sum', got {self.sequence!r}")

    @property
    def on(self) -> bool:
        return self.mode != "off"


@torch.no_grad()
def correction_weights(old_logp: Tensor, behavior_logp: Tensor, mask: Tensor,
                       cfg: CorrectionConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """(w, metrics): w is (B, T), 0 on padding (every token of a sequence has the sequence's
    weight at sequence level); metrics over the valid tokens (token level) or sequences
    with tokens (sequence level): is_weight_mean and is_weight_max before truncation or
    masking, and is_truncated_frac or is_masked_frac."""
    valid = counted = mask > 0
    log_ratio = torch.where(valid, old_logp.float() - behavior_logp.float(), 0.0)
    if cfg.mode.startswith("token"):
        raw = torch.exp(log_ratio)
    else:
        total = log_ratio.sum(-1)
        seq = total / valid.sum(-1).clamp(min=1) if cfg.sequence == "mean" else total
        raw = torch.exp(seq)[:, None].expand_as(log_ratio)
    if cfg.mode.endswith("truncate"):
        weight = raw.clamp(max=cfg.cap)
        changed, name = raw > cfg.cap, "is_truncated_frac"
    else:
        changed = (raw > cfg.cap) | (raw < cfg.floor)
        weight = torch.where(changed, 0.0, raw)
        name = "is_masked_frac"
    if cfg.mode.startswith("sequence"):  # one value per sequence: take each sequence's first token
        first = torch.zeros_like(valid)
        first.scatter_(1, valid.float().argmax(-1, keepdim=True), True)
        counted = counted & first
    n = counted.sum().clamp(min=1)
    top = raw.masked_fill(~counted, float("-inf")).max() if counted.any() else raw.new_tensor(1.0)
    metrics = {"is_weight_mean": (raw * counted).sum() / n, "is_weight_max": top,
               name: (changed & counted).sum() / n}
    return (weight * valid).to(old_logp.dtype), metrics


@torch.no_grad()
def mismatch_metrics(old_logp: Tensor, behavior_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """k1 and k3 estimates of KL(behavior || old) per token, on tokens sampled from behavior
    (token mean), and the mean |old - behavior|."""
    valid = mask > 0
    log_r = torch.where(valid, old_logp.float() - behavior_logp.float(), 0.0)  # log(old / behavior)
    n = valid.sum().clamp(min=1)
    return {"mismatch_kl_k1": (-log_r * valid).sum() / n,
            "mismatch_kl_k3": ((torch.exp(log_r) - 1 - log_r) * valid).sum() / n,
            "old_behavior_gap": (log_r.abs() * valid).sum() / n}
