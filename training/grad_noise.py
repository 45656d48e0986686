"""Gradient signal and noise of one optimizer step, from the gradients of its parts.

A step's gradient is the mean of B per-sample gradients G_1..G_B (sample: a sequence;
pairwise: a pair). The trainer's losses are normalised by the step's totals (Normalizer), so
the step gradient is a sum of one term per sample; G_i is B times sample i's term (with
token-mean aggregation the step's 1 / N_tok is part of every G_i, a constant of the step).
Model: G_i i.i.d. with mean mu = E[G] and covariance Sigma.

Split the B samples into K >= 2 parts of n_k >= 1 samples (sum_k n_k = B), chosen without
looking at the gradients, and let g_k be the MEAN of G_i over part k (unweighted; the
trainer's micro-batch k contributes c_k = (n_k / B) g_k to the step gradient), and

    gbar = sum_k n_k g_k / B                       the step's gradient (mean of all G_i)
    S    = sum_k n_k ||g_k - gbar||^2  =  sum_k n_k ||g_k||^2 - B ||gbar||^2

Then E ||gbar||^2 = ||mu||^2 + tr(Sigma) / B, and, since Var(g_k) = Sigma / n_k and
Cov(g_k, gbar) = Sigma / B, E[S] = sum_k n_k (tr Sigma / n_k - tr Sigma / B) = (K - 1) tr Sigma
(the means cancel). So, unbiased for any part sizes:

    noise  = tr(Sigma)^ = S / (K - 1)              per-sample gradient variance (trace)
    signal = ||mu||^2^  = ||gbar||^2 - noise / B   squared norm of the expected gradient
    snr    = max(signal, 0) / (noise / B)          the step gradient's signal-to-noise ratio

noise / B estimates E ||gbar - mu||^2, the step gradient's own variance, and snr = B / B_simple
with B_simple = tr(Sigma) / ||mu||^2, the "simple noise scale" of McCandlish et al. 2018 (An
Empirical Model of Large-Batch Training). With equal parts (n_k = n) the estimates are theirs
from two batch sizes, B_small = n (|G_small|^2 the mean of ||g_k||^2) and B_big = B:
noise = (mean ||g_k||^2 - ||gbar||^2) / (1/n - 1/B), signal = (B ||gbar||^2 - n mean ||g_k||^2)
/ (B - n). With K = B parts of one sample, noise is the usual unbiased sample covariance trace.

Caveats. `signal` is unbiased, so it can be negative on a step where noise dominates: average
signal and noise over steps before taking ratios (snr clamps the signal at 0, and a ratio of
one step's estimates is biased). The parts must not depend on the gradients: the trainer's
micro-batches are packed by sequence length (training.batching), so when the gradient's mean
depends on length, S also counts the spread between the length strata's means and `noise`
errs high (`signal` low); compare objectives on the same data and token_budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["GradNoise", "grad_noise", "grad_noise_from_sums"]


@dataclass(frozen=True)
class GradNoise:
    """One step's estimates (module docstring): signal = ||E G||^2, noise = tr(Sigma)."""

    signal: float
    """Unbiased ||mu||^2; may be negative when the noise dominates."""
    noise: float
    """Unbiased tr(Sigma) of the per-sample gradients (>= 0)."""
    batch_size: float
    """B: samples in the step."""
    parts: int
    """K: parts the step was split into (>= 2)."""

    @property
    def snr(self) -> float | None:
        """max(signal, 0) / (noise / B); None when noise is 0 (every part gradient equal)."""
        if self.noise <= 0:
            return None
        return max(self.signal, 0.0) / (self.noise / self.batch_size)


def grad_noise_from_sums(weighted_sq_norms: float, mean_sq_norm: float, batch_size: float,
                         parts: int) -> GradNoise:
    """The estimates from sum_k n_k ||g_k||^2 (`weighted_sq_norms`), ||gbar||^2
    (`mean_sq_norm`), B and K, for a caller that streams its parts (training.step):
    S = weighted_sq_norms - B mean_sq_norm, clamped at 0 against rounding (S >= 0 exactly)."""
    if parts < 2:
        raise ValueError(f"grad_noise needs at least 2 parts, got {parts}")
    if batch_size < parts:
        raise ValueError(f"grad_noise: {parts} parts of at least one sample need B >= {parts}, got {batch_size}")
    between = max(weighted_sq_norms - batch_size * mean_sq_norm, 0.0)
    noise = between / (parts - 1)
    return GradNoise(signal=mean_sq_norm - noise / batch_size, noise=noise, batch_size=float(batch_size),
                     parts=parts)


def grad_noise(part_means: torch.Tensor | Sequence[torch.Tensor], sizes: Sequence[int]) -> GradNoise:
    """The estimates from K part gradients: `part_means` (K, P), or K flat tensors of P, where
    row k is the MEAN per-sample gradient over the `sizes[k]` samples of part k (not their sum;
    every sample weighs the same). Computed in float64; S directly as sum_k n_k ||g_k - gbar||^2.

    >>> est = grad_noise(torch.tensor([[1.0, 0.0], [3.0, 2.0]]), [1, 3])
    >>> est.noise, est.signal  # gbar = (2.5, 1.5); S = 1 * 4.5 + 3 * 0.5 = 6
    (6.0, 7.0)
    """
    g = torch.stack(list(part_means)) if not isinstance(part_means, torch.Tensor) else part_means
    g = g.detach().to(torch.float64).reshape(len(g), -1)
    n = torch.as_tensor([int(s) for s in sizes], dtype=torch.float64)
    if len(n) != len(g):
        raise ValueError(f"grad_noise: {len(g)} part gradients but {len(n)} sizes")
    if len(g) < 2:
        raise ValueError(f"grad_noise needs at least 2 parts, got {len(g)}")
    if bool((n < 1).any()):
        raise ValueError(f"grad_noise: every part needs at least one sample, got sizes {list(sizes)}")
    B = float(n.sum())
    gbar = (n[:, None] * g).sum(0) / B
    between = float((n * ((g - gbar) ** 2).sum(1)).sum())
    noise = between / (len(g) - 1)
    return GradNoise(signal=float(gbar @ gbar) - noise / B, noise=noise, batch_size=B, parts=len(g))
