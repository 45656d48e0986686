"""The report's figures, drawn from the records of RUN/metrics.jsonl (see pipelines/reports/run_report.py).

    progress_figure   eval accuracy and reward mean per round (two panels)
    training_figure   loss, grad norm, importance-ratio band and clip fractions per optimizer
                      step (pairwise: pair reward accuracy and margin instead; a panel says so
                      where the objective logs no such statistic); in decoupled mode a third
                      row: the engine/trainer mismatch by staleness and the correction weights
    compare_figure    eval accuracy vs samples and vs wall seconds, reward mean vs samples,
                      grad norm, clip fraction (low + high) and ratio range per step, one
                      colour per run
    study_accuracy_figure      a study's eval accuracy vs samples, wall seconds and steps: mean
                               over seeds with its 95% CI band (pipelines/studies/study_report.py)
    study_measurements_figure  a study's grad norm, clip fraction, zero-advantage fraction,
                               gradient signal and noise per step and SNR per round, over seeds

Figures are drawn on `matplotlib.figure.Figure` with the Agg canvas: no pyplot state, no
global backend switch, nothing left open after a call. This is the only module that imports
matplotlib; pipelines.reports.run_report imports it when it draws, so reading a run stays light.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from pipelines.reports.run_report import number, series
from store.storage import write_atomic

DPI = 120


def save_figure(fig: Figure, path: Path) -> None:
    """The figure as a PNG at `path`, written atomically (a reader never sees half a PNG)."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


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


def progress_figure(rounds: list[dict], title: str) -> Figure:
    fig = _figure(9, 7)
    acc_ax, reward_ax = fig.subplots(2, 1, sharex=True)
    fig.suptitle(title)
    x, acc = series(rounds, "round", "eval_accuracy")
    if x:
        acc_ax.plot(x, [100 * a for a in acc], marker="o", color="C0", label="eval accuracy")
        acc_ax.axhline(100 * acc[0], color="0.5", linestyle="--", linewidth=1,
                       label=f"start (round {int(x[0])}): {100 * acc[0]:.1f}%")
        acc_ax.set_ylim(-2, 102)
        acc_ax.legend(loc="lower right")
        _style(acc_ax, "Eval accuracy per round (greedy, eval set)", "", "eval accuracy (%)")
    else:
        _empty(acc_ax, "no round has an eval accuracy yet")
    x, reward = series(rounds, "round", "reward_mean")
    if x:
        reward_ax.plot(x, reward, marker="o", color="C1", label="reward mean of sampled responses")
        reward_ax.legend(loc="lower right")
        _style(reward_ax, "Reward mean per round", "round", "reward mean")
    else:
        _empty(reward_ax, "no round has a reward mean yet (round 0 only evaluates)")
    return fig


def _round_ends(ax, rounds: list[dict], label: bool) -> None:
    """Dotted lines at the policy version each training round ended with."""
    ends = sorted({v for r in rounds if r.get("round", 0) > 0 and (v := number(r, "policy_version"))})
    for i, end in enumerate(ends):
        ax.axvline(end, color="0.6", linestyle=":", linewidth=1, label="end of a round" if label and i == 0 else None)


MISMATCH_KEYS = ("mismatch_kl_k3", "old_behavior_gap_lag0", "old_behavior_gap_lag1", "old_behavior_gap_lag2+")
"""Decoupled mode's step metrics (training.correction): the engine/trainer mismatch."""


