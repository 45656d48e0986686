"""The numbers of a comparison study's report (pipelines/studies/study_report.py): means over
seeds with 95% confidence intervals, eval curves on a common grid, per-step measurements.

Statistics: the CI of n values is mean ± t_{0.975, n-1} s / sqrt(n) (Student t, s the sample
standard deviation, ddof 1); t comes from T_975 (no scipy here). Each seed's accuracy curve is
interpolated linearly between its evals; a grid point outside a seed's curve is left out, never
extrapolated. The gradient SNR averages grad_signal and grad_noise (over seeds, and over steps
in the table) before taking the ratio, as training/grad_noise.py asks.

Every function here is pure (records in, numbers out) and tested with hand-made inputs in
tests/pipelines/test_compare_study.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipelines.reports.run_report import number

T_975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 4: 2.776445, 5: 2.570582, 6: 2.446912, 7: 2.364624,
         8: 2.306004, 9: 2.262157, 10: 2.228139, 11: 2.200985, 12: 2.178813, 13: 2.160369, 14: 2.144787,
         15: 2.131450, 16: 2.119905, 17: 2.109816, 18: 2.100922, 19: 2.093024, 20: 2.085963, 21: 2.079614,
         22: 2.073873, 23: 2.068658, 24: 2.063899, 25: 2.059539, 26: 2.055529, 27: 2.051831, 28: 2.048407,
         29: 2.045230, 30: 2.042272}
"""The 0.975 quantile of Student's t by degrees of freedom (two-sided 95%)."""


def t_975(df: int) -> float:
    """Student t's 0.975 quantile: the table up to 30 degrees of freedom, then the Cornish-Fisher
    expansion around the normal quantile (within 1e-5 of the exact value from df 30 on)."""
    if df < 1:
        raise ValueError(f"t_975: degrees of freedom must be >= 1, got {df}")
    if df in T_975:
        return T_975[df]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


@dataclass(frozen=True)
class Interval:
    """A mean over n values with the half-width of its 95% CI (None for one value)."""

    mean: float
    half: float | None
    n: int

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half

    def overlaps(self, other: "Interval") -> bool:
        """Whether the two intervals share a point (True when either has none: no CI, no claim)."""
        if self.half is None or other.half is None:
            return True
        return self.low <= other.high and other.low <= self.high


def mean_ci(values: list[float]) -> Interval:
    """Mean and 95% CI half-width t_{0.975, n-1} * s / sqrt(n) (s with ddof 1)."""
    if not values:
        raise ValueError("mean_ci: no values")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, None, 1)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return Interval(mean, t_975(n - 1) * s / math.sqrt(n), n)


# ---------------------------------------------------------------------------------------------
# Curves
# ---------------------------------------------------------------------------------------------

AXES = {"samples": "samples_total", "seconds": "elapsed_seconds", "steps": "policy_version"}
"""Each x axis of a final run's eval curve and the round record's key that holds it."""


