"""Run reports, rebuilt from RUN/metrics.jsonl alone: reading the records, the numbers and
the markdown here (its tables: pipelines/reports/markdown.py), the figures in pipelines/reports/plots.py.

    report_run(RUN)                writes RUN/report/ (or `out_dir`):
        progress.png               eval accuracy and reward mean per round (two panels)
        training.png               loss, grad norm, importance-ratio band and clip fractions per
                                   optimizer step (pairwise: pair reward accuracy and margin instead;
                                   a panel says so where the objective logs no such statistic)
        summary.md                 start -> final -> best eval accuracy, the gain in points, a
                                   per-round table, the tool use of multi-turn rounds, where
                                   each round's time went (seconds per phase, totals and
                                   shares, model work vs the rest), a training
                                   table, the two figures embedded, and the rows per table and
                                   round read from the Parquet tables
    report_compare({label: RUN}, OUT) writes OUT/:
        compare.png                eval accuracy vs samples generated and vs wall seconds, reward
                                   mean vs samples, grad norm, clip fraction (low + high) and
                                   ratio range (max - min) per step, one colour per run
        compare.md                 one row per run (label, objective, start/final/best accuracy,
                                   gain, samples, wall seconds, mean grad norm, mean clip
                                   fraction) and the figure, linked relatively

The records are read with `store.run_files.MetricsLog` (cut lines skipped and counted, the
last record of a number wins). Every file is written with `store.run_files.write_atomic`
(mode 0644: a report is for everyone who can read the run), so a reader never sees half a
PNG. Importing this module loads neither matplotlib nor torch: pipelines.reports.plots is imported
when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from pipelines.reports.markdown import markdown_table
from store.faults import fault_point
from store.location import RunLocation
from store.run_files import METRICS_FILE, PHASES, REPORT_DIR, BestCheckpoint, MetricsLog, load_best
from store.storage import Storage, write_atomic

# ---------------------------------------------------------------------------------------------
# Reading metrics.jsonl
# ---------------------------------------------------------------------------------------------

def load_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(round records sorted by round, step records sorted by step) of RUN/metrics.jsonl.

    Unparsable lines are skipped; of two records with the same round (or step) number the one
    written last wins, as a resumed run rewrites what the killed one had logged. A missing
    file raises ValueError naming the path.
    """
    rounds, steps, _ = MetricsLog(run_dir).read()
    return rounds, steps


def number(record: dict, key: str) -> float | None:
    """record[key] as a float, or None when absent, null or not a number."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def series(records: Iterable[dict], x_key: str, *y_keys: str) -> tuple[list[float], ...]:
    """Columns (x, y1, y2, ...) over the records where x and every y are numbers."""
    rows = [[number(r, k) for k in (x_key, *y_keys)] for r in records]
    rows = [row for row in rows if all(v is not None for v in row)]
    return tuple([row[i] for row in rows] for i in range(1 + len(y_keys)))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _objective(rounds: list[dict], steps: list[dict]) -> str | None:
    for record in [*reversed(rounds), *reversed(steps)]:
        if isinstance(record.get("objective"), str):
            return record["objective"]
    return None


def _accuracy(rounds: list[dict]) -> dict[str, Any] | None:
    """Start (first round), final (last round) and best eval accuracy, each with its round,
    and gain_points = 100 * (final - start); None when no round has an accuracy."""
    points = [(r["round"], acc) for r in rounds if (acc := number(r, "eval_accuracy")) is not None]
    if not points:
        return None
    (start_round, start), (final_round, final) = points[0], points[-1]
    best_round, best = max(points, key=lambda p: (p[1], -p[0]))  # earliest round among ties
    return {"start": start, "start_round": start_round, "final": final, "final_round": final_round,
            "best": best, "best_round": best_round, "gain_points": 100.0 * (final - start)}


def _run_totals(rounds: list[dict], steps: list[dict]) -> dict[str, Any]:
    """Samples generated and wall seconds of the whole run, and per-step means."""
    last = rounds[-1] if rounds else {}
    samples = number(last, "samples_total")
    if samples is None and rounds:
        samples = sum(number(r, "samples") or 0.0 for r in rounds)
    seconds = number(last, "elapsed_seconds")
    if seconds is None and rounds:
        seconds = sum(number(r, "wall_seconds") or 0.0 for r in rounds)
    _, grad_norms = series(steps, "step", "grad_norm")
    _, low, high = series(steps, "step", "clip_frac_low", "clip_frac_high")
    return {
        "samples": None if samples is None else int(samples),
        "seconds": seconds,
        "mean_grad_norm": _mean(grad_norms),
        "mean_clip_frac": _mean([a + b for a, b in zip(low, high)]),
        "peak_rss_mib": max((number(r, "peak_rss_mib") for r in rounds if number(r, "peak_rss_mib")), default=None),
    }


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------

def _pct(accuracy: float | None) -> str | None:
    return None if accuracy is None else f"{100.0 * accuracy:.1f}"


def _points(gain: float | None) -> str | None:
    return None if gain is None else f"{gain:+.1f}"


def _seconds(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:.1f}"


def _accuracy_line(acc: dict[str, Any] | None) -> str:
    if acc is None:
        return "**Eval accuracy**: no round has an eval accuracy yet."
    return (f"**Eval accuracy**: start {_pct(acc['start'])}% (round {acc['start_round']}) → "
            f"final {_pct(acc['final'])}% (round {acc['final_round']}) → "
            f"best {_pct(acc['best'])}% (round {acc['best_round']}); "
            f"gain **{_points(acc['gain_points'])} points** (final − start).")


def _phases(record: dict) -> dict[str, float]:
    """The record's seconds per phase (PHASES order; {} for a record without phase_seconds)."""
    seconds = record.get("phase_seconds")
    if not isinstance(seconds, dict):
        return {}
    return {phase: value for phase in PHASES if (value := number(seconds, phase)) is not None}


