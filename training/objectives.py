"""The trainer's objectives, registered by name: the advantage estimators (defined in
training/advantages.py, which imports no torch, so the label stage and the spec stay light;
re-exported here) and the loss functions, pure tensor functions.

Policy losses share one signature (verl's core_algos style)::

    loss, metrics = get_policy_loss(name)(logp, old_logp, advantages, mask, cfg,
                                          ref_logp=None, norm=None)

logp, old_logp (behavior), ref_logp and mask are (B, T), mask 1 on the response tokens the model
sampled and 0 on padding and on tool/environment tokens (training.batching builds it), so
every sum, mean, ratio, count and metric below is over the model's tokens; advantages are (B,)
or (B, T). grpo, gspo, gspo_token and cispo also take
`is_weight=` (B, T), the rollout correction weights of training.correction: constants that
multiply each token's (gspo: each sequence's, the mean over its tokens) policy term.
cispo lives in training/cispo_loss.py. The pair loss (training/pair_loss.py) has its own
signature, see get_pair_loss. A loss is a scalar tensor; metrics
are floats computed under no_grad that describe this batch alone (they ignore `norm`), so
the trainer can average them.

Gradient accumulation: give every micro-batch of a step the step's Normalizer. Each
micro-batch's loss is then its share of the full-step loss, and the shares sum to the
one-batch loss in value and gradient, however the step is split and padded. For
seq-mean-token-sum-norm that needs cfg.norm_len set: with norm_len None the divisor is each
micro-batch's own padded length T.

Padding may hold any finite logp (or anything at all in old_logp / ref_logp): it is masked
before any exp.

Each loss is registered with its paper's defaults (`loss_defaults(name)`: GSPO's clip ranges
3e-4 / 4e-4, CISPO's weight bounds 0 / 4, the pairwise temperature beta = 0.1), which `TrainConfig` uses for the
settings it leaves unset. The input checks every call gets live in `training.loss_checks`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from training.advantages import (  # noqa: F401  (the registry of advantages, re-exported)
    AdvantageEstimator,
    GroupedRewards,
    advantage_names,
    get_advantage,
    register_advantage,
)
from training.loss_checks import AGG_MODES, KL_ESTIMATORS, check_config, check_pair_inputs, check_policy_inputs


@dataclass(frozen=True)
class ObjectiveConfig:
    """Hyperparameters of every objective (each loss reads the ones it needs)."""

    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip range: the ratio is clipped at 1 + eps_high (DAPO's clip-higher when > eps_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the loss is capped at -c * A (None: off)."""
    beta: float = 0.0
    """KL weight (policy losses) or the preference temperature (pairwise)."""
    kl: str = "k3"
    """KL estimator against the reference model: k1, k2, k3 or k3_clamped (see kl_penalty)."""
    agg: str = "seq-mean-token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum-norm."""
    norm_len: int | None = None
    """seq-mean-token-sum-norm divides by B * norm_len (None: the padded length T)."""
    gamma: float = 0.0
    """Pairwise margin subtracted from h (SimPO's gamma)."""
    length_normalize: bool = False
    """Pairwise: L is the mean token log-prob instead of the sum."""


@dataclass(frozen=True)
class Normalizer:
    """Totals over the whole optimizer step, so that a loss computed on one micro-batch is
    that micro-batch's share of the full-batch loss: summing the micro-batch losses gives
    the same value and gradient as one big batch, however the step is split.

    None (the default in every loss) means "this batch is the whole step".
    """

    num_seqs: float
    """Sequences in the step (pairwise: pairs in the step)."""
    num_tokens: float
    """Masked-in tokens in the step: the response tokens the model sampled (not padding, not
    tool/environment tokens)."""
    weight_sum: float | None = None
    """Pairwise: sum of pair weights in the step."""


