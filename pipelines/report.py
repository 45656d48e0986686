"""Plots and markdown summaries of runs, rebuilt from RUN/metrics.jsonl alone.

    report_run(RUN)                writes RUN/report/ (or `out_dir`):
        progress.png               eval accuracy and reward mean per round (two panels)
        training.png               loss, grad norm, importance-ratio band and clip fractions per
                                   optimizer step (pairwise: pair reward accuracy and margin instead;
                                   a panel says so where the objective logs no such statistic)
        summary.md                 start -> final -> best eval accuracy, the gain in points, a
                                   per-round table, a training table, the two figures embedded
    report_compare({label: RUN}, OUT) writes OUT/:
        compare.png                eval accuracy vs samples generated and vs wall seconds, reward
                                   mean vs samples, grad norm, clip fraction (low + high) and
                                   ratio range (max - min) per step, one colour per run
        compare.md                 one row per run (label, objective, start/final/best accuracy,
                                   gain, samples, wall seconds, mean grad norm, mean clip
                                   fraction) and the figure, linked relatively

metrics.jsonl holds one JSON object per line: `"event": "round"` records from the round loop
(round 0 evaluates the starting model before any training) and `"event": "step"` records from
the trainer. A killed process can leave a cut last line, so unparsable lines are skipped and
counted; a resumed run can write a round or step twice, so the last record of a number wins.

Every file is written to a temporary name in the output folder and renamed into place, so a
reader never sees half a PNG. Figures are drawn on `matplotlib.figure.Figure` with the Agg
canvas: no pyplot state, no global backend switch, nothing left open after a call.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

# Same name as training.trainer.METRICS_FILE; not imported from there, which would load torch.
METRICS_FILE = "metrics.jsonl"
REPORT_DIR = "report"
DPI = 120
MISSING = "—"


# ---------------------------------------------------------------------------------------------
# Reading metrics.jsonl
# ---------------------------------------------------------------------------------------------

def _read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict], int]:
    """(round records, step records, lines skipped): deduplicated by number (last wins), sorted."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no metrics file (is {Path(run_dir)} a groupforge run folder?)")
    by_number: dict[str, dict[int, dict]] = {"round": {}, "step": {}}
    skipped = 0
    # errors="replace": a kill can cut a multi-byte character in half, too.
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if not isinstance(record, dict):
            skipped += 1
            continue
        event = record.get("event")
        if event not in by_number:
            continue  # other events are not ours to report
        number = record.get(event)
        if isinstance(number, bool) or not isinstance(number, int):
            skipped += 1
            continue
        by_number[event][number] = record
    rounds = [by_number["round"][n] for n in sorted(by_number["round"])]
    steps = [by_number["step"][n] for n in sorted(by_number["step"])]
    return rounds, steps, skipped


def load_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(round records sorted by round, step records sorted by step) of RUN/metrics.jsonl.

    Unparsable lines are skipped; of two records with the same round (or step) number the one
    written last wins, as a resumed run rewrites what the killed one had logged. A missing
    file raises ValueError naming the path.
    """
    rounds, steps, _ = _read_metrics(run_dir)
    return rounds, steps


def _num(record: dict, key: str) -> float | None:
    """record[key] as a float, or None when absent, null or not a number."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(records: Iterable[dict], x_key: str, *y_keys: str) -> tuple[list[float], ...]:
    """Columns (x, y1, y2, ...) over the records where x and every y are numbers."""
    rows = [[_num(r, k) for k in (x_key, *y_keys)] for r in records]
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
    points = [(r["round"], acc) for r in rounds if (acc := _num(r, "eval_accuracy")) is not None]
    if not points:
        return None
    (start_round, start), (final_round, final) = points[0], points[-1]
    best_round, best = max(points, key=lambda p: (p[1], -p[0]))  # earliest round among ties
    return {"start": start, "start_round": start_round, "final": final, "final_round": final_round,
            "best": best, "best_round": best_round, "gain_points": 100.0 * (final - start)}


