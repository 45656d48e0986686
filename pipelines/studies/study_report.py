"""The report of a comparison study (pipelines/studies/study.py): seeds aggregated into means with 95%
confidence intervals, curves on a common grid, and a write-up whose sentences are filled from
the numbers.

    report_study(result) writes OUT/report/:
        compare.md        the sweep table (every setting, its validation score, the choice), the
                          final table (eval accuracy at 25/50/100% of the samples, wall seconds,
                          steps), accuracy at equal wall time and at equal steps, the per-step
                          measurements, "What this shows" / "What it does not show"
        compare.png       eval accuracy vs samples (the equal axis), vs wall seconds and vs
                          optimizer steps (for reference): mean over seeds and its 95% CI band
        measurements.png  grad norm, clip fraction, zero-advantage fraction, gradient signal,
                          noise and SNR per optimizer step, averaged over seeds
        ratio_spread.png  token vs sequence importance-ratio std by response length, for the
                          ratio-weighted objectives (grpo, gspo), from pipelines/studies/ratio_spread.py

Statistics: the CI of n values is mean ± t_{0.975, n-1} s / sqrt(n) (Student t, s the sample
standard deviation, ddof 1); t comes from T_975 (no scipy here). Each seed's accuracy curve is
interpolated linearly between its evals; a grid point outside a seed's curve is left out, never
extrapolated. The gradient SNR averages grad_signal and grad_noise (over seeds, and over steps
in the table) before taking the ratio, as training/grad_noise.py asks.

Every function above `report_study` is pure (records in, numbers or text out) and tested with
hand-made inputs in tests/pipelines/test_compare_study.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from curation.store.runlog import MetricsLog, write_atomic
from pipelines.reports.run_report import markdown_table, number

if TYPE_CHECKING:
    from pipelines.studies.study import StudyResult

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


# ---------------------------------------------------------------------------------------------
# The write-up: sentences from numbers
# ---------------------------------------------------------------------------------------------

def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def pm(iv: Interval | None, scale: float = 100.0, digits: int = 1) -> str | None:
    """"68.2 ± 2.1" (mean ± CI half-width, scaled); "68.2" with one seed; None without a value."""
    if iv is None:
        return None
    mean = f"{scale * iv.mean:.{digits}f}"
    return mean if iv.half is None else f"{mean} ± {scale * iv.half:.{digits}f}"


def _ci_text(iv: Interval) -> str:
    return "no CI (one seed)" if iv.half is None else f"95% CI {100 * iv.low:.1f}–{100 * iv.high:.1f}"


def lead_sentence(where: str, stats: dict[str, Interval | None]) -> str:
    """Which objective led `where` (e.g. "At equal samples (8,192 per run)") and by how much, and
    whether its 95% interval overlaps the others' ("not distinguishable at this number of seeds")
    or none ("a clear lead")."""
    known = {name: iv for name, iv in stats.items() if iv is not None}
    if not known:
        return f"{where}: no objective has a value."
    ranked = sorted(known.items(), key=lambda item: -item[1].mean)
    (leader, top), rest = ranked[0], ranked[1:]
    if not rest:
        return f"{where}: only {leader} has a value, {pct(top.mean)} ({_ci_text(top)})."
    runner, second = rest[0]
    gap = 100 * (top.mean - second.mean)
    head = (f"{where}, {leader} led with {pct(top.mean)} ({_ci_text(top)}), {gap:.1f} points above {runner} "
            f"({pct(second.mean)}, {_ci_text(second)})." if gap > 0 else
            f"{where}, {leader} and {runner} tied at {pct(top.mean)}.")
    seeds = top.n
    overlapping = [name for name, iv in rest if top.overlaps(iv)]
    if not overlapping:
        return f"{head} The intervals do not overlap: a clear lead over every other objective at {seeds} seeds."
    names = ", ".join(overlapping)
    return (f"{head} Its interval overlaps that of {names}: not distinguishable at this number of seeds "
            f"({seeds}).")


def ranking_sentence(leaders: dict[str, str | None]) -> str:
    """Whether the same objective led on every axis ({axis phrase: leader or None})."""
    named = {axis: leader for axis, leader in leaders.items() if leader is not None}
    if not named:
        return "No axis has a leader."
    if len(set(named.values())) == 1:
        leader = next(iter(named.values()))
        return f"The same objective, {leader}, has the highest mean on every axis ({', '.join(named)})."
    return "The objective with the highest mean depends on the axis: " + "; ".join(
        f"{axis}: {leader}" for axis, leader in named.items()) + "."


def edge_note(name: str, values: list, chosen: object, key: str) -> str | None:
    """A note when the chosen value of a numeric one-key grid of 3 or more values is its smallest
    or largest: the best setting may lie outside the grid (with 2 values every choice is an edge)."""
    numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(values) < 3 or len(numeric) < len(values) or chosen not in (min(values), max(values)):
        return None
    side = "largest" if chosen == max(values) else "smallest"
    return (f"{name}: the sweep chose the {side} {key} of its grid ({chosen}); a better setting may lie "
            "outside the grid.")


def tie_note(name: str, scores: dict[str, float | None], chosen: str) -> str | None:
    """A note when other settings ({label: validation score}) tied with the chosen one."""
    best = scores.get(chosen)
    tied = [label for label, score in scores.items() if label != chosen and score is not None and best is not None
            and abs(score - best) < 1e-12]
    if not tied:
        return None
    return (f"{name}: {', '.join(tied)} tied with {chosen} on validation ({pct(best)}); the first listed was kept, "
            "so the sweep did not tell these settings apart.")


def caveats(*, n_seeds: int, device: str, cpu_count: int, jobs: int, max_tokens: int, eval_prompts: int | None,
            accuracy: float | None, sweep_rounds: int | None, rounds: int, eval_every: int) -> list[str]:
    """The fixed limits of a study, with its numbers filled in."""
    lines = [
        "One task and one start model: what holds here need not hold for another model or task.",
        f"Ran on {device} ({cpu_count} cores, {jobs} run(s) at a time): wall seconds are this machine's, and include "
        "engine start and evaluation" + ("; runs shared the CPU with each other." if jobs > 1 else "."),
        f"{n_seeds} seeds: a 95% interval over {n_seeds} runs uses t = {t_975(max(n_seeds - 1, 1)):.2f}. Intervals "
        "that do not overlap are a conservative sign of a difference; overlapping ones do not show the objectives "
        "are equal.",
    ]
    if max_tokens <= 32:
        lines.append(f"Responses are at most {max_tokens} tokens: the case for sequence-level ratios (GSPO) is "
                     "about long responses, which this study does not have.")
    else:
        lines.append(f"Responses are up to {max_tokens} tokens.")
    if eval_prompts and accuracy is not None:
        se = 100 * math.sqrt(max(accuracy * (1 - accuracy), 0.0) / eval_prompts)
        lines.append(f"The eval set has {eval_prompts} prompts: one run's accuracy near {pct(accuracy)} has a "
                     f"binomial standard error of about {se:.1f} points, on top of the seed-to-seed spread.")
    if sweep_rounds is not None:
        lines.append(f"Settings were chosen by {sweep_rounds}-round sweeps, the final runs have {rounds} rounds: a "
                     "schedule over fewer rounds decays sooner, so the best short-run setting need not be the best "
                     "long-run one; only the grid listed was tried, with one seed.")
    lines.append(f"Accuracy between evals (every {eval_every} round(s)) is interpolated linearly; at equal wall time "
                 "and equal steps it is read off those lines.")
    return lines


# ---------------------------------------------------------------------------------------------
# Writing the report
# ---------------------------------------------------------------------------------------------

@dataclass
class ObjectiveRuns:
    """One objective's final runs, read back: per seed the round and step records."""

    name: str
    objective: str
    setting: str
    rounds: list[list[dict]]
    steps: list[list[dict]]

    @property
    def curves(self) -> dict[str, list[tuple[list[float], list[float]]]]:
        per_seed = [seed_curves(r) for r in self.rounds]
        return {axis: [c[axis] for c in per_seed] for axis in AXES}

    def last(self, key: str) -> Interval:
        return mean_ci([number(r[-1], key) or 0.0 for r in self.rounds])


