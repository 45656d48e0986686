"""The report of a comparison study (pipelines/studies/study.py): seeds aggregated into means with 95%
confidence intervals, curves on a common grid, and a write-up whose sentences are filled from
the numbers (the numbers: pipelines/studies/study_stats.py; the sentences: study_text.py).

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

Each section of compare.md is one function below, reading the `StudyReport` that
`report_study` builds once from the runs' metrics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.reports.markdown import markdown_table
from pipelines.reports.run_report import number
from pipelines.studies.study_stats import AXES, Interval, at, band, mean_ci, seed_curves, step_bands, step_summary
from pipelines.studies.study_text import (
    caveats,
    edge_note,
    lead_sentence,
    pct,
    pm,
    ranking_sentence,
    spread_sentence,
    tie_note,
)
from store.run_files import MetricsLog
from store.storage import write_atomic

if TYPE_CHECKING:
    from pipelines.studies.study import StudyResult


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

    def samples_at(self, share: float) -> Interval | None:
        """Eval accuracy at `share` of the samples of the seed that generated the fewest."""
        curves = self.curves["samples"]
        total = min(xs[-1] for xs, _ in curves)
        return at(curves, share * total)


@dataclass
class StudyReport:
    """A finished study read back once for its report: the final runs per objective, the first
    final run's resolved spec, and where the equal-wall-time and equal-steps axes are read."""

    result: "StudyResult"
    runs: dict[str, ObjectiveRuns]
    spec: dict
    samples: set[int]
    wall_at: float
    steps_at: float

    @classmethod
    def read(cls, result: "StudyResult") -> "StudyReport":
        from pipelines.spec import read_toml

        runs = {}
        for name, finals in result.finals.items():
            loaded = [MetricsLog(path).read()[:2] for path in finals.values()]
            runs[name] = ObjectiveRuns(name, result.objectives.get(name, "?"), result.sweeps[name].chosen.label,
                                       [r for r, _ in loaded], [s for _, s in loaded])
        first = next(iter(result.finals.values()))
        curves = [o.curves for o in runs.values()]
        return cls(result, runs, read_toml(next(iter(first.values())) / "spec.toml"),
                   samples={int(number(r[-1], "samples_total") or 0) for o in runs.values() for r in o.rounds},
                   wall_at=min(xs[-1] for c in curves for xs, _ in c["seconds"]),
                   steps_at=min(xs[-1] for c in curves for xs, _ in c["steps"]))

    @property
    def names(self) -> list[str]:
        return list(self.runs)

    @property
    def n_seeds(self) -> int:
        return len(next(iter(self.result.finals.values())))

    @property
    def swept(self) -> dict:
        """The sweeps that ran (objectives with a grid)."""
        return {name: s for name, s in self.result.sweeps.items() if s.runs}

    def budget(self) -> tuple[int, int, int]:
        """(rounds, prompts per round, group size) of every final run."""
        return self.spec["run"]["rounds"], self.spec["prompts"]["per_round"], self.spec["generator"]["group_size"]

    def final(self) -> dict[str, Interval]:
        return {name: o.last("eval_accuracy") for name, o in self.runs.items()}

    def at_wall(self) -> dict[str, Interval | None]:
        return {name: at(o.curves["seconds"], self.wall_at) for name, o in self.runs.items()}

    def at_steps(self) -> dict[str, Interval | None]:
        return {name: at(o.curves["steps"], self.steps_at) for name, o in self.runs.items()}


def ratio_spreads(result: "StudyResult", objectives: dict[str, str]) -> dict[str, list[dict] | str]:
    """For each ratio-weighted objective, its first seed's final run measured with
    `pipelines.studies.ratio_spread.ratio_spread_for_run` and pooled over the measured rounds; a string
    says why a run could not be measured (no checkpoint that trained on a round, ...)."""
    import warnings

    from pipelines.studies.ratio_spread import RATIO_OBJECTIVES, RatioSpreadSkip, pooled_spread, ratio_spread_for_run

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
    report = StudyReport.read(result)
    report_dir = result.out / "report"
    spreads = ratio_spreads(result, {name: o.objective for name, o in report.runs.items()})
    parts = [*_header(report), *_sweep_section(report), *_final_section(report), *_measurements_section(report),
             *_spread_section(spreads), *_figures(report, spreads, report_dir), *_write_up(report, spreads),
             *_run_list(report)]
    write_atomic(report_dir / "compare.md", "\n".join(parts) + "\n")
    return report_dir