def _run_totals(rounds: list[dict], steps: list[dict]) -> dict[str, Any]:
    """Samples generated and wall seconds of the whole run, and per-step means."""
    last = rounds[-1] if rounds else {}
    samples = _num(last, "samples_total")
    if samples is None and rounds:
        samples = sum(_num(r, "samples") or 0.0 for r in rounds)
    seconds = _num(last, "elapsed_seconds")
    if seconds is None and rounds:
        seconds = sum(_num(r, "wall_seconds") or 0.0 for r in rounds)
    _, grad_norms = _series(steps, "step", "grad_norm")
    _, low, high = _series(steps, "step", "clip_frac_low", "clip_frac_high")
    return {
        "samples": None if samples is None else int(samples),
        "seconds": seconds,
        "mean_grad_norm": _mean(grad_norms),
        "mean_clip_frac": _mean([a + b for a, b in zip(low, high)]),
    }


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------

def _format_float(x: float) -> str:
    """Four significant digits, fixed notation between 1e-3 and 1e6, no trailing zeros."""
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    magnitude = abs(x)
    if not 1e-3 <= magnitude < 1e6:
        return f"{x:.4g}"
    text = f"{x:.{max(0, 3 - math.floor(math.log10(magnitude)))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _format_cell(cell: Any) -> str:
    if cell is None:
        return MISSING
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if isinstance(cell, int):
        return str(cell)
    if isinstance(cell, float):
        return _format_float(cell)
    return str(cell).replace("|", r"\|").replace("\n", " ")


def _is_numeric(text: str) -> bool:
    try:
        float(text.rstrip("%"))
    except ValueError:
        return text == MISSING
    return True


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured markdown table; numeric columns are right-aligned.

    Cells: None -> "—", ints as they are, floats to four significant digits without trailing
    zeros (0.41234 -> "0.4123", 12.0 -> "12", 3e-05 -> "3e-05"), strings as given (a "|" is
    escaped). Pass a string to fix a column's precision yourself, e.g. f"{100 * acc:.1f}".

    >>> print(markdown_table(["objective", "gain"], [["grpo", 0.5], ["sft", None]]))
    | objective | gain |
    | --- | ---: |
    | grpo | 0.5 |
    | sft | — |
    """
    header_cells = [_format_cell(h) for h in headers]
    body = []
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: row {i} has {len(row)} cells, expected {len(headers)} ({headers})")
        body.append([_format_cell(cell) for cell in row])
    numeric = [bool(body) and all(_is_numeric(row[j]) for row in body) and any(row[j] != MISSING for row in body)
               for j in range(len(headers))]
    lines = ["| " + " | ".join(header_cells) + " |",
             "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------

def _write_atomic(path: Path, write) -> None:
    """Call write(binary file) on a temporary file next to `path`, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is for everyone who can read the run
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def table_counts_markdown(run_dir: str | Path) -> str:
    """A markdown section with the rows of each table per round and the rejects by stage and
    reason, read from the run's Parquet tables ("" when the run has no tables)."""
    import duckdb

    from curation.store import ROUND_TABLES, RunStore

    store = RunStore(run_dir)
    rounds = sorted({r for t in ROUND_TABLES for r in store.rounds(t)})
    if not rounds:
        return ""
    rows, reasons = [], {}
    for r in rounds:
        counts = []
        for table in ROUND_TABLES:
            files = [str(f) for f in store.files(table, r)]
            n = duckdb.sql("SELECT count(*) FROM read_parquet($f, hive_partitioning = false, union_by_name = true)",
                           params={"f": files}).fetchall()[0][0] if files else 0
            counts.append(n)
        files = [str(f) for f in store.files("rejects", r)]
        if files:
            for stage, reason, n in duckdb.sql(
                    "SELECT stage, reason, count(*) FROM read_parquet($f, hive_partitioning = false, "
                    "union_by_name = true) GROUP BY ALL ORDER BY ALL", params={"f": files}).fetchall():
                reasons.setdefault(f"{stage}: {reason}", {})[r] = n
        rows.append([r] + counts)
    reason_names = sorted(reasons)
    rows = [row + [reasons[k].get(row[0], 0) for k in reason_names] for row in rows]
    text = ["", "## Tables", "",
            "Rows per table and round, read from the run's Parquet files, and the rejected rows by "
            "stage and reason (a whole-prompt reject counts once).", "",
            markdown_table(["round", *ROUND_TABLES, *reason_names], rows)]
    return "\n".join(text) + "\n"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_text(path: Path, text: str) -> None:
    _write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def _save_figure(fig: Figure, path: Path) -> None:
    _write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------