def _samples_at(runs: ObjectiveRuns, share: float) -> Interval | None:
    curves = runs.curves["samples"]
    total = min(xs[-1] for xs, _ in curves)
    return at(curves, share * total)


RATIO_OBJECTIVES = ("grpo", "gspo", "gspo_token")
"""Objectives whose loss weighs samples by importance ratios: the study measures their spread."""
MIN_BUCKET_SAMPLES = 20
"""Length buckets with fewer samples are left out of the ratio-spread sentences."""


def pooled_spread(rows: list[dict]) -> list[dict]:
    """Rows of `ratio_spread_for_run` (one per round and length bucket) pooled over rounds, one
    per bucket: samples and tokens summed; the token columns weighted by tokens, the sequence
    columns by samples, each round's own statistic (so a pooled std is the mean of the rounds'
    stds, not the std of the pooled ratios)."""
    by_bucket: dict[tuple, list[dict]] = {}
    for row in rows:
        by_bucket.setdefault((row["length_lo"], row["length_hi"]), []).append(row)
    out = []
    for (lo, hi), group in sorted(by_bucket.items(), key=lambda item: item[0][0]):
        samples, tokens = sum(r["samples"] for r in group), sum(r["tokens"] for r in group)
        if not samples:
            continue
        out.append({"length_lo": lo, "length_hi": hi, "samples": samples, "tokens": tokens,
                    "mean_length": tokens / samples, "rounds": sorted({r["round"] for r in group}),
                    **{k: _weighted(group, k, "tokens") for k in ("token_ratio_std", "token_clip_frac")},
                    **{k: _weighted(group, k, "samples")
                       for k in ("token_ratio_within_std", "seq_ratio_std", "seq_clip_frac")}})
    return out


