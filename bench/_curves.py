"""Accuracy curves of one training run and what bench/loop.py reads off them (no torch, no plots).

A curve is the run's greedy eval accuracy at each eval, against three clocks: training wall
seconds (start-up and eval excluded, see bench/loop.py), the same in process CPU seconds (all
threads; less sensitive than wall time to other jobs on a shared machine) and samples
generated. The
summaries are read off the *smoothed* curve, each eval averaged with the `window - 1` evals
before it (a trailing mean), because one eval of 400 prompts moves by about +-2.4 points
(binomial standard error at 0.6) and a raw maximum would pick the luckiest eval:

    smoothed_i     = mean(acc_{i-w+1} .. acc_i)            (fewer at the start)
    time to X      = seconds (CPU seconds, samples) at the first eval with smoothed_i >= X; None if never
    best           = max_i smoothed_i over the run (or up to a time budget)
    plateau        = mean of the last `last` raw evals
    samples/s      = samples generated / training seconds, at the last eval
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Curve:
    """One run's evals, in order: `seconds[i]`, `cpu_seconds[i]` and `samples[i]` when `accuracy[i]`
    was measured (eval 0 is the start model, at 0 seconds and 0 samples); `load[i]` the machine's
    1-minute load average then."""

    framework: str
    variant: str
    seed: int
    seconds: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def add(self, seconds: float, samples: int, accuracy: float, cpu_seconds: float = 0.0, load: float = 0.0) -> None:
        self.seconds.append(float(seconds))
        self.samples.append(int(samples))
        self.accuracy.append(float(accuracy))
        self.cpu_seconds.append(float(cpu_seconds))
        self.load.append(float(load))

    def to_dict(self) -> dict:
        return {"framework": self.framework, "variant": self.variant, "seed": self.seed, "seconds": self.seconds,
                "samples": self.samples, "accuracy": self.accuracy, "cpu_seconds": self.cpu_seconds,
                "load": self.load, "extra": self.extra}

    @classmethod
    def from_dict(cls, data: dict) -> Curve:
        return cls(data["framework"], data["variant"], int(data["seed"]), list(data["seconds"]),
                   list(data["samples"]), list(data["accuracy"]), list(data.get("cpu_seconds", [])),
                   list(data.get("load", [])), dict(data.get("extra", {})))


def smoothed(accuracy: list[float], window: int) -> list[float]:
    """Trailing mean over `window` evals (the first ones average what there is)."""
    out = []
    for i in range(len(accuracy)):
        part = accuracy[max(0, i - window + 1): i + 1]
        out.append(sum(part) / len(part))
    return out


def first_reaching(curve: Curve, level: float, window: int = 3) -> int | None:
    """The index of the first eval whose smoothed accuracy reaches `level`; None if none does."""
    return next((i for i, value in enumerate(smoothed(curve.accuracy, window)) if value >= level - 1e-12), None)


def time_to(curve: Curve, level: float, window: int = 3) -> tuple[float, int] | None:
    """(seconds, samples) at the first eval whose smoothed accuracy reaches `level`; None if none does."""
    i = first_reaching(curve, level, window)
    return None if i is None else (curve.seconds[i], curve.samples[i])


def best(curve: Curve, window: int = 3, within_seconds: float | None = None) -> float:
    """The highest smoothed accuracy, over evals at or before `within_seconds` (None: all)."""
    values = [v for v, s in zip(smoothed(curve.accuracy, window), curve.seconds)
              if within_seconds is None or s <= within_seconds + 1e-9]
    return max(values) if values else float("nan")


def plateau(curve: Curve, last: int = 5) -> float:
    """Mean raw accuracy of the last `last` evals (start model excluded when there are more)."""
    values = curve.accuracy[1:] if len(curve.accuracy) > 1 else curve.accuracy
    values = values[-last:]
    return sum(values) / len(values) if values else float("nan")


def samples_per_s(curve: Curve) -> float:
    """Samples generated per training second, over the whole run."""
    if not curve.seconds or curve.seconds[-1] <= 0:
        return 0.0
    return curve.samples[-1] / curve.seconds[-1]


def mean(values: list[float | None]) -> float | None:
    """Mean of the values; None when any is None (a level one seed never reached has no mean)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)