def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _style(ax, title: str, xlabel: str, ylabel: str, integer_x: bool = True) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _marker(n_points: int) -> str | None:
    return "o" if n_points <= 40 else None


def _progress_figure(rounds: list[dict], title: str) -> Figure:
    fig = _figure(9, 7)
    acc_ax, reward_ax = fig.subplots(2, 1, sharex=True)
    fig.suptitle(title)
    x, acc = _series(rounds, "round", "eval_accuracy")
    if x:
        acc_ax.plot(x, [100 * a for a in acc], marker="o", color="C0", label="eval accuracy")
        acc_ax.axhline(100 * acc[0], color="0.5", linestyle="--", linewidth=1,
                       label=f"start (round {int(x[0])}): {100 * acc[0]:.1f}%")
        acc_ax.set_ylim(-2, 102)
        acc_ax.legend(loc="lower right")
        _style(acc_ax, "Eval accuracy per round (greedy, eval set)", "", "eval accuracy (%)")
    else:
        _empty(acc_ax, "no round has an eval accuracy yet")
    x, reward = _series(rounds, "round", "reward_mean")
    if x:
        reward_ax.plot(x, reward, marker="o", color="C1", label="reward mean of sampled responses")
        reward_ax.legend(loc="lower right")
        _style(reward_ax, "Reward mean per round", "round", "reward mean")
    else:
        _empty(reward_ax, "no round has a reward mean yet (round 0 only evaluates)")
    return fig


def _round_ends(ax, rounds: list[dict], label: bool) -> None:
    """Dotted lines at the policy version each training round ended with."""
    ends = sorted({v for r in rounds if r.get("round", 0) > 0 and (v := _num(r, "policy_version"))})
    for i, end in enumerate(ends):
        ax.axvline(end, color="0.6", linestyle=":", linewidth=1, label="end of a round" if label and i == 0 else None)


def _training_figure(rounds: list[dict], steps: list[dict], title: str, objective: str | None) -> Figure:
    fig = _figure(12, 8)
    axes = fig.subplots(2, 2)
    fig.suptitle(title)
    name = objective or "this objective"
    step_label = "optimizer step (policy version)"

    def line_panel(ax, key: str, panel_title: str, ylabel: str, label: str, color: str) -> None:
        x, y = _series(steps, "step", key)
        if not x:
            _empty(ax, f"no '{key}' in the step records")
            return
        ax.plot(x, y, marker=_marker(len(x)), markersize=3, color=color, label=label)
        _round_ends(ax, rounds, label=True)
        ax.legend(loc="best")
        _style(ax, panel_title, step_label, ylabel)

    line_panel(axes[0, 0], "loss", f"Loss per step ({name})", "loss", "loss", "C0")
    line_panel(axes[0, 1], "grad_norm", "Gradient norm per step", "grad norm (before clipping)", "grad norm", "C3")

    ratio_ax, clip_ax = axes[1, 0], axes[1, 1]
    x, mean, low, high = _series(steps, "step", "ratio_mean", "ratio_min", "ratio_max")
    if x:
        ratio_ax.fill_between(x, low, high, color="C2", alpha=0.25, label="min–max")
        ratio_ax.plot(x, mean, marker=_marker(len(x)), markersize=3, color="C2", label="mean")
        ratio_ax.axhline(1.0, color="0.5", linestyle="--", linewidth=1, label="on-policy (1)")
        ratio_ax.legend(loc="best")
        _style(ratio_ax, "Importance ratio per step", step_label, "ratio π/π_old")
    elif _series(steps, "step", "reward_accuracy")[0]:
        line_panel(ratio_ax, "reward_accuracy", "Pair reward accuracy per step (h > 0)", "fraction of pairs",
                   "reward accuracy", "C2")
    else:
        _empty(ratio_ax, f"{name} logs no importance ratios")

    x, low, high = _series(steps, "step", "clip_frac_low", "clip_frac_high")
    if x:
        clip_ax.plot(x, low, marker=_marker(len(x)), markersize=3, color="C4", label="clipped low (A < 0)")
        clip_ax.plot(x, high, marker=_marker(len(x)), markersize=3, color="C5", label="clipped high (A > 0)")
        clip_ax.legend(loc="best")
        _style(clip_ax, "Clip fractions per step", step_label, "fraction clipped")
    elif _series(steps, "step", "margin_mean")[0]:
        line_panel(clip_ax, "margin_mean", "Pair margin per step", "margin mean", "margin mean", "C4")
    else:
        _empty(clip_ax, f"{name} logs no clip fractions")
    return fig