def training_figure(rounds: list[dict], steps: list[dict], title: str, objective: str | None) -> Figure:
    decoupled = any(key in step for step in steps for key in MISMATCH_KEYS)
    fig = _figure(12, 12 if decoupled else 8)
    axes = fig.subplots(3 if decoupled else 2, 2)
    fig.suptitle(title)
    name = objective or "this objective"
    step_label = "optimizer step (policy version)"

    def line_panel(ax, key: str, panel_title: str, ylabel: str, label: str, color: str) -> None:
        x, y = series(steps, "step", key)
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
    x, mean, low, high = series(steps, "step", "ratio_mean", "ratio_min", "ratio_max")
    if x:
        ratio_ax.fill_between(x, low, high, color="C2", alpha=0.25, label="min–max")
        ratio_ax.plot(x, mean, marker=_marker(len(x)), markersize=3, color="C2", label="mean")
        ratio_ax.axhline(1.0, color="0.5", linestyle="--", linewidth=1, label="on-policy (1)")
        ratio_ax.legend(loc="best")
        _style(ratio_ax, "Importance ratio per step", step_label, "ratio π/π_old")
    elif series(steps, "step", "reward_accuracy")[0]:
        line_panel(ratio_ax, "reward_accuracy", "Pair reward accuracy per step (h > 0)", "fraction of pairs",
                   "reward accuracy", "C2")
    else:
        _empty(ratio_ax, f"{name} logs no importance ratios")

    x, low, high = series(steps, "step", "clip_frac_low", "clip_frac_high")
    if x:
        clip_ax.plot(x, low, marker=_marker(len(x)), markersize=3, color="C4", label="clipped low (A < 0)")
        clip_ax.plot(x, high, marker=_marker(len(x)), markersize=3, color="C5", label="clipped high (A > 0)")
        clip_ax.legend(loc="best")
        _style(clip_ax, "Clip fractions per step", step_label, "fraction clipped")
    elif series(steps, "step", "margin_mean")[0]:
        line_panel(clip_ax, "margin_mean", "Pair margin per step", "margin mean", "margin mean", "C4")
    else:
        _empty(clip_ax, f"{name} logs no clip fractions")
    if decoupled:
        _mismatch_panels(axes[2, 0], axes[2, 1], rounds, steps, step_label)
    return fig


def _mismatch_panels(gap_ax, weight_ax, rounds: list[dict], steps: list[dict], step_label: str) -> None:
    """Decoupled mode: KL(behavior || old) and |old - behavior| by rounds of staleness; the
    rollout correction weights and the share they truncate or mask."""
    for key, label, color in (("mismatch_kl_k3", "KL(behavior || old), k3", "C0"),
                              ("old_behavior_gap_lag0", "|old - behavior|, this round", "C1"),
                              ("old_behavior_gap_lag1", "|old - behavior|, 1 round stale", "C2"),
                              ("old_behavior_gap_lag2+", "|old - behavior|, 2+ rounds stale", "C3")):
        x, y = series(steps, "step", key)
        if x:
            gap_ax.plot(x, y, marker=_marker(len(x)), markersize=3, color=color, label=label)
    _round_ends(gap_ax, rounds, label=False)
    gap_ax.legend(loc="best")
    _style(gap_ax, "Engine vs trainer mismatch per step", step_label, "nats (per token)")
    x, mean, top = series(steps, "step", "is_weight_mean", "is_weight_max")
    if not x:
        _empty(weight_ax, "rollout_correction is off")
        return
    weight_ax.plot(x, mean, marker=_marker(len(x)), markersize=3, color="C0", label="weight mean")
    weight_ax.plot(x, top, marker=_marker(len(x)), markersize=3, color="C3", label="weight max (before cap)")
    weight_ax.axhline(1.0, color="0.5", linestyle="--", linewidth=1)
    share = weight_ax.twinx()
    for key, label in (("is_truncated_frac", "truncated"), ("is_masked_frac", "masked")):
        x, y = series(steps, "step", key)
        if x:
            share.plot(x, y, color="C4", linestyle=":", label=f"{label} (right)")
            share.set_ylabel(f"fraction {label}")
    lines = weight_ax.get_legend_handles_labels()
    extra = share.get_legend_handles_labels()
    weight_ax.legend(lines[0] + extra[0], lines[1] + extra[1], loc="best")
    _style(weight_ax, "Rollout correction weights per step", step_label, "weight old/behavior")


def compare_figure(runs: dict[str, tuple[list[dict], list[dict]]], objectives: dict[str, str | None]) -> Figure:
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
                x, y = series(records, x_key, y_key)
            else:
                x, *parts = series(records, x_key, *y_key)
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
        x, low, high = series(steps, "step", "ratio_min", "ratio_max")
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


# -- comparison studies (pipelines/studies/study_report.py) -------------------------------------------

STUDY_AXES = {"samples": ("samples generated (cumulative)", "equal axis"),
              "seconds": ("wall seconds since the run started", "for reference"),
              "steps": ("optimizer steps (policy version)", "for reference")}


def _band(ax, x: list[float], intervals: list, color: str, label: str, scale: float = 1.0,
          markers: bool = True) -> None:
    """The mean as a line and, where the points have one, the 95% CI as a shaded band."""
    ax.plot(x, [scale * iv.mean for iv in intervals], marker=_marker(len(x)) if markers else None, markersize=3,
            color=color, label=label)
    shaded = [(xi, iv) for xi, iv in zip(x, intervals) if iv.half is not None]
    if shaded:
        ax.fill_between([p[0] for p in shaded], [scale * p[1].low for p in shaded],
                        [scale * p[1].high for p in shaded], color=color, alpha=0.2, linewidth=0)