@dataclass(frozen=True)
class LossDefaults:
    """A loss's paper hyperparameters, used for the settings a config leaves unset."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0


Metrics = dict[str, float]
PolicyLoss = Callable[..., tuple[Tensor, Metrics]]
PairLoss = Callable[..., tuple[Tensor, Metrics]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""name -> policy loss as written below (unchecked: call it through get_policy_loss)."""
PAIR_LOSSES: dict[str, PairLoss] = {}
"""name -> pair loss as written below (unchecked: call it through get_pair_loss)."""
LOSS_DEFAULTS: dict[str, LossDefaults] = {}
"""name -> the defaults the loss was registered with (policy and pair losses share names)."""


def _register(registry: dict[str, Callable], name: str, defaults: LossDefaults) -> Callable:
    def register(fn: Callable) -> Callable:
        registry[name] = fn
        LOSS_DEFAULTS[name] = defaults
        return fn
    return register


def register_policy_loss(name: str, defaults: LossDefaults = LossDefaults()) -> Callable[[PolicyLoss], PolicyLoss]:
    return _register(POLICY_LOSSES, name, defaults)


def register_pair_loss(name: str, defaults: LossDefaults = LossDefaults()) -> Callable[[PairLoss], PairLoss]:
    return _register(PAIR_LOSSES, name, defaults)


def loss_defaults(name: str) -> LossDefaults:
    """The paper defaults loss `name` was registered with (eps_low, eps_high, beta)."""
    return _lookup(LOSS_DEFAULTS, name, "loss")


# ---- shared pieces ------------------------------------------------------------------------

def agg_loss(values: Tensor, mask: Tensor, mode: str, norm_len: int | None = None,
             norm: Normalizer | None = None) -> Tensor:
    """Reduce per-token values (B, T) to a scalar:

        token-mean               sum_it m_it v_it / N_tok                     (DAPO)
        seq-mean-token-mean      sum_i [sum_t m_it v_it / |y_i|] / N_seq      (GRPO)
        seq-mean-token-sum-norm  sum_it m_it v_it / (N_seq * norm_len)        (Dr. GRPO)

    |y_i| = max(sum_t m_it, 1). N_tok, N_seq: norm.num_tokens / norm.num_seqs (the whole
    step), or this batch's mask.sum() / B when norm is None. norm_len None means T; pass a
    constant for split invariance (micro-batches differ in padded T).

    token-mean is DAPO's token-level loss (Yu et al. 2025, eq. 8: 1 / sum_i |o_i| over a group;
    here over the step, as verl); seq-mean-token-sum-norm with norm_len = the sampling max_tokens is Dr.
    GRPO's constant normaliser (Liu et al. 2025: no 1/|o_i|, one divisor for every response).
    """
    masked = values * mask
    if mode == "token-mean":
        if norm is None:
            return masked.sum() / mask.sum().clamp(min=1)
        return masked.sum() / max(norm.num_tokens, 1)
    num_seqs = values.shape[0] if norm is None else max(norm.num_seqs, 1)
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (num_seqs * (values.shape[-1] if norm_len is None else norm_len))
    raise ValueError(f"unknown agg mode {mode!r}; known: {', '.join(AGG_MODES)}")


