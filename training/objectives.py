"""Loss functions of groupforge's trainer: pure tensor functions registered by name.

(Interface stub: the bodies are being written. The two dataclasses below are the contract
shared by objectives.py, batching.py and trainer.py.)
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """KL estimator against the reference model: k1, k2 or k3."""
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
    """Masked (response) tokens in the step."""
    weight_sum: float | None = None
    """Pairwise: sum of pair weights in the step."""