def _compare_figure(runs: dict[str, tuple[list[dict], list[dict]]], objectives: dict[str, str | None]) -> Figure:
    fig = _figure(16, 9)
    axes = fig.subplots(2, 3)
    fig.suptitle("Comparison: " + ", ".join(runs))
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}

    def curves(ax, x_key: str, y_key: str, scale: float, steps_panel: bool, combine=None) -> list[str]:
        """Plots one line per run that has the data; returns the labels plotted."""
        plotted = []
        for label, (rounds, steps) in runs.items():
            records = steps if steps_panel else rounds
            if combine is None:
                x, y = _series(records, x_key, y_key)
            else:
                x, *parts = _series(records, x_key, *y_key)
                y = [combine(*p) for p in zip(*parts)]
            if not x:
                continue
            ax.plot(x, [scale * v for v in y], marker=_marker(len(x)), markersize=3, color=colors[label], label=label)
            plotted.append(label)
        return plotted

    panels = [
        (axes[0, 0], "samples_total", "eval_accuracy", 100.0, False, None, "Eval accuracy vs samples generated",
         "samples generated (cumulative)", "eval accuracy (%)"),
        (axes[0, 1], "elapsed_seconds", "eval_accuracy", 100.0, False, None, "Eval accuracy vs wall time",
         "wall seconds since the run started", "eval accuracy (%)"),
        (axes[0, 2], "samples_total", "reward_mean", 1.0, False, None, "Reward mean vs samples generated",
         "samples generated (cumulative)", "reward mean"),
        (axes[1, 0], "step", "grad_norm", 1.0, True, None, "Gradient norm per step",
         "optimizer step", "grad norm (before clipping)"),
        (axes[1, 1], "step", ("clip_frac_low", "clip_frac_high"), 1.0, True, lambda a, b: a + b,
         "Clip fraction (low + high) per step", "optimizer step", "fraction clipped"),
    ]
    for ax, x_key, y_key, scale, steps_panel, combine, title, xlabel, ylabel in panels:
        if curves(ax, x_key, y_key, scale, steps_panel, combine):
            _style(ax, title, xlabel, ylabel, integer_x=steps_panel)
            if y_key == "eval_accuracy":
                ax.set_ylim(-2, 102)
        else:
            what = "clip fractions" if combine else f"'{y_key}'"
            _empty(ax, f"{title}\n\nno run logged {what}")

    ratio_ax = axes[1, 2]
    plotted = 0
    for label, (_, steps) in runs.items():
        x, low, high = _series(steps, "step", "ratio_min", "ratio_max")
        # log scale: a zero range (on-policy step) has no place on it and is left out
        points = [(s, hi - lo) for s, lo, hi in zip(x, low, high) if hi - lo > 0]
        if points:
            ratio_ax.plot(*zip(*points), marker=_marker(len(points)), markersize=3, color=colors[label], label=label)
            plotted += 1
    if plotted:
        ratio_ax.set_yscale("log")
        _style(ratio_ax, "Importance-ratio range per step", "optimizer step", "ratio max − min (log)")
    else:
        _empty(ratio_ax, "Importance-ratio range per step\n\nno run logged importance ratios")

    handles = [Line2D([], [], color=colors[label], marker="o", label=f"{label} ({objectives[label] or '?'})")
               for label in runs]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), title="run (objective)")
    return fig


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------

