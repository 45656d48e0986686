"""pipelines/reports/run_report.py and pipelines/reports/plots.py: real metrics.jsonl files (resumed, cut by a kill),
real PNGs, table values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from pipelines.reports.markdown import markdown_table
from pipelines.reports.run_report import breakdown_line, load_metrics, report_compare, report_run
from tests.helpers import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def round_record(n: int, accuracy: float, samples_per_round: int = 64, **extra) -> dict:
    """A round record as the round loop writes it; round 0 only evaluates (training fields 0/null)."""
    trained = n > 0
    return {"event": "round", "round": n, "eval_accuracy": accuracy,
            "reward_mean": round(0.2 + 0.1 * n, 3) if trained else None,
            "kept_groups": 6 + n if trained else 0, "groups": 8 if trained else 0,
            "pairs": 10 * n if trained else 0, "samples": samples_per_round if trained else 0,
            "samples_total": samples_per_round * n, "policy_version": 2 * n,
            "wall_seconds": 10.0 + n if trained else 3.0, "elapsed_seconds": 3.0 + 11.5 * n,
            "gen_tokens_per_s": 900.0, "train_tokens_per_s": 400.0 if trained else 0.0, "objective": "grpo",
            **extra}


def step_record(step: int, objective: str, ratio_spread: float | None = 0.1, **extra) -> dict:
    record = {"event": "step", "step": step, "objective": objective, "loss": 1.0 / step, "grad_norm": 0.5 + step,
              "lr": 1e-5, "tokens_per_s": 400.0, "seconds": 0.2, "rows": 16, "tokens": 900,
              "rounds": [(step + 1) // 2]}
    if ratio_spread is not None:  # policy objectives only
        record.update(ratio_mean=1.0, ratio_min=1.0 - ratio_spread, ratio_max=1.0 + ratio_spread,
                      clip_frac_low=0.01 * step, clip_frac_high=0.02 * step, approx_kl=1e-4)
    if objective == "pairwise":
        record.update(reward_accuracy=0.6, margin_mean=0.3)
    record.update(extra)
    return record


def write_metrics(run_dir: Path, records: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


def resumed_grpo_run(run_dir: Path) -> Path:
    """Rounds 0-3 with 2 steps each; killed in round 2 after step 4 was logged, resumed (round 2
    and step 4 written again with other values), and killed mid-line while logging round 4."""
    records = [round_record(0, 0.20), step_record(1, "grpo"), step_record(2, "grpo"), round_record(1, 0.35),
               step_record(3, "grpo"), step_record(4, "grpo", grad_norm=99.0), round_record(2, 0.30),
               {"event": "generate", "round": 3},  # another event: ignored
               step_record(4, "grpo", grad_norm=4.5), round_record(2, 0.45, wall_seconds=17.25),
               step_record(5, "grpo"), step_record(6, "grpo"), round_record(3, 0.62)]
    return write_metrics(run_dir, records, tail='{"event": "round", "round": 4, "eval_accur')


def md_table(markdown: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose first header is `first_header`, as {header: cell}."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split(" | ")]
    headers = cells(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(headers, cells(line), strict=True)))
    return rows


def assert_png(path: Path, width: int, height: int) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (height, width)  # figsize x dpi: the figure size is fixed
    assert image.std() > 0.05  # something is drawn, not a blank canvas


@pytest.fixture(scope="module")
def grpo_report(tmp_path_factory) -> tuple[Path, Path]:
    run = resumed_grpo_run(tmp_path_factory.mktemp("report") / "run-grpo")
    return run, report_run(run)


def test_load_metrics_dedups_last_wins_sorts_and_skips_a_cut_line(tmp_path):
    rounds, steps = load_metrics(resumed_grpo_run(tmp_path / "run"))
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[2]["eval_accuracy"] == 0.45 and rounds[2]["wall_seconds"] == 17.25
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[3]["grad_norm"] == 4.5


def test_report_run_writes_valid_pngs_and_the_right_numbers(grpo_report):
    run, out = grpo_report
    assert out == run / "report"
    assert sorted(p.name for p in out.iterdir()) == ["data", "index.html", "progress.png", "summary.md",
                                                     "training.png"]  # no temp files
    assert_png(out / "progress.png", 9 * 120, 7 * 120)
    assert_png(out / "training.png", 12 * 120, 8 * 120)

    summary = (out / "summary.md").read_text()
    # start 20% -> final 62% -> best 62%: +42 points
    assert "start 20.0% (round 0) → final 62.0% (round 3) → best 62.0% (round 3); gain **+42.0 points**" in summary
    rows = md_table(summary, "round")
    assert [row["round"] for row in rows] == ["0", "1", "2", "3"]
    assert rows[0] == {"round": "0", "eval acc (%)": "20.0", "reward mean": "—", "kept groups": "0", "groups": "0",
                       "pairs": "0", "samples": "0", "policy version": "0", "seconds": "3.0"}
    # round 2 from the resumed run, not the killed one
    assert rows[2] == {"round": "2", "eval acc (%)": "45.0", "reward mean": "0.4", "kept groups": "8", "groups": "8",
                       "pairs": "20", "samples": "64", "policy version": "4", "seconds": "17.2"}
    training = md_table(summary, "steps")[0]
    assert training["steps"] == "6"
    assert training["mean grad norm"] == "4"  # mean of 1.5, 2.5, 3.5, 4.5 (resumed), 5.5, 6.5
    assert training["max grad norm"] == "6.5"  # the killed run's 99 is gone
    assert training["mean clip fraction"] == "0.105"  # mean over steps of 0.03 * step
    assert "1 unparsable line(s) skipped" in summary
    assert "](progress.png)" in summary and "](training.png)" in summary


def test_report_files_are_readable_by_everyone(grpo_report):
    _, out = grpo_report
    for name in ("progress.png", "training.png", "summary.md"):
        assert (out / name).stat().st_mode & 0o777 == 0o644, name  # not mkstemp's 0600


def test_reading_a_run_loads_neither_matplotlib_nor_torch():
    """The spec, the run-folder files and the report's reading and markdown are light; matplotlib
    comes with pipelines.reports.plots, imported only when a figure is drawn."""
    code = ("import sys, pipelines.reports.run_report, pipelines.spec, store.run_files; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'torch'}); "
            "assert not heavy, heavy; import pipelines.reports.plots; assert 'matplotlib' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_best_accuracy_is_reported_when_the_last_round_drops(tmp_path):
    run = write_metrics(tmp_path / "run", [round_record(0, 0.5), round_record(1, 0.75), round_record(2, 0.625)])
    summary = (report_run(run, tmp_path / "elsewhere") / "summary.md").read_text()
    assert not (run / "report").exists()
    assert "final 62.5% (round 2) → best 75.0% (round 1); gain **+12.5 points**" in summary


def test_rounds_without_eval_and_the_time_per_phase(tmp_path):
    """[eval] every = 2: rounds 1 and 3 record no accuracy; every round records its phases."""
    def phases(n):
        return {"startup": 2.0 if n == 0 else 0.0, "generate": 0.5, "score": 0.1, "filter": 0.1, "label": 0.1,
                "pair": 0.1, "train": 1.0, "checkpoint": 0.2, "reload": 0.1, "eval": 0.3 if n % 2 == 0 else 0.0,
                "other": 0.1}
    records = [round_record(n, None if n % 2 else 0.2 + 0.1 * n, phase_seconds=phases(n), model_seconds=1.5,
                            wall_seconds=sum(phases(n).values())) for n in range(5)]
    run = write_metrics(tmp_path / "run", records)
    summary = (report_run(run) / "summary.md").read_text()
    assert "start 20.0% (round 0) → final 60.0% (round 4) → best 60.0% (round 4); gain **+40.0 points**" in summary
    rows = md_table(summary, "round")
    assert [row["eval acc (%)"] for row in rows] == ["20.0", "—", "40.0", "—", "60.0"]
    times = md_table(summary, "phase")
    shares = {row["phase"]: (row["seconds"], row["share of wall (%)"]) for row in times}
    wall = sum(sum(phases(n).values()) for n in range(5))
    assert shares["wall"] == (f"{wall:.2f}", "100.0")
    assert shares["startup"] == ("2.00", f"{100 * 2.0 / wall:.1f}")
    assert shares["eval"] == ("0.90", f"{100 * 0.9 / wall:.1f}")
    assert shares["model work"] == ("7.50", f"{100 * 7.5 / wall:.1f}")
    assert shares["everything else"] == (f"{wall - 7.5:.2f}", f"{100 * (wall - 7.5) / wall:.1f}")
    per_round = md_table(summary.split("## Time")[1], "round")
    assert per_round[1]["generate"] == "0.50" and per_round[1]["eval"] == "0.00" and per_round[0]["startup"] == "2.00"
    assert per_round[2]["model work (%)"] == f"{100 * 1.5 / sum(phases(2).values()):.0f}"
    assert_png(run / "report" / "progress.png", 9 * 120, 7 * 120)


def test_multi_turn_rounds_get_a_tool_use_table(tmp_path):
    """Rounds with the multi-turn keys get a row each under "Tool use"; round 0 (eval only) and a
    single-turn run get none."""
    trajectories = {1: (0.25, 40, 3, 1.4, {"done": 60, "length": 4}), 2: (0.875, 90, 0, 2.0, {"done": 64})}
    records = [round_record(0, 0.1)] + [
        round_record(n, 0.5, tool_use_rate=rate, tool_calls=calls, tool_errors=errors, mean_turns=turns,
                     stop_reasons=stops) for n, (rate, calls, errors, turns, stops) in trajectories.items()]
    summary = (report_run(write_metrics(tmp_path / "run", records)) / "summary.md").read_text()
    rows = md_table(summary.split("## Tool use")[1], "round")
    assert [(r["round"], r["tool-use rate (%)"], r["tool calls"], r["tool errors"], r["stop reasons"]) for r in rows] \
        == [("1", "25.0", "40", "3", "done 60, length 4"), ("2", "87.5", "90", "0", "done 64")]
    single = (report_run(write_metrics(tmp_path / "single", records[:1] + [round_record(1, 0.5)])) /
              "summary.md").read_text()
    assert "## Tool use" not in single


def test_breakdown_line_sums_curation_and_leaves_out_zero_phases():
    record = {"wall_seconds": 2.0, "model_seconds": 1.5, "phase_seconds": {
        "startup": 0.0, "generate": 0.6, "score": 0.05, "filter": 0.02, "label": 0.02, "pair": 0.01, "train": 1.0,
        "checkpoint": 0.0, "reload": 0.1, "eval": 0.0, "other": 0.2}}
    assert breakdown_line(record) == ("2.00 s = generate 0.60 · curate 0.10 · train 1.00 · reload 0.10 · other 0.20"
                                      " | model work 75%")
    assert breakdown_line({"wall_seconds": 2.0}) is None  # a record written before phases


def test_report_run_before_any_round_or_step(tmp_path):
    """A run whose metrics file exists but holds only a cut line: the report says so, figures still valid."""
    out = report_run(write_metrics(tmp_path / "run", [], tail='{"event": "st'))
    summary = (out / "summary.md").read_text()
    assert "no round has an eval accuracy yet" in summary and "No step records yet." in summary
    assert_png(out / "progress.png", 9 * 120, 7 * 120)


def test_missing_metrics_file_is_an_error_naming_the_path(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match=str(tmp_path / "run" / "metrics.jsonl")):
        report_run(tmp_path / "run")
    with pytest.raises(ValueError, match="metrics.jsonl"):
        report_compare({"grpo": tmp_path / "run"}, tmp_path / "cmp")
    assert not (tmp_path / "run" / "report").exists() and not (tmp_path / "cmp").exists()


def test_report_compare_with_runs_lacking_ratio_stats(tmp_path, grpo_report):
    grpo_run, _ = grpo_report

    def run(name: str, objective: str, accuracies: list[float], ratio_spread: float | None) -> Path:
        records = []
        for n, acc in enumerate(accuracies):
            records.append(round_record(n, acc, objective=objective))
            if n < len(accuracies) - 1:
                records += [step_record(step, objective, ratio_spread) for step in (2 * n + 1, 2 * n + 2)]
        return write_metrics(tmp_path / name, records)

    runs = {"grpo": grpo_run, "gspo": run("gspo", "gspo", [0.2, 0.4, 0.5, 0.7], 3e-4),
            "pairwise": run("pairwise", "pairwise", [0.2, 0.3, 0.35, 0.4], None),
            "sft": run("sft", "sft", [0.2, 0.25, 0.3, 0.3], None)}
    out = report_compare(runs, tmp_path / "compare")
    assert out == tmp_path / "compare"
    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "compare.png"]
    assert_png(out / "compare.png", 16 * 120, 9 * 120)

    markdown = (out / "compare.md").read_text()
    rows = {row["label"]: row for row in md_table(markdown, "label")}
    assert list(rows) == ["grpo", "gspo", "pairwise", "sft"]
    assert rows["grpo"] == {"label": "grpo", "objective": "grpo", "start acc (%)": "20.0", "final acc (%)": "62.0",
                            "best acc (%)": "62.0", "gain (points)": "+42.0", "samples": "192",
                            "wall seconds": "37.5", "mean grad norm": "4", "mean clip fraction": "0.105"}
    assert rows["gspo"]["gain (points)"] == "+50.0" and rows["gspo"]["objective"] == "gspo"
    assert rows["sft"]["best acc (%)"] == "30.0" and rows["sft"]["gain (points)"] == "+10.0"
    for label in ("pairwise", "sft"):
        assert rows[label]["mean clip fraction"] == "—"
        assert rows[label]["mean grad norm"] == "4"
    assert "![comparison of the runs](compare.png)" in markdown
    assert "different numbers of samples" not in markdown  # same budget: 64 per round, 3 rounds


def test_report_compare_when_no_run_has_ratio_stats(tmp_path):
    run = write_metrics(tmp_path / "sft", [round_record(0, 0.1, objective="sft"), step_record(1, "sft", None),
                                           round_record(1, 0.2, samples_per_round=32, objective="sft")])
    out = report_compare({"sft": run}, tmp_path / "cmp")
    assert_png(out / "compare.png", 16 * 120, 9 * 120)
    assert md_table((out / "compare.md").read_text(), "label")[0]["gain (points)"] == "+10.0"


def test_markdown_table_formats_and_aligns():
    table = markdown_table(["name", "value", "count", "note"],
                           [["a|b", 0.41234, 3, None], ["c", 12.0, 10, "ok"], ["d", 3e-5, None, "x"],
                            ["e", 1234.5678, 7, True]])
    lines = table.splitlines()
    assert lines[0] == "| name | value | count | note |"
    assert lines[1] == "| --- | ---: | ---: | --- |"
    assert lines[2] == r"| a\|b | 0.4123 | 3 | — |"
    assert lines[3] == "| c | 12 | 10 | ok |"
    assert lines[4] == "| d | 3e-05 | — | x |"
    assert lines[5] == "| e | 1235 | 7 | yes |"
    with pytest.raises(ValueError, match="row 0 has 1 cells, expected 2"):
        markdown_table(["a", "b"], [[1]])


def test_training_png_gets_the_mismatch_row_in_decoupled_mode(tmp_path):
    mismatch = dict(mismatch_kl_k3=2e-5, old_behavior_gap=3e-3, old_behavior_gap_lag0=1e-3,
                    old_behavior_gap_lag1=4e-3, is_weight_mean=1.0, is_weight_max=1.2, is_truncated_frac=0.01)
    records = [round_record(0, 0.2), step_record(1, "grpo", **mismatch), step_record(2, "grpo", **mismatch),
               round_record(1, 0.3)]
    out = report_run(write_metrics(tmp_path / "run", records))
    assert_png(out / "training.png", 12 * 120, 12 * 120)  # a third row of panels
