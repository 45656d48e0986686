"""The sentences of a comparison study's report (pipelines/studies/study_report.py), filled
from its numbers: who led on which axis and whether the intervals overlap, notes on the sweep's
choices, the ratio spread, and the fixed limits of a study.

Every function here is pure (numbers in, text out) and tested with hand-made inputs in
tests/pipelines/test_compare_study.py.
"""

from __future__ import annotations

import math

from pipelines.studies.study_stats import Interval, t_975


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


MIN_BUCKET_SAMPLES = 20
"""Length buckets with fewer samples are left out of the ratio-spread sentences."""


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
