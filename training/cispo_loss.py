"""CISPO, the clipped IS-weight policy loss, registered with the policy losses.

Registered in training.objectives' policy registry with their signature
(`get_policy_loss("cispo")` is the checked call):

    loss, metrics = get_policy_loss("cispo")(logp, old_logp, advantages, mask, cfg,
                                             ref_logp=None, norm=None, is_weight=None)
"""

from __future__ import annotations

import torch
from torch import Tensor

from training.objectives import (
    LossDefaults,
    Metrics,
    Normalizer,
    ObjectiveConfig,
    agg_loss,
    finish_loss,
    log_ratio,
    register_policy_loss,
    require_inputs,
)

__all__ = ["cispo_loss"]


@register_policy_loss("cispo", LossDefaults(eps_low=1.0, eps_high=3.0))
def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
               cfg: ObjectiveConfig, ref_logp: Tensor | None = None,
               norm: Normalizer | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): REINFORCE on every token, weighted by its
    importance ratio, clipped and detached; A_it = A_i when advantages are (B,):

        r_it = exp(logp_it - old_logp_it)
        w_it = sg(clip(r_it, 1 - eps_low, 1 + eps_high))
        l_it = -w_it A_it logp_it                  d l_it / d logp_it = -w_it A_it
        loss = agg(l + beta * KL(logp, ref_logp))

    GRPO's clip zeroes the gradient of a token whose ratio left the range on the side its
    advantage pushes (often a rare, decisive token); CISPO keeps every token's gradient and
    bounds only its weight. On policy (r = 1) the gradient is grpo's, -A_it grad logp_it.
    The paper's normaliser is 1 / sum_i |o_i|, agg = "token-mean"; cfg.agg chooses as for grpo.

    The loss value is -w A logp, whose size says nothing; pg_loss reports -w A, the surrogate
    that has this gradient at r = 1. The paper sets no lower bound and tunes only eps_high
    without publishing it: the registered eps_low = 1 makes the lower bound 0 (none, a ratio is
    > 0) and eps_high = 3 an upper bound of 4, ScaleRL's (Khatri et al. 2025). Dual clip does
    not apply (TrainConfig refuses it). `is_weight` (rollout correction) multiplies l_it, as
    in grpo. Clip fractions count tokens whose ratio is below / above the bounds, whatever
    the advantage's sign.
    """
    require_inputs("cispo", old_logp=old_logp, advantages=advantages)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp(log_ratio(logp, old_logp, mask)).detach()
    weight = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    if is_weight is not None:
        weight = weight * is_weight.detach()
    pg = -weight * adv * logp
    with torch.no_grad():
        valid = mask > 0
        n = valid.sum().clamp(min=1).to(ratio.dtype)
        metrics = {
            "clip_frac_low": ((ratio < 1 - cfg.eps_low) & valid).sum() / n,
            "clip_frac_high": ((ratio > 1 + cfg.eps_high) & valid).sum() / n,
            "ratio_mean": (ratio * valid).sum() / n,
            "ratio_min": ratio.masked_fill(~valid, float("inf")).min(),
            "ratio_max": ratio.masked_fill(~valid, float("-inf")).max(),
            "pg_loss": agg_loss(-weight * adv.expand_as(ratio), mask, cfg.agg, cfg.norm_len),
        }
    loss = agg_loss(pg, mask, cfg.agg, cfg.norm_len, norm)
    return finish_loss(loss, metrics, logp, old_logp, ref_logp, mask, cfg, norm)
