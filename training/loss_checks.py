"""The checks every loss call gets before it runs (`training.objectives.get_policy_loss` and
`get_pair_loss` wrap each registered loss with them): the ObjectiveConfig's values and the
shapes of the tensors, each error naming the argument and the shape it needs.

    policy   logp (B, T); mask, old_logp, ref_logp, is_weight like logp; advantages (B,) or (B, T)
    pair     chosen_logp (K, T_w), rejected_logp (K, T_l), masks and references like them;
             soft_label and weight (K,)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from training.objectives import ObjectiveConfig

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_clamped")


def check_config(cfg: ObjectiveConfig, pairwise: bool) -> None:
    problems = []
    if cfg.agg not in AGG_MODES:
        problems.append(f"unknown agg mode {cfg.agg!r} (known: {', '.join(AGG_MODES)})")
    if cfg.kl not in KL_ESTIMATORS:
        problems.append(f"unknown kl estimator {cfg.kl!r} (known: {', '.join(KL_ESTIMATORS)})")
    if cfg.eps_low < 0 or cfg.eps_high < 0:
        problems.append(f"eps_low and eps_high must be >= 0, got {cfg.eps_low}, {cfg.eps_high}")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1:
        problems.append(f"dual_clip must be > 1 (or None), got {cfg.dual_clip}")
    if cfg.norm_len is not None and cfg.norm_len <= 0:
        problems.append(f"norm_len must be > 0 (or None), got {cfg.norm_len}")
    if pairwise and cfg.beta <= 0:
        problems.append(f"pairwise needs beta > 0 (the preference temperature; with beta = "
                        f"{cfg.beta} h = -gamma is constant and nothing is learned)")
    if not pairwise and cfg.beta < 0:
        problems.append(f"beta (the KL weight) must be >= 0, got {cfg.beta}")
    if problems:
        raise ValueError("invalid ObjectiveConfig: " + "; ".join(problems))


def check_policy_inputs(logp: Tensor, old_logp: Tensor | None, advantages: Tensor | None, mask: Tensor,
                        ref_logp: Tensor | None, is_weight: Tensor | None = None) -> None:
    _check_like("logp", logp, mask=mask, old_logp=old_logp, ref_logp=ref_logp, is_weight=is_weight)
    shape = tuple(logp.shape)
    if advantages is not None and tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected "
                         f"{shape[:1]} or {shape} (logp is {shape})")


def check_pair_inputs(chosen_logp: Tensor, rejected_logp: Tensor, chosen_mask: Tensor, rejected_mask: Tensor,
                      soft_label: Tensor, weight: Tensor, ref_chosen_logp: Tensor | None,
                      ref_rejected_logp: Tensor | None) -> None:
    if (ref_chosen_logp is None) != (ref_rejected_logp is None):
        raise ValueError("pass both ref_chosen_logp and ref_rejected_logp, or neither")
    _check_like("chosen_logp", chosen_logp, chosen_mask=chosen_mask, ref_chosen_logp=ref_chosen_logp)
    _check_like("rejected_logp", rejected_logp, rejected_mask=rejected_mask, ref_rejected_logp=ref_rejected_logp)
    pairs = chosen_logp.shape[:1]
    if rejected_logp.shape[:1] != pairs or soft_label.shape != pairs or weight.shape != pairs:
        raise ValueError(f"chosen_logp has K = {pairs[0]} pairs; rejected_logp "
                         f"{tuple(rejected_logp.shape)}, soft_label {tuple(soft_label.shape)} "
                         f"and weight {tuple(weight.shape)} must have K rows ((K,) for both)")


def _check_like(like: str, reference: Tensor, **tensors: Tensor | None) -> None:
    if reference.dim() != 2:
        raise ValueError(f"{like} must be 2-D (rows, T), got shape {tuple(reference.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != reference.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(reference.shape)} (the shape of {like})")