def breakdown_line(record: dict) -> str | None:
    """Where a round's wall seconds went, in one short line; curation stages summed, zero
    phases left out; None for a record without phases.

    >>> breakdown_line({"wall_seconds": 1.0, "model_seconds": 0.6, "phase_seconds": {
    ...     "generate": 0.3, "score": 0.05, "filter": 0.05, "train": 0.4, "eval": 0.1, "other": 0.1}})
    '1.00 s = generate 0.30 · curate 0.10 · train 0.40 · eval 0.10 · other 0.10 | model work 60%'
    """
    phases = _phases(record)
    wall = number(record, "wall_seconds")
    if not phases or not wall:
        return None
    curation = sum(phases.get(stage, 0.0) for stage in ("score", "filter", "label", "pair"))
    shown = {"startup": phases.get("startup", 0.0), "generate": phases.get("generate", 0.0), "curate": curation,
             **{phase: phases.get(phase, 0.0) for phase in ("train", "checkpoint", "reload", "eval", "other")}}
    text = " · ".join(f"{name} {seconds:.2f}" for name, seconds in shown.items() if seconds >= 0.005)
    model = number(record, "model_seconds")
    share = f" | model work {100 * model / wall:.0f}%" if model is not None else ""
    return f"{wall:.2f} s = {text}{share}"


def time_markdown(rounds: list[dict]) -> str:
    """A markdown section: seconds per phase of each round, and the totals with their share of
    the wall time ("" when no record has phases)."""
    timed = [r for r in rounds if _phases(r)]
    if not timed:
        return ""
    headers = ["round", "wall", *PHASES, "model work (%)"]
    rows = []
    for r in timed:
        wall, model, phases = number(r, "wall_seconds"), number(r, "model_seconds"), _phases(r)
        rows.append([r["round"], _seconds2(wall), *[_seconds2(phases.get(phase)) for phase in PHASES],
                     f"{100 * model / wall:.0f}" if wall and model is not None else None])
    totals = {phase: sum(_phases(r).get(phase, 0.0) for r in timed) for phase in PHASES}
    wall = sum(number(r, "wall_seconds") or 0.0 for r in timed)
    model = sum(number(r, "model_seconds") or 0.0 for r in timed)
    share_rows = [[phase, _seconds2(seconds), f"{100 * seconds / wall:.1f}" if wall else None]
                  for phase, seconds in totals.items()]
    share_rows += [["wall", _seconds2(wall), "100.0" if wall else None],
                   ["model work", _seconds2(model), f"{100 * model / wall:.1f}" if wall else None],
                   ["everything else", _seconds2(wall - model), f"{100 * (wall - model) / wall:.1f}" if wall else None]]
    return "\n".join([
        "## Time", "",
        "Wall seconds of each round by phase: engine start-up, generate (refills included), each curation stage, "
        "the trainer (its checkpoint writes apart), checkpoint, loading new weights into the engine, eval, and "
        "other (prompt choice, bookkeeping). Model work = the engine's sampling and greedy calls plus the "
        "trainer's optimizer steps (forward, backward, update).", "",
        markdown_table(headers, rows), "", markdown_table(["phase", "seconds", "share of wall (%)"], share_rows), ""])