def _summary_markdown(run_dir: Path, rounds: list[dict], steps: list[dict], skipped: int,
                      objective: str | None) -> str:
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
    parts = [f"# Run report: {run_dir.name}", "", " · ".join(facts), "", _accuracy_line(acc), "", "## Rounds", ""]

    if rounds:
        headers = ["round", "eval acc (%)", "reward mean", "kept groups", "groups", "pairs", "samples",
                   "policy version", "seconds"]
        rows = [[r["round"], _pct(_num(r, "eval_accuracy")), _num(r, "reward_mean"), r.get("kept_groups"),
                 r.get("groups"), r.get("pairs"), r.get("samples"), r.get("policy_version"),
                 _seconds(_num(r, "wall_seconds"))]
                for r in rounds]
        parts += [markdown_table(headers, rows), "", "Round 0 evaluates the starting model; it trains nothing.", ""]
    else:
        parts += ["No round records yet.", ""]

    parts += ["## Training", ""]
    if steps:
        _, losses = _series(steps, "step", "loss")
        _, grad_norms = _series(steps, "step", "grad_norm")
        _, tokens_per_s = _series(steps, "step", "tokens_per_s")
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
    """Write progress.png, training.png and summary.md for a run into `out_dir` (default
    RUN/report/) and return that folder. A run without metrics.jsonl raises ValueError."""
    run_dir = Path(run_dir)
    rounds, steps, skipped = _read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    objective = _objective(rounds, steps)
    title = f"{run_dir.name} ({objective})" if objective else run_dir.name

    _save_figure(_progress_figure(rounds, title), out / "progress.png")
    _save_figure(_training_figure(rounds, steps, title, objective), out / "training.png")
    _write_text(out / "summary.md", _summary_markdown(run_dir, rounds, steps, skipped, objective)
                + table_counts_markdown(run_dir))
    return out


def report_compare(runs: dict[str, str | Path], out_dir: str | Path) -> Path:
    """Write compare.png and compare.md for runs given as {label: run folder}; returns out_dir.

    Panels that need ratio or clip statistics show only the runs that log them (grpo, gspo,
    gspo_token; not sft or pairwise). A run without metrics.jsonl raises ValueError.
    """
    if not runs:
        raise ValueError("report_compare: no runs given")
    loaded = {label: _read_metrics(path)[:2] for label, path in runs.items()}
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

    _save_figure(_compare_figure(loaded, objectives), out / "compare.png")
    parts = [f"# Comparison: {', '.join(runs)}", "", markdown_table(headers, rows), "",
             "gain = final − start eval accuracy, in percentage points; samples = responses generated over all "
             "rounds; wall seconds = elapsed since the run started; mean clip fraction = mean over steps of "
             "clip_frac_low + clip_frac_high (— where the objective logs no importance ratios: sft, pairwise).", ""]
    if len(samples) > 1:
        parts += ["Note: the runs generated different numbers of samples; read the accuracy-vs-samples panel "
                  "rather than the final accuracies.", ""]
    parts += ["![comparison of the runs](compare.png)", "", "Runs:", ""]
    parts += [f"- {label}: `{Path(path)}`" for label, path in runs.items()]
    _write_text(out / "compare.md", "\n".join(parts) + "\n")
    return out