def _header(report: StudyReport) -> list[str]:
    result, section = report.result, report.result.section
    rounds, per_round, group = report.budget()
    total_samples = min(report.samples)
    parts = [f"# Comparison study: {', '.join(report.names)}", "",
             f"{report.n_seeds} seeds ({', '.join(map(str, result.finals[report.names[0]]))}) per objective · "
             f"{rounds} rounds · {total_samples:,} samples per run · validation split: "
             + (f"{result.split.record.get('validation_rows', section.validation_size)} train prompts held out"
                if result.split else "none (no sweep)"), "",
             f"**Equal axis: generated samples** ({rounds} rounds x {per_round} prompts x {group} responses, the same "
             "for every objective and seed). Wall seconds and optimizer steps differ by objective (steps per round, "
             "batch sizes, loss cost) and are shown **for reference**.", ""]
    if len(report.samples) > 1:
        parts += [f"**Warning**: the runs generated different numbers of samples ({sorted(report.samples)}).", ""]
    return parts


def _sweep_section(report: StudyReport) -> list[str]:
    section, swept = report.result.section, report.swept
    parts = ["## Sweep (validation split)", ""]
    if swept:
        parts += [f"Each setting ran {section.sweep_rounds} rounds (seed {section.sweep_seed}) on the train prompts "
                  f"without the validation split and was evaluated on the validation split every round. Score: the "
                  f"mean validation accuracy of its last {section.select_last} evals (rounds >= 1); the highest wins. "
                  "The eval set is not read until the final runs.", ""]
        rows = [[name, x.label, pct(s.scores.get(x.slug)).rstrip("%"), "**chosen**" if x == s.chosen else ""]
                for name, s in swept.items() for x in s.settings]
        parts += [markdown_table(["objective", "setting", "validation score (%)", "choice"], rows), ""]
    unswept = [name for name in report.names if name not in swept]
    if unswept:
        parts += [f"No sweep for {', '.join(unswept)}: the spec's own setting.", ""]
    return parts


def _final_section(report: StudyReport) -> list[str]:
    final, at_wall, at_steps = report.final(), report.at_wall(), report.at_steps()
    rows = [[name, o.setting, pm(final[name]), pm(o.samples_at(0.25)), pm(o.samples_at(0.5)),
             pm(o.samples_at(1.0)), pm(o.last("elapsed_seconds"), 1.0, 1), pm(o.last("policy_version"), 1.0, 0)]
            for name, o in report.runs.items()]
    return ["## Final runs (eval set)", "",
            f"Mean ± 95% CI half-width over {report.n_seeds} seeds (Student t). Accuracy at a share of the samples "
            "is read off each seed's eval curve (linear between evals).", "",
            markdown_table(["objective", "setting", "final eval acc (%)", "acc at 25% samples", "acc at 50% samples",
                            "acc at 100% samples", "wall seconds", "optimizer steps"], rows), "",
            "### At equal wall time and equal steps (for reference)", "",
            markdown_table(["objective", f"acc at {_secs(report.wall_at)} s (%)",
                            f"acc at step {report.steps_at:.0f} (%)"],
                           [[name, pm(at_wall[name]), pm(at_steps[name])] for name in report.names]), ""]


def _measurements_section(report: StudyReport) -> list[str]:
    summaries = {name: step_summary(o.steps) for name, o in report.runs.items()}
    keys = ("grad_norm", "grad_signal", "grad_noise", "grad_snr", "zero_adv_frac", "clip_frac")
    return ["## Per-step measurements", "",
            "Means over every optimizer step of every seed (— where the objective logs none). grad SNR = "
            "max(mean grad_signal, 0) / mean(grad_noise / rows): the estimates averaged before the ratio "
            "([train] grad_noise; training/grad_noise.py). clip fraction = clip_frac_low + clip_frac_high.", "",
            markdown_table(["objective", "grad norm", "grad signal", "grad noise", "grad SNR", "zero-adv fraction",
                            "clip fraction"],
                           [[name, *[summaries[name][k] for k in keys]] for name in report.names]), ""]


def _spread_section(spreads: dict[str, list[dict] | str]) -> list[str]:
    """The importance-ratio spread by response length, one row per objective and length bucket."""
    if not spreads:
        return []
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
    return ["## Importance-ratio spread by response length", "",
            "Each ratio-weighted objective's first-seed final run, measured after the fact "
            "(pipelines/studies/ratio_spread.py): per response-length bucket, the std of the token "
            "ratios r_it and of the sequence ratios s_i (their geometric mean per response) between the "
            "behavior log-probs and "
            "the checkpoint that trained on the round, pooled over the measured rounds (sample-weighted "
            "means of each round's statistic). Clip fractions: ratios outside the paper ranges, 0.2 for "
            "tokens and 3e-4 / 4e-4 for sequences.", "",
            markdown_table(["objective", "response tokens", "samples", "token ratio std", "within-response std",
                            "sequence ratio std", "tokens clipped (%)", "sequences clipped (%)"], rows), ""]