def tool_use_markdown(rounds: list[dict]) -> str | None:
    """The multi-turn rounds' tool use (store/run_files.py TRAJECTORY_KEYS), a row per round;
    None when no round sampled trajectories."""
    multi = [r for r in rounds if r.get("tool_use_rate") is not None]
    if not multi:
        return None
    headers = ["round", "tool-use rate (%)", "tool calls", "tool errors", "mean turns", "stop reasons"]
    rows = [[r["round"], _pct(number(r, "tool_use_rate")), r.get("tool_calls"), r.get("tool_errors"),
             number(r, "mean_turns"), ", ".join(f"{k} {v}" for k, v in sorted((r.get("stop_reasons") or {}).items()))]
            for r in multi]
    return "\n".join(["## Tool use", "", markdown_table(headers, rows), "",
                      "Tool-use rate: the share of the round's trajectories with at least one tool call. "
                      "Eval accuracy (above) is over greedy trajectories against the same environment.", ""])


def _seconds2(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:.2f}"


def table_counts_markdown(run_dir: str | Path | Storage) -> str:
    """A markdown section with the rows of each table that holds any per round and the rejects by
    stage and reason, read from the run's Parquet tables ("" when the run has no tables)."""
    import duckdb

    from store.layout import ROUND_TABLES
    from store.run_store import RunStore

    store = RunStore(run_dir).snapshot()  # whole commits only, while a job may be writing
    tables = [table for table in ROUND_TABLES if store.files(table)]
    rounds = sorted({round for table in tables for round in store.rounds(table)})
    if not rounds:
        return ""
    rows, reasons = [], {}
    for round in rounds:
        counts = [sum(store.row_count(rel) for rel in store.files(table, round)) for table in tables]
        if store.files("rejects", round):
            rejects = store.read_columns("rejects", ["stage", "reason"], round)  # noqa: F841 (read by the SQL)
            by_reason = "SELECT stage, reason, count(*) FROM rejects GROUP BY ALL ORDER BY ALL"
            for stage, reason, n in duckdb.sql(by_reason).fetchall():
                reasons.setdefault(f"{stage}: {reason}", {})[round] = n
        rows.append([round] + counts)
    reason_names = sorted(reasons)
    rows = [row + [reasons[k].get(row[0], 0) for k in reason_names] for row in rows]
    text = ["", "## Tables", "",
            "Rows per table and round, read from the run's Parquet files, and the rejected rows by "
            "stage and reason (a whole-prompt reject counts once).", "",
            markdown_table(["round", *tables, *reason_names], rows)]
    return "\n".join(text) + "\n"


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------

def best_line(best: BestCheckpoint | None) -> str | None:
    """The kept checkpoint of `[run] keep_best` in one line (None: the run keeps none)."""
    if best is None:
        return None
    return (f"**Best checkpoint** (`[run] keep_best`): round {best.round}, eval accuracy "
            f"{_pct(best.eval_accuracy)}%, policy_version {best.policy_version}: `{best.checkpoint}`.")


def _summary_markdown(name: str, rounds: list[dict], steps: list[dict], skipped: int,
                      objective: str | None, best: BestCheckpoint | None = None) -> str:
    acc = _accuracy(rounds)
    totals = _run_totals(rounds, steps)
    facts = [f"objective **{objective or 'unknown'}**"]
    if rounds:
        facts.append(f"rounds {rounds[0]['round']}–{rounds[-1]['round']}")
    facts.append(f"{len(steps)} optimizer steps")
    if totals["samples"] is not None:
        facts.append(f"{totals['samples']} samples generated")
    if totals["seconds"] is not None:
        facts.append(f"{totals['seconds']:.1f} s wall")
    if totals["peak_rss_mib"] is not None:
        facts.append(f"peak RSS {totals['peak_rss_mib'] / 1024:.1f} GiB")
    kept = best_line(best)
    parts = [f"# Run report: {name}", "", " · ".join(facts), "", _accuracy_line(acc), "",
             *([kept, ""] if kept else []), "## Rounds", ""]

    if rounds:
        headers = ["round", "eval acc (%)", "reward mean", "kept groups", "groups", "pairs", "samples",
                   "policy version", "seconds"]
        rows = [[r["round"], _pct(number(r, "eval_accuracy")), number(r, "reward_mean"), r.get("kept_groups"),
                 r.get("groups"), r.get("pairs"), r.get("samples"), r.get("policy_version"),
                 _seconds(number(r, "wall_seconds"))]
                for r in rounds]
        parts += [markdown_table(headers, rows), "", "Round 0 evaluates the starting model; it trains nothing. "
                  "— in eval acc: the round did not evaluate (`[eval] every`).", ""]
    else:
        parts += ["No round records yet.", ""]

    tools_section = tool_use_markdown(rounds)
    parts += [tools_section] if tools_section else []
    time_section = time_markdown(rounds)
    parts += [time_section] if time_section else []
    parts += ["## Training", ""]
    if steps:
        _, losses = series(steps, "step", "loss")
        _, grad_norms = series(steps, "step", "grad_norm")
        _, tokens_per_s = series(steps, "step", "tokens_per_s")
        headers = ["steps", "first loss", "final loss", "mean grad norm", "max grad norm", "mean clip fraction",
                   "mean tokens/s"]
        parts += [markdown_table(headers, [[len(steps), losses[0] if losses else None,
                                            losses[-1] if losses else None, totals["mean_grad_norm"],
                                            max(grad_norms) if grad_norms else None, totals["mean_clip_frac"],
                                            _mean(tokens_per_s)]]),
                  "", "Clip fraction = clip_frac_low + clip_frac_high (— where the objective logs none).", ""]
    else:
        parts += ["No step records yet.", ""]

    parts += ["## Figures", "", "[progress.png](progress.png): eval accuracy and reward mean per round", "",
              "![eval accuracy and reward mean per round](progress.png)", "",
              "[training.png](training.png): loss, grad norm, ratio and clip statistics per step", "",
              "![training statistics per step](training.png)", ""]
    source = (f"Source: `{METRICS_FILE}`, {len(rounds)} round and {len(steps)} step records "
              "(last record wins for a repeated number)")
    source += f"; {skipped} unparsable line(s) skipped." if skipped else "."
    parts += [source, ""]
    return "\n".join(parts)