def study_accuracy_figure(bands: dict[str, dict[str, tuple[list[float], list]]], marks: dict[str, float],
                          n_seeds: int) -> Figure:
    """Eval accuracy vs samples, wall seconds and steps: per objective the mean over seeds and
    its 95% CI band; `marks` draws the equal wall time and equal steps as dashed lines."""
    fig = _figure(18, 5.5)
    axes = fig.subplots(1, 3)
    fig.suptitle(f"Eval accuracy, mean and 95% CI over {n_seeds} seeds")
    colors = {name: f"C{i % 10}" for i, name in enumerate(bands)}
    for ax, (axis, (xlabel, role)) in zip(axes, STUDY_AXES.items()):
        drawn = 0
        for name, curves in bands.items():
            x, intervals = curves.get(axis, ([], []))
            if x:
                _band(ax, x, intervals, colors[name], name, scale=100.0, markers=axis != "seconds")
                drawn += 1
        if not drawn:
            _empty(ax, f"no eval points on the {axis} axis")
            continue
        if axis in marks:
            ax.axvline(marks[axis], color="0.4", linestyle="--", linewidth=1, label=f"compared at {marks[axis]:.4g}")
        ax.set_ylim(-2, 102)
        ax.legend(loc="lower right")
        _style(ax, f"Eval accuracy vs {axis} ({role})", xlabel, "eval accuracy (%)", integer_x=axis != "seconds")
    return fig


STUDY_MEASURES = (("grad_norm", "Gradient norm (before clipping) per step", "grad norm"),
                  ("clip_frac", "Clip fraction (low + high) per step", "fraction clipped"),
                  ("zero_adv_frac", "Rows with zero advantage per step", "fraction of rows"),
                  ("grad_signal", "Gradient signal |E G|^2 per step (unbiased)", "signal"),
                  ("grad_noise", "Gradient noise tr Sigma per step", "noise"),
                  ("grad_snr", "Gradient SNR per round\n(signal, noise averaged over its steps and seeds first)",
                   "SNR"))


def study_measurements_figure(measures: dict[str, dict[str, tuple[list[float], list]]], n_seeds: int) -> Figure:
    """Per optimizer step, each objective's mean over seeds (and CI band) of the STUDY_MEASURES;
    a panel says so when no objective logged its statistic."""
    fig = _figure(18, 9)
    axes = fig.subplots(2, 3).flatten()
    fig.suptitle(f"Per-step measurements, mean over {n_seeds} seeds")
    colors = {name: f"C{i % 10}" for i, name in enumerate(measures)}
    for ax, (key, title, ylabel) in zip(axes, STUDY_MEASURES):
        drawn = [name for name, by_key in measures.items() if key in by_key]
        if not drawn:
            hint = " ([train] grad_noise = true, 2+ micro-batches)" if key.startswith("grad_") and key != "grad_norm" \
                else ""
            _empty(ax, f"{title}\n\nno objective logged '{key}'{hint}")
            continue
        for name in drawn:
            x, intervals = measures[name][key]
            _band(ax, x, intervals, colors[name], name)
        ax.legend(loc="best")
        _style(ax, title, "round" if key == "grad_snr" else "optimizer step", ylabel)
    return fig


def ratio_spread_figure(spreads: dict[str, list[dict]]) -> Figure:
    """Token vs sequence importance-ratio std against mean response length, one colour per
    objective (solid: token ratios, dashed: sequence ratios); rows from
    ratio_spread.pooled_spread."""
    fig = _figure(8, 5)
    ax = fig.subplots()
    for i, (name, buckets) in enumerate(spreads.items()):
        x = [b["mean_length"] for b in buckets]
        ax.plot(x, [b["token_ratio_std"] for b in buckets], "-o", color=f"C{i % 10}", label=f"{name}: token ratios")
        ax.plot(x, [b["seq_ratio_std"] for b in buckets], "--s", color=f"C{i % 10}",
                label=f"{name}: sequence ratios")
    ax.legend(loc="best")
    _style(ax, "Importance-ratio spread by response length", "mean response tokens (length bucket)",
           "std of the ratio")
    return fig