def _weighted(rows: list[dict], key: str, weight: str) -> float:
    total = sum(r[weight] for r in rows)
    return sum(r[key] * r[weight] for r in rows) / total if total else float("nan")


def spread_sentence(name: str, pooled: list[dict]) -> str:
    """What the ratio spread of one objective's run says, from its pooled buckets."""
    kept = [b for b in pooled if b["samples"] >= MIN_BUCKET_SAMPLES]
    if not kept:
        return f"{name}: too few samples per length bucket to read the ratio spread."
    token = [b["token_ratio_std"] for b in kept]
    seq = [b["seq_ratio_std"] for b in kept]
    lengths = f"{kept[0]['mean_length']:.1f}-{kept[-1]['mean_length']:.1f} tokens" if len(kept) > 1 else \
        f"{kept[0]['mean_length']:.1f} tokens"
    lower = sum(s < t for s, t in zip(seq, token))
    span = lambda values: f"{min(values):.3f}" if f"{min(values):.3f}" == f"{max(values):.3f}" else \
        f"{min(values):.3f}-{max(values):.3f}"  # noqa: E731
    text = (f"{name}: the sequence ratios' std was {span(seq)} against the token ratios' {span(token)} (mean "
            f"response lengths {lengths}); lower in {lower} of {len(kept)} length bucket{'s' * (len(kept) > 1)}")
    if len(kept) > 1:
        trend = lambda first, last: "rose" if last > first * 1.1 else "fell" if last < first / 1.1 else "stayed flat"  # noqa: E731
        text += (f". From the shortest to the longest bucket the token spread {trend(token[0], token[-1])} and the "
                 f"sequence spread {trend(seq[0], seq[-1])}")
    return text + "."