def kl_penalty(log_ratio: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on samples of pi (Schulman 2020), from
    d = logp - ref_logp:

        k1 = d                        unbiased, signed
        k2 = d^2 / 2                  biased, >= 0; its gradient is the KL's
        k3 = exp(-d) + d - 1          unbiased, >= 0 (DeepSeekMath's choice)
        k3_clamped = min(k3(max(d, -20)), 10)

    k3_clamped is verl's "low_var_kl": k3 while k3 <= 10, the constant 10 (no gradient) beyond,
    so one token the reference finds very unlikely cannot dominate (the clamp of d keeps exp finite)."""
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    if kind == "k3_clamped":
        d = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(-d) + d - 1).clamp(max=10.0)
    raise ValueError(f"unknown kl estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def log_ratio(logp: Tensor, other: Tensor, mask: Tensor) -> Tensor:
    # Padding of old/ref logps may hold anything (a generator's -inf): keep it out of exp.
    return torch.where(mask > 0, logp - other, 0.0)


def seq_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = sum_t m_it (logp_it - old_logp_it) / |y_i| (B,)."""
    return (log_ratio(logp, old_logp, mask) * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def clipped_pg(ratio: Tensor, adv: Tensor, cfg: ObjectiveConfig) -> tuple[Tensor, Tensor]:
    """l = -min(r A, clip(r, 1-eps_low, 1+eps_high) A); with dual clip c, l = min(l, -c A)
    where A < 0 (Ye et al. 2020: bounds the loss of a bad action whose ratio exploded).
    Returns l and where the dual clip was active."""
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        dual = (adv < 0) & (pg > cap)
        pg = torch.where(dual, cap, pg)
    return pg, dual


@torch.no_grad()
def _ratio_metrics(ratio: Tensor, adv: Tensor, valid: Tensor, dual: Tensor,
                   cfg: ObjectiveConfig) -> dict[str, Tensor]:
    """Clip fractions (clipped and the clip active: the clipped term was the min) and ratio
    statistics over the valid entries: tokens, or sequences for gspo."""
    n = valid.sum().clamp(min=1).to(ratio.dtype)
    adv = adv.expand_as(ratio)
    metrics = {
        "clip_frac_low": ((adv < 0) & (ratio < 1 - cfg.eps_low) & valid).sum() / n,
        "clip_frac_high": ((adv > 0) & (ratio > 1 + cfg.eps_high) & valid).sum() / n,
        "ratio_mean": (ratio * valid).sum() / n,
        "ratio_min": ratio.masked_fill(~valid, float("inf")).min(),
        "ratio_max": ratio.masked_fill(~valid, float("-inf")).max(),
    }
    if cfg.dual_clip is not None:
        metrics["dual_clip_frac"] = (dual & valid).sum() / n
    return metrics


def finish_loss(loss: Tensor, metrics: dict[str, Tensor], logp: Tensor, old_logp: Tensor | None,
            ref_logp: Tensor | None, mask: Tensor, cfg: ObjectiveConfig,
            norm: Normalizer | None) -> tuple[Tensor, Metrics]:
    """Add beta * agg(KL to the reference) and turn the metrics into floats.

    approx_kl is the k2 estimate 0.5 (logp - old_logp)^2, token mean: the policy's drift
    from the behavior policy, >= 0 and symmetric to second order, so its sign never hides it.
    """
    n = mask.sum().clamp(min=1)
    if old_logp is not None:
        with torch.no_grad():
            metrics["approx_kl"] = (0.5 * log_ratio(logp, old_logp, mask) ** 2 * mask).sum() / n
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError(f"beta = {cfg.beta} > 0 needs ref_logp (the reference model's "
                             "log-probs): pass it, or set beta = 0")
        kl = kl_penalty(log_ratio(logp, ref_logp, mask), cfg.kl)
        loss = loss + cfg.beta * agg_loss(kl, mask, cfg.agg, cfg.norm_len, norm)
        metrics["kl"] = (kl.detach() * mask).sum() / n
    return loss, {k: float(v) for k, v in metrics.items()}


def require_inputs(loss: str, **tensors: Tensor | None) -> None:
    missing = [name for name, t in tensors.items() if t is None]
    if missing:
        raise ValueError(f"{loss} needs {' and '.join(missing)} (got None)")


# ---- policy losses ------------------------------------------------------------------------

@register_policy_loss("grpo")
def grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
              cfg: ObjectiveConfig, ref_logp: Tensor | None = None,
              norm: Normalizer | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """GRPO (DeepSeekMath; PPO's clipped surrogate per token), A_it = A_i when advantages are (B,):

        r_it = exp(logp_it - old_logp_it)
        l_it = -w_it min(r_it A_it, clip(r_it, 1-eps_low, 1+eps_high) A_it)   (+ dual clip)
        loss = agg(l + beta * KL(logp, ref_logp))

    w_it: the rollout correction weight (`is_weight`, constant; 1 without it).
    """
    require_inputs("grpo", old_logp=old_logp, advantages=advantages)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    pg, dual = clipped_pg(ratio, adv, cfg)
    if is_weight is not None:
        pg = pg * is_weight.detach()
    metrics = _ratio_metrics(ratio, adv, mask > 0, dual, cfg)
    metrics["pg_loss"] = agg_loss(pg.detach(), mask, cfg.agg, cfg.norm_len)
    loss = agg_loss(pg, mask, cfg.agg, cfg.norm_len, norm)
    return finish_loss(loss, metrics, logp, old_logp, ref_logp, mask, cfg, norm)


@register_policy_loss("gspo", LossDefaults(eps_low=3e-4, eps_high=4e-4))
def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
              cfg: ObjectiveConfig, ref_logp: Tensor | None = None,
              norm: Normalizer | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios:

        s_i = exp(sum_t m_it (logp_it - old_logp_it) / |y_i|)
        l_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)     (+ dual clip)
        loss = sum_i l_i / N_seq + beta * agg(KL)

    With `is_weight` (rollout correction), l_i is multiplied by w_i = the mean of the
    sequence's token weights (the sequence weight itself at sequence level).
    advantages must be (B,); per-token advantages need gspo_token. A sequence without response
    tokens adds nothing. Clip fractions and ratio statistics count sequences. The paper's clip
    ranges, eps_low = 3e-4 and eps_high = 4e-4, are its registered defaults (a sequence ratio is
    a geometric mean of token ratios, so it moves ~1000x less; ObjectiveConfig's own are GRPO's).
    """
    require_inputs("gspo", old_logp=old_logp, advantages=advantages)
    if advantages.dim() != 1:
        raise ValueError(f"gspo needs per-sequence advantages of shape (B,), got "
                         f"{tuple(advantages.shape)}; use gspo_token for per-token advantages")
    has_tokens = mask.sum(-1) > 0
    ratio = torch.exp(seq_log_ratio(logp, old_logp, mask))
    pg, dual = clipped_pg(ratio, advantages, cfg)
    pg = pg * has_tokens
    if is_weight is not None:
        pg = pg * ((is_weight.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    metrics = _ratio_metrics(ratio, advantages, has_tokens, dual, cfg)
    metrics["pg_loss"] = pg.detach().sum() / logp.shape[0]
    num_seqs = logp.shape[0] if norm is None else max(norm.num_seqs, 1)
    return finish_loss(pg.sum() / num_seqs, metrics, logp, old_logp, ref_logp, mask, cfg, norm)


@register_policy_loss("gspo_token", LossDefaults(eps_low=3e-4, eps_high=4e-4))
def gspo_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    cfg: ObjectiveConfig, ref_logp: Tensor | None = None,
                    norm: Normalizer | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, eq. 13), for per-token advantages (a (B,) one broadcasts):

        s_it = sg(s_i) exp(logp_it - sg(logp_it))      (value s_i, gradient s_i grad logp_it)
        l_it = -min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it)   (+ dual clip)
        loss = seq-mean-token-mean(l) + beta * agg(KL)

    The policy term is always aggregated seq-mean-token-mean, the paper's form, whatever
    cfg.agg says (cfg.agg still aggregates the KL): with A_it = A_i it then equals gspo in value
    and gradient. Clip fractions and ratio statistics count tokens. `is_weight` (rollout
    correction) multiplies l_it, as in grpo.
    """
    require_inputs("gspo_token", old_logp=old_logp, advantages=advantages)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    seq_ratio = torch.exp(seq_log_ratio(logp, old_logp, mask)).detach()
    ratio = seq_ratio[:, None] * torch.exp(logp - logp.detach())
    pg, dual = clipped_pg(ratio, adv, cfg)
    if is_weight is not None:
        pg = pg * is_weight.detach()
    metrics = _ratio_metrics(ratio, adv, mask > 0, dual, cfg)
    metrics["pg_loss"] = agg_loss(pg.detach(), mask, "seq-mean-token-mean")
    loss = agg_loss(pg, mask, "seq-mean-token-mean", norm=norm)
    return finish_loss(loss, metrics, logp, old_logp, ref_logp, mask, cfg, norm)


@register_policy_loss("sft")
def sft_loss(logp: Tensor, old_logp: Tensor | None, advantages: Tensor | None, mask: Tensor,
             cfg: ObjectiveConfig, ref_logp: Tensor | None = None,
             norm: Normalizer | None = None) -> tuple[Tensor, Metrics]:
    """Rejection-sampling fine-tuning (RAFT, ReST): token NLL of the kept samples,

        loss = agg(-logp) + beta * agg(KL)       (old_logp and advantages are ignored)
    """
    nll = agg_loss(-logp, mask, cfg.agg, cfg.norm_len, norm)
    metrics = {"nll": (-logp.detach() * mask).sum() / mask.sum().clamp(min=1)}
    return finish_loss(nll, metrics, logp, None, ref_logp, mask, cfg, norm)


# ---- lookup, with the checks every call gets ----------------------------------------------

def _lookup(registry: dict[str, Callable], name: str, kind: str) -> Callable:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


CORRECTED_LOSSES = ("grpo", "gspo", "gspo_token", "cispo")
"""The policy losses that take rollout correction weights (`is_weight`)."""


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss `name` (grpo, gspo, gspo_token, cispo, sft). Each call first checks cfg and
    the shapes: logp (B, T); mask, old_logp, ref_logp like logp; advantages (B,) or (B, T)."""
    fn = _lookup(POLICY_LOSSES, name, "policy loss")

    @functools.wraps(fn)
    def checked(logp: Tensor, old_logp: Tensor | None, advantages: Tensor | None, mask: Tensor,
                cfg: ObjectiveConfig, ref_logp: Tensor | None = None,
                norm: Normalizer | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, Metrics]:
        check_config(cfg, pairwise=False)
        check_policy_inputs(logp, old_logp, advantages, mask, ref_logp, is_weight)
        if is_weight is None:  # a registered loss need not take is_weight
            return fn(logp, old_logp, advantages, mask.to(logp.dtype), cfg, ref_logp, norm)
        if name not in CORRECTED_LOSSES:
            raise ValueError(f"policy loss {name!r} takes no rollout correction weights (is_weight); "
                             f"those that do: {', '.join(CORRECTED_LOSSES)}")
        return fn(logp, old_logp, advantages, mask.to(logp.dtype), cfg, ref_logp, norm,
                  is_weight=is_weight.to(logp.dtype))

    return checked


def get_pair_loss(name: str) -> PairLoss:
    """The pair loss `name` (pairwise). Each call first checks cfg and the shapes: chosen and
    rejected logps (K, T_w), (K, T_l) like their masks and references; soft_label, weight (K,)."""
    fn = _lookup(PAIR_LOSSES, name, "pair loss")

    @functools.wraps(fn)
    def checked(chosen_logp: Tensor, rejected_logp: Tensor, chosen_mask: Tensor,
                rejected_mask: Tensor, soft_label: Tensor, weight: Tensor, cfg: ObjectiveConfig,
                ref_chosen_logp: Tensor | None = None, ref_rejected_logp: Tensor | None = None,
                norm: Normalizer | None = None) -> tuple[Tensor, Metrics]:
        check_config(cfg, pairwise=True)
        check_pair_inputs(chosen_logp, rejected_logp, chosen_mask, rejected_mask, soft_label, weight,
                          ref_chosen_logp, ref_rejected_logp)
        dtype = chosen_logp.dtype
        return fn(chosen_logp, rejected_logp, chosen_mask.to(dtype), rejected_mask.to(dtype),
                  soft_label.to(dtype), weight.to(dtype), cfg, ref_chosen_logp,
                  ref_rejected_logp, norm)

    return checked


# CISPO and the pair loss live in their own modules and register themselves on import; this
# import runs them (last, so that the names they take from here exist whichever module loads first).
from training import cispo_loss, pair_loss  # noqa: E402, F401