def _figures(report: StudyReport, spreads: dict[str, list[dict] | str], report_dir: Path) -> list[str]:
    """Draw compare.png, measurements.png (and ratio_spread.png when a run was measured); their
    markdown links."""
    from pipelines.reports import plots  # matplotlib only when a report is drawn

    bands = {name: {axis: band(curves) for axis, curves in o.curves.items()} for name, o in report.runs.items()}
    plots.save_figure(plots.study_accuracy_figure(bands, {"seconds": report.wall_at, "steps": report.steps_at},
                                                  report.n_seeds), report_dir / "compare.png")
    plots.save_figure(plots.study_measurements_figure({name: step_bands(o.steps) for name, o in report.runs.items()},
                                                      report.n_seeds), report_dir / "measurements.png")
    parts = ["## Figures", "", "![eval accuracy vs samples, wall seconds and steps](compare.png)", "",
             "![per-step measurements averaged over seeds](measurements.png)", ""]
    measured = {name: pooled for name, pooled in spreads.items() if not isinstance(pooled, str) and pooled}
    if measured:
        plots.save_figure(plots.ratio_spread_figure(measured), report_dir / "ratio_spread.png")
        parts += ["![token vs sequence ratio spread by response length](ratio_spread.png)", ""]
    return parts


def _write_up(report: StudyReport, spreads: dict[str, list[dict] | str]) -> list[str]:
    """"What this shows" (who led on each axis, the sweep's notes) and "What it does not show"."""
    result, section, spec = report.result, report.result.section, report.spec
    rounds, per_round, group = report.budget()
    where = {
        "samples": f"At equal samples ({min(report.samples):,} per run: {rounds} rounds x {per_round} prompts x "
                   f"{group})",
        "seconds": f"At equal wall time ({_secs(report.wall_at)} s, the shortest run's; for reference)",
        "steps": f"At equal optimizer steps ({report.steps_at:.0f}, the fewest any run took; for reference)",
    }
    final = report.final()
    leaders = {}
    shows = []
    for axis, stats in (("samples", final), ("seconds", report.at_wall()), ("steps", report.at_steps())):
        shows.append(lead_sentence(where[axis], stats))
        known = {k: v for k, v in stats.items() if v is not None}
        leaders[{"samples": "equal samples", "seconds": "equal wall time", "steps": "equal steps"}[axis]] = (
            max(known, key=lambda k: known[k].mean) if known else None)
    shows.append(ranking_sentence(leaders))
    shows += [spread_sentence(name, pooled) for name, pooled in spreads.items() if not isinstance(pooled, str)]
    for name, s in report.swept.items():
        note = tie_note(name, {x.label: s.scores.get(x.slug) for x in s.settings}, s.chosen.label)
        if note:
            shows.append(note)
        if len(s.chosen.values) == 1:
            key, value = next(iter(s.chosen.values.items()))
            note = edge_note(name, section.sweep[name][key], value, key)
            if note:
                shows.append(note)
    does_not = caveats(n_seeds=report.n_seeds, device=result.device, cpu_count=os.cpu_count() or 1, jobs=result.jobs,
                       max_tokens=spec["generator"]["max_tokens"],
                       eval_prompts=_eval_size(spec["prompts"]["eval"], spec["prompts"].get("eval_limit")),
                       accuracy=sum(iv.mean for iv in final.values()) / len(final),
                       sweep_rounds=section.sweep_rounds if report.swept else None, rounds=rounds,
                       eval_every=spec["eval"]["every"])
    return ["## What this shows", "", *[f"- {line}" for line in shows], "",
            "## What it does not show", "", *[f"- {line}" for line in does_not], ""]


def _run_list(report: StudyReport) -> list[str]:
    result = report.result
    parts = ["## Runs", "", f"- choices and scores: `{result.out / 'study.json'}`"]
    parts += [f"- {name} {label}: `{path}`" for name, s in report.swept.items() for label, path in
              ((x.label, s.runs[x.slug]) for x in s.settings)]
    parts += [f"- {name} seed {seed}: `{path}`" for name in report.names for seed, path in result.finals[name].items()]
    return parts


def _secs(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"


def _eval_size(path: str, limit: int | None) -> int | None:
    from curation.generate.base import load_prompts

    try:
        rows = load_prompts(path).num_rows
    except (OSError, ValueError):
        return None
    return min(rows, limit) if limit else rows