def report_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write progress.png, training.png, summary.md and index.html (pipelines/reports/html_page.py)
    for a run (a folder or an object-store URL) into `out_dir` and return that folder. By
    default it is RUN/report/: for a run on an object store, built in this machine's work
    folder for the run and then uploaded. A run without metrics.jsonl raises ValueError."""
    location = RunLocation.of(run_dir)
    rounds, steps, skipped = MetricsLog(location.storage).read()
    out = Path(out_dir) if out_dir is not None else location.work / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    objective = _objective(rounds, steps)
    title = f"{location.name} ({objective})" if objective else location.name

    from pipelines.reports import plots  # matplotlib only when a report is drawn

    plots.save_figure(plots.progress_figure(rounds, title), out / "progress.png")
    plots.save_figure(plots.training_figure(rounds, steps, title, objective), out / "training.png")
    summary = _summary_markdown(location.name, rounds, steps, skipped, objective, load_best(location.storage)) \
        + table_counts_markdown(location.storage)
    fault_point("report.before_write")
    write_atomic(out / "summary.md", summary)
    from pipelines.reports.html_page import write_html_report

    write_html_report(location.storage, out, rounds)  # index.html: curves, times, rejects, a sample browser
    if out_dir is None:
        location.upload(REPORT_DIR)
    return out


def report_compare(runs: dict[str, str | Path], out_dir: str | Path) -> Path:
    """Write compare.png and compare.md for runs given as {label: run folder}; returns out_dir.

    Panels that need ratio or clip statistics show only the runs that log them (grpo, gspo,
    gspo_token, cispo; not sft or pairwise). A run without metrics.jsonl raises ValueError.
    """
    if not runs:
        raise ValueError("report_compare: no runs given")
    loaded = {label: MetricsLog(path).read()[:2] for label, path in runs.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    objectives = {label: _objective(rounds, steps) for label, (rounds, steps) in loaded.items()}

    headers = ["label", "objective", "start acc (%)", "final acc (%)", "best acc (%)", "gain (points)", "samples",
               "wall seconds", "mean grad norm", "mean clip fraction"]
    rows, samples = [], set()
    for label, (rounds, steps) in loaded.items():
        acc = _accuracy(rounds) or {}
        totals = _run_totals(rounds, steps)
        samples.add(totals["samples"])
        seconds = totals["seconds"]
        rows.append([label, objectives[label], _pct(acc.get("start")), _pct(acc.get("final")), _pct(acc.get("best")),
                     _points(acc.get("gain_points")), totals["samples"],
                     _seconds(seconds), totals["mean_grad_norm"],
                     totals["mean_clip_frac"]])

    from pipelines.reports import plots  # matplotlib only when a report is drawn

    plots.save_figure(plots.compare_figure(loaded, objectives), out / "compare.png")
    parts = [f"# Comparison: {', '.join(runs)}", "", markdown_table(headers, rows), "",
             "gain = final − start eval accuracy, in percentage points; samples = responses generated over all "
             "rounds; wall seconds = elapsed since the run started; mean clip fraction = mean over steps of "
             "clip_frac_low + clip_frac_high (— where the objective logs no importance ratios: sft, pairwise).", ""]
    if len(samples) > 1:
        parts += ["Note: the runs generated different numbers of samples; read the accuracy-vs-samples panel "
                  "rather than the final accuracies.", ""]
    parts += ["![comparison of the runs](compare.png)", "", "Runs:", ""]
    parts += [f"- {label}: `{Path(path)}`" for label, path in runs.items()]
    write_atomic(out / "compare.md", "\n".join(parts) + "\n")
    return out