def ratio_spreads(result: "StudyResult", objectives: dict[str, str]) -> dict[str, list[dict] | str]:
    """For each ratio-weighted objective, its first seed's final run measured with
    `pipelines.studies.ratio_spread.ratio_spread_for_run` and pooled over the measured rounds; a string
    says why a run could not be measured (no checkpoint that trained on a round, ...)."""
    import warnings

    from pipelines.studies.ratio_spread import RatioSpreadSkip, ratio_spread_for_run

    out: dict[str, list[dict] | str] = {}
    for name, objective in objectives.items():
        if objective not in RATIO_OBJECTIVES:
            continue
        run_dir = next(iter(result.finals[name].values()))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RatioSpreadSkip)
                table = ratio_spread_for_run(run_dir)
        except (OSError, ValueError) as exc:
            out[name] = f"not measured ({exc})"
            continue
        out[name] = pooled_spread(table.to_pylist()) if table.num_rows else \
            "not measured (no round has the checkpoint that trained on it: [run] checkpoint_every, [train] keep_last)"
    return out


def report_study(result: "StudyResult") -> Path:
    """Write OUT/report/compare.md, compare.png and measurements.png; returns the folder."""
    from pipelines.spec import read_toml

    section, out = result.section, result.out
    names = list(result.finals)
    runs = {}
    for name in names:
        loaded = [MetricsLog(path).read()[:2] for path in result.finals[name].values()]
        runs[name] = ObjectiveRuns(name, result.objectives.get(name, "?"), result.sweeps[name].chosen.label,
                                   [r for r, _ in loaded], [s for _, s in loaded])
    spec = read_toml(next(iter(result.finals[names[0]].values())) / "spec.toml")
    n_seeds = len(next(iter(result.finals.values())))
    samples = {int(number(r[-1], "samples_total") or 0) for o in runs.values() for r in o.rounds}
    total_samples = min(samples)
    wall_at = min(o.curves["seconds"][i][0][-1] for o in runs.values() for i in range(len(o.rounds)))
    steps_at = min(o.curves["steps"][i][0][-1] for o in runs.values() for i in range(len(o.rounds)))

    final = {name: o.last("eval_accuracy") for name, o in runs.items()}
    at_wall = {name: at(o.curves["seconds"], wall_at) for name, o in runs.items()}
    at_steps = {name: at(o.curves["steps"], steps_at) for name, o in runs.items()}
    rounds, per_round, group = spec["run"]["rounds"], spec["prompts"]["per_round"], spec["generator"]["group_size"]
    where = {
        "samples": f"At equal samples ({total_samples:,} per run: {rounds} rounds x {per_round} prompts x {group})",
        "seconds": f"At equal wall time ({_secs(wall_at)} s, the shortest run's; for reference)",
        "steps": f"At equal optimizer steps ({steps_at:.0f}, the fewest any run took; for reference)",
    }

    parts = [f"# Comparison study: {', '.join(names)}", "",
             f"{n_seeds} seeds ({', '.join(map(str, result.finals[names[0]]))}) per objective · {rounds} rounds · "
             f"{total_samples:,} samples per run · validation split: "
             + (f"{result.split.record.get('validation_rows', section.validation_size)} train prompts held out"
                if result.split else "none (no sweep)"), "",
             f"**Equal axis: generated samples** ({rounds} rounds x {per_round} prompts x {group} responses, the same "
             "for every objective and seed). Wall seconds and optimizer steps differ by objective (steps per round, "
             "batch sizes, loss cost) and are shown **for reference**.", ""]
    if len(samples) > 1:
        parts += [f"**Warning**: the runs generated different numbers of samples ({sorted(samples)}).", ""]

    # -- sweep --------------------------------------------------------------------------------
    parts += ["## Sweep (validation split)", ""]
    swept = {name: s for name, s in result.sweeps.items() if s.runs}
    if swept:
        parts += [f"Each setting ran {section.sweep_rounds} rounds (seed {section.sweep_seed}) on the train prompts "
                  f"without the validation split and was evaluated on the validation split every round. Score: the "
                  f"mean validation accuracy of its last {section.select_last} evals (rounds >= 1); the highest wins. "
                  "The eval set is not read until the final runs.", ""]
        rows = [[name, x.label, pct(s.scores.get(x.slug)).rstrip("%"), "**chosen**" if x == s.chosen else ""]
                for name, s in swept.items() for x in s.settings]
        parts += [markdown_table(["objective", "setting", "validation score (%)", "choice"], rows), ""]
    unswept = [name for name in names if name not in swept]
    if unswept:
        parts += [f"No sweep for {', '.join(unswept)}: the spec's own setting.", ""]

    # -- final runs ---------------------------------------------------------------------------
    parts += ["## Final runs (eval set)", "",
              f"Mean ± 95% CI half-width over {n_seeds} seeds (Student t). Accuracy at a share of the samples is read "
              "off each seed's eval curve (linear between evals).", ""]
    rows = [[name, runs[name].setting, pm(final[name]), pm(_samples_at(o, 0.25)), pm(_samples_at(o, 0.5)),
             pm(_samples_at(o, 1.0)), pm(o.last("elapsed_seconds"), 1.0, 1), pm(o.last("policy_version"), 1.0, 0)]
            for name, o in runs.items()]
    parts += [markdown_table(["objective", "setting", "final eval acc (%)", "acc at 25% samples", "acc at 50% samples",
                              "acc at 100% samples", "wall seconds", "optimizer steps"], rows), ""]
    parts += ["### At equal wall time and equal steps (for reference)", "",
              markdown_table(["objective", f"acc at {_secs(wall_at)} s (%)", f"acc at step {steps_at:.0f} (%)"],
                             [[name, pm(at_wall[name]), pm(at_steps[name])] for name in names]), ""]

    # -- measurements -------------------------------------------------------------------------
    summaries = {name: step_summary(o.steps) for name, o in runs.items()}
    parts += ["## Per-step measurements", "",
              "Means over every optimizer step of every seed (— where the objective logs none). grad SNR = "
              "max(mean grad_signal, 0) / mean(grad_noise / rows): the estimates averaged before the ratio "
              "([train] grad_noise; training/grad_noise.py). clip fraction = clip_frac_low + clip_frac_high.", "",
              markdown_table(["objective", "grad norm", "grad signal", "grad noise", "grad SNR", "zero-adv fraction",
                              "clip fraction"],
                             [[name, *[summaries[name][k] for k in ("grad_norm", "grad_signal", "grad_noise",
                                                                    "grad_snr", "zero_adv_frac", "clip_frac")]]
                              for name in names]), ""]

    # -- importance-ratio spread by response length ----------------------------------------------
    spreads = ratio_spreads(result, {name: o.objective for name, o in runs.items()})
    if spreads:
        parts += ["## Importance-ratio spread by response length", "",
                  "Each ratio-weighted objective's first-seed final run, measured after the fact "
                  "(pipelines/studies/ratio_spread.py): per response-length bucket, the std of the token "
                  "ratios r_it and of the sequence ratios s_i (their geometric mean per response) between the "
                  "behavior log-probs and "
                  "the checkpoint that trained on the round, pooled over the measured rounds (sample-weighted "
                  "means of each round's statistic). Clip fractions: ratios outside the paper ranges, 0.2 for "
                  "tokens and 3e-4 / 4e-4 for sequences.", ""]
        rows = []
        for name, pooled in spreads.items():
            if isinstance(pooled, str):
                rows.append([name, pooled, "", "", "", "", "", ""])
                continue
            for b in pooled:
                lengths = f"{b['length_lo']}-{b['length_hi']}" if b["length_hi"] is not None else f"{b['length_lo']}+"
                rows.append([name, lengths, str(b["samples"]), f"{b['token_ratio_std']:.4f}",
                             f"{b['token_ratio_within_std']:.4f}", f"{b['seq_ratio_std']:.4f}",
                             f"{100 * b['token_clip_frac']:.1f}", f"{100 * b['seq_clip_frac']:.1f}"])
        parts += [markdown_table(["objective", "response tokens", "samples", "token ratio std",
                                  "within-response std", "sequence ratio std", "tokens clipped (%)",
                                  "sequences clipped (%)"], rows), ""]

    # -- figures ------------------------------------------------------------------------------
    from pipelines.reports import plots  # matplotlib only when a report is drawn

    report_dir = out / "report"
    bands = {name: {axis: band(curves) for axis, curves in o.curves.items()} for name, o in runs.items()}
    plots.save_figure(plots.study_accuracy_figure(bands, {"seconds": wall_at, "steps": steps_at}, n_seeds),
                      report_dir / "compare.png")
    plots.save_figure(plots.study_measurements_figure({name: step_bands(o.steps) for name, o in runs.items()},
                                                      n_seeds), report_dir / "measurements.png")
    parts += ["## Figures", "", "![eval accuracy vs samples, wall seconds and steps](compare.png)", "",
              "![per-step measurements averaged over seeds](measurements.png)", ""]
    measured = {name: pooled for name, pooled in spreads.items() if not isinstance(pooled, str) and pooled}
    if measured:
        plots.save_figure(plots.ratio_spread_figure(measured), report_dir / "ratio_spread.png")
        parts += ["![token vs sequence ratio spread by response length](ratio_spread.png)", ""]

    # -- write-up -----------------------------------------------------------------------------
    leaders = {}
    shows = []
    for axis, stats in (("samples", final), ("seconds", at_wall), ("steps", at_steps)):
        shows.append(lead_sentence(where[axis], stats))
        known = {k: v for k, v in stats.items() if v is not None}
        leaders[{"samples": "equal samples", "seconds": "equal wall time", "steps": "equal steps"}[axis]] = (
            max(known, key=lambda k: known[k].mean) if known else None)
    shows.append(ranking_sentence(leaders))
    shows += [spread_sentence(name, pooled) for name, pooled in spreads.items() if not isinstance(pooled, str)]
    for name, s in swept.items():
        note = tie_note(name, {x.label: s.scores.get(x.slug) for x in s.settings}, s.chosen.label)
        if note:
            shows.append(note)
        if len(s.chosen.values) == 1:
            key, value = next(iter(s.chosen.values.items()))
            note = edge_note(name, section.sweep[name][key], value, key)
            if note:
                shows.append(note)
    eval_prompts = _eval_size(spec["prompts"]["eval"], spec["prompts"].get("eval_limit"))
    mean_final = sum(iv.mean for iv in final.values()) / len(final)
    does_not = caveats(n_seeds=n_seeds, device=result.device, cpu_count=os.cpu_count() or 1, jobs=result.jobs,
                       max_tokens=spec["generator"]["max_tokens"], eval_prompts=eval_prompts, accuracy=mean_final,
                       sweep_rounds=section.sweep_rounds if swept else None, rounds=rounds,
                       eval_every=spec["eval"]["every"])
    parts += ["## What this shows", "", *[f"- {line}" for line in shows], "",
              "## What it does not show", "", *[f"- {line}" for line in does_not], "",
              "## Runs", "", f"- choices and scores: `{out / 'study.json'}`"]
    parts += [f"- {name} {label}: `{path}`" for name, s in swept.items() for label, path in
              ((x.label, s.runs[x.slug]) for x in s.settings)]
    parts += [f"- {name} seed {seed}: `{path}`" for name in names for seed, path in result.finals[name].items()]
    write_atomic(report_dir / "compare.md", "\n".join(parts) + "\n")
    return report_dir


def _secs(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"


def _eval_size(path: str, limit: int | None) -> int | None:
    from curation.generate.base import load_prompts

    try:
        rows = load_prompts(path).num_rows
    except (OSError, ValueError):
        return None
    return min(rows, limit) if limit else rows
