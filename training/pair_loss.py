"""The pair loss: preference pairs (chosen, rejected) with soft labels, DPO / SimPO-like.

Registered in training.objectives' pair registry (`get_pair_loss("pairwise")` is the checked
call); the pair loss has its own signature, two sequences and their masks per pair:

    loss, metrics = get_pair_loss("pairwise")(chosen_logp, rejected_logp, chosen_mask, rejected_mask,
                                              soft_label, weight, cfg, ref_chosen_logp=None,
                                              ref_rejected_logp=None, norm=None)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from training.objectives import LossDefaults, Metrics, Normalizer, ObjectiveConfig, register_pair_loss

__all__ = ["pairwise_loss"]


@register_pair_loss("pairwise", LossDefaults(beta=0.1))
def pairwise_loss(chosen_logp: Tensor, rejected_logp: Tensor, chosen_mask: Tensor,
                  rejected_mask: Tensor, soft_label: Tensor, weight: Tensor,
                  cfg: ObjectiveConfig, ref_chosen_logp: Tensor | None = None,
                  ref_rejected_logp: Tensor | None = None,
                  norm: Normalizer | None = None) -> tuple[Tensor, Metrics]:
    """Preference loss on within-group (chosen w, rejected l) pairs with soft labels p:

        L = sum_t m_t logp_t   (divided by |y| when cfg.length_normalize); Lref likewise, 0
            without a reference
        h_k = beta [(L_w - Lref_w) - (L_l - Lref_l)] - gamma
        l_k = -p_k log sig(h_k) - (1 - p_k) log sig(-h_k)
        loss = sum_k w_k l_k / W,   W = norm.weight_sum, or this batch's sum_k w_k

    With a reference and p = 1 this is DPO (Rafailov et al. 2023); without a reference, with
    length_normalize and gamma it is SimPO-like. Metrics (unweighted, this batch):
    reward_accuracy = fraction of pairs with h > 0 (the margin beats gamma), margin_mean =
    mean(h + gamma), loss = the loss with W from this batch.
    """
    def seq_logp(logp: Tensor, mask: Tensor) -> Tensor:
        total = torch.where(mask > 0, logp, 0.0).sum(-1)  # padding may be -inf
        return total / mask.sum(-1).clamp(min=1) if cfg.length_normalize else total

    margin = seq_logp(chosen_logp, chosen_mask) - seq_logp(rejected_logp, rejected_mask)
    if ref_chosen_logp is not None:
        margin = margin - (seq_logp(ref_chosen_logp, chosen_mask)
                           - seq_logp(ref_rejected_logp, rejected_mask))
    h = cfg.beta * margin - cfg.gamma
    per_pair = -soft_label * F.logsigmoid(h) - (1 - soft_label) * F.logsigmoid(-h)
    if norm is not None and norm.weight_sum is None:
        raise ValueError("pairwise needs norm.weight_sum (the step's sum of pair weights)")
    # A step whose weights are all 0 gives loss 0, not 0/0.
    tiny = torch.finfo(per_pair.dtype).tiny
    weight_sum = weight.sum().clamp(min=tiny) if norm is None else max(norm.weight_sum, tiny)
    with torch.no_grad():
        metrics = {"reward_accuracy": (h > 0).to(h.dtype).mean(),
                   "margin_mean": (h + cfg.gamma).mean(),
                   "loss": (weight * per_pair).sum() / weight.sum().clamp(min=tiny)}
    return (weight * per_pair).sum() / weight_sum, {k: float(v) for k, v in metrics.items()}