def seed_curves(rounds: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """A run's eval curve on each axis: {axis: (x, eval accuracy)} over the rounds that evaluated.
    The wall-seconds curve starts at 0 s with round 0's accuracy: until round 1 trains, the policy
    is the start model (round 0's elapsed seconds are its engine start and its eval)."""
    out = {}
    for axis, key in AXES.items():
        points = [(x, acc) for r in rounds if (x := number(r, key)) is not None
                  and (acc := number(r, "eval_accuracy")) is not None]
        if axis == "seconds" and rounds and rounds[0].get("round") == 0 and points and points[0][0] > 0:
            points.insert(0, (0.0, points[0][1]))
        out[axis] = ([p[0] for p in points], [p[1] for p in points])
    return out


def interpolate(xs: list[float], ys: list[float], x: float) -> float | None:
    """y at `x` on the polyline (xs increasing), linear between points; None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # one point, x == xs[0]


def common_grid(curves: list[list[float]], points: int = 25) -> list[float]:
    """The x values every curve has, when they all have the same; otherwise `points` evenly spaced
    from the latest first x to the earliest last x (where every curve is defined)."""
    if not curves or any(not xs for xs in curves):
        return []
    if all(xs == curves[0] for xs in curves):
        return list(curves[0])
    low, high = max(xs[0] for xs in curves), min(xs[-1] for xs in curves)
    if high < low:
        return []
    if points < 2 or high == low:
        return [low]
    return [low + (high - low) * i / (points - 1) for i in range(points)]


def at(curves: list[tuple[list[float], list[float]]], x: float) -> Interval | None:
    """Mean and CI over the curves of their value at `x`; None when any curve does not reach x."""
    values = [interpolate(xs, ys, x) for xs, ys in curves]
    return None if any(v is None for v in values) else mean_ci(values)


def band(curves: list[tuple[list[float], list[float]]], points: int = 25) -> tuple[list[float], list[Interval]]:
    """The curves' mean and CI on their common grid."""
    grid = common_grid([xs for xs, _ in curves], points)
    pairs = [(x, iv) for x in grid if (iv := at(curves, x)) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


# ---------------------------------------------------------------------------------------------
# Per-step measurements
# ---------------------------------------------------------------------------------------------

STEP_MEASURES = ("grad_norm", "clip_frac", "zero_adv_frac", "grad_signal", "grad_noise", "grad_snr")


def _step_value(record: dict, key: str) -> float | None:
    if key == "clip_frac":  # as the policy losses log it: the two sides of the clip
        low, high = number(record, "clip_frac_low"), number(record, "clip_frac_high")
        return None if low is None or high is None else low + high
    if key == "noise_per_sample":  # grad_noise / B: the step gradient's own variance
        noise, rows = number(record, "grad_noise"), number(record, "rows")
        return None if noise is None or not rows else noise / rows
    return number(record, key)


def pooled_snr(records: list[dict]) -> float | None:
    """max(mean grad_signal, 0) / mean(grad_noise / rows) over the records that have both: the
    estimates averaged before the ratio (one step's ratio is biased)."""
    pairs = [(s, v) for r in records if (s := number(r, "grad_signal")) is not None
             and (v := _step_value(r, "noise_per_sample")) is not None]
    if not pairs:
        return None
    noise = sum(v for _, v in pairs) / len(pairs)
    signal = sum(s for s, _ in pairs) / len(pairs)
    return max(signal, 0.0) / noise if noise > 0 else None


def step_bands(seed_steps: list[list[dict]]) -> dict[str, tuple[list[float], list[Interval]]]:
    """Each STEP_MEASURES key over the seeds: per optimizer step the mean and CI, except grad_snr:
    per round (the newest round a step trained on), the pooled_snr of that round's steps of every
    seed (no CI). Keys no record has are left out."""
    by_step: dict[int, list[dict]] = {}
    by_round: dict[int, list[dict]] = {}
    for steps in seed_steps:
        for record in steps:
            by_step.setdefault(int(record["step"]), []).append(record)
            rounds = record.get("rounds")
            if isinstance(rounds, list) and rounds:
                by_round.setdefault(int(max(rounds)), []).append(record)
    out = {}
    for key in STEP_MEASURES:
        xs, values = [], []
        groups = by_round if key == "grad_snr" else by_step
        for x in sorted(groups):
            if key == "grad_snr":
                snr = pooled_snr(groups[x])
                iv = None if snr is None else Interval(snr, None, len(groups[x]))
            else:
                found = [v for r in groups[x] if (v := _step_value(r, key)) is not None]
                iv = mean_ci(found) if found else None
            if iv is not None:
                xs.append(float(x))
                values.append(iv)
        if xs:
            out[key] = (xs, values)
    return out


def step_summary(seed_steps: list[list[dict]]) -> dict[str, float | None]:
    """Each STEP_MEASURES key over every step of every seed: the mean (grad_snr: pooled_snr)."""
    records = [r for steps in seed_steps for r in steps]
    out: dict[str, float | None] = {}
    for key in STEP_MEASURES:
        if key == "grad_snr":
            out[key] = pooled_snr(records)
        else:
            values = [v for r in records if (v := _step_value(r, key)) is not None]
            out[key] = sum(values) / len(values) if values else None
    return out
