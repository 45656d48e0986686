"""The commands that run and read whole runs: `train`, `run`, `init`, `verify`, `report` and
`compare`.

The flags of `train` are built from `training.config.TrainConfig` by `pipelines.cli.options`,
so each maps 1:1 to a spec field with the field's type, default and help text.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from pipelines.cli.app import (
    EXIT_BAD_INPUT,
    NO_WAIT,
    app,
    checked_run_folder,
    command_log,
    command_log_path,
    console,
    err_console,
    exit_codes,
    fail,
    local_run_folder,
    progress_bar,
    show_table,
    writer_lock,
)
from pipelines.cli.options import OVERRIDES, model_options
from store.storage import check_location, is_object_url
from store.verify import check_run
from training.config import TrainConfig


@app.command("train")
@model_options(TrainConfig)
def train_command(
    run: Path = typer.Argument(..., help="Run folder with curated tables."),
    steps: int = typer.Option(..., "--steps", help="Train until this optimizer step (total, across calls)."),
    model: Optional[Path] = typer.Option(None, "--model",
                                         help="Base model folder (needed when RUN has no checkpoint)."),
    config: Optional[Path] = typer.Option(None, "--config", help=escape("TOML file with a [train] section; the "
                                                                        "flags given override its keys.")),
    no_wait: bool = NO_WAIT,
    overrides: dict = OVERRIDES,
) -> None:
    """Train on the run's curated tables; checkpoints in RUN/checkpoints, one line per step in RUN/metrics.jsonl."""
    from pipelines.spec import load_section
    from training.distributed import close_process_group
    from training.trainer import train

    checked_run_folder(run)
    with exit_codes():
        cfg = load_section(TrainConfig, config, "train", overrides=overrides)
        command_log(run, "train")
        if cfg.strategy != "single" and cfg.nproc > 1 and "RANK" not in os.environ:
            with writer_lock(run, no_wait):  # held for the whole group; its rank 0 knows (GROUP_LOCK_ENV)
                raise typer.Exit(_torchrun(cfg.nproc, run))
        if cfg.strategy != "single" and os.environ.get("RANK", "0") != "0":
            train(run, cfg, steps=steps, model=model)  # rank 0 holds the lock for the group and prints
            close_process_group()
            return
        locked = os.environ.get(GROUP_LOCK_ENV) == str(run.resolve())
        with contextlib.nullcontext() if locked else writer_lock(run, no_wait):
            with progress_bar() as bar:
                task = bar.add_task(f"train {cfg.objective}", total=None)

                def progress(done: int, total: int, metrics: dict) -> None:
                    bar.update(task, completed=done, total=total,
                               description=f"train {cfg.objective} step {metrics['step']} loss {metrics['loss']:.4f}")

                result = train(run, cfg, steps=steps, model=model, progress=progress)
        close_process_group()
    if result.skipped:
        console.print(f"{run}: already at step {result.end_step} (>= --steps {steps}); nothing to do")
        return
    if result.plan is not None:
        console.print(f"trainer: {result.plan.describe()}")
    m = result.last_metrics
    show_table(f"{run}: train {cfg.objective}",
                ["steps", "rounds", "rows", "last loss", "grad norm", "tokens/s", "seconds", "checkpoint"],
                [[f"{result.start_step} -> {result.end_step}", ",".join(map(str, result.rounds)), str(result.rows),
                  f"{m.get('loss', float('nan')):.4f}", f"{m.get('grad_norm', float('nan')):.3f}",
                  f"{m.get('tokens_per_s', 0):,.0f}", f"{result.seconds:.1f}", str(result.checkpoint)]])


GROUP_LOCK_ENV = "GROUPFORGE_GROUP_LOCK"
"""Set by `groupforge train --nproc N` for the ranks it starts: the run whose lock it holds."""


def _torchrun(nproc: int, run: Path) -> int:
    """This same `groupforge train` command as `nproc` torchrun ranks on this machine; their
    exit code."""
    args, skip = [], False
    for arg in sys.argv[1:]:  # the ranks run under torchrun: --nproc is the launcher's (and torchrun's
        if skip or arg.startswith("--nproc="):  # argparse would take it for its --nproc-per-node)
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            args.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pipelines.cli", *args]
    return subprocess.run(cmd, env={**os.environ, GROUP_LOCK_ENV: str(run.resolve())}).returncode


def _parse_extra_rounds(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    if not text.startswith("+") or not text[1:].isdigit() or int(text[1:]) < 1:
        raise fail(f"--rounds {text!r}: expected +K (e.g. +3) to extend the run by K rounds; "
                    "set [run].rounds in the spec for the total", EXIT_BAD_INPUT)
    return int(text[1:])


_ROUND_COLUMNS = ["round", "eval acc", "reward mean", "kept groups", "pairs", "samples", "policy", "gen tok/s",
                  "train tok/s", "seconds"]


def _accuracy_text(rec: dict) -> str:
    """A round's eval accuracy in percent, or "-" for a round that did not evaluate."""
    accuracy = rec.get("eval_accuracy")
    return "-" if accuracy is None else f"{100 * accuracy:.1f}%"


def _pairs_text(rec: dict) -> str:
    """A round's pairs, or "-" when the loop ran no pair stage (`[run] pairs`)."""
    pairs = rec.get("pairs", 0)
    return "-" if pairs is None else str(pairs)


def _round_row(rec: dict) -> list[str]:
    reward = rec.get("reward_mean")
    return [str(rec["round"]), _accuracy_text(rec), "-" if reward is None else f"{reward:.3f}",
            str(rec.get("kept_groups", 0)), _pairs_text(rec), str(rec.get("samples", 0)),
            str(rec.get("policy_version", 0)), f"{rec.get('gen_tokens_per_s', 0):,.0f}",
            f"{rec.get('train_tokens_per_s', 0):,.0f}", f"{rec.get('wall_seconds', 0):.1f}"]


def turns_line(rec: dict) -> str | None:
    """A multi-turn round's trajectories in one line (None for a single-turn round): "tool use
    75%  tool calls 6 (1 error)  turns 2.50  stop done 3, max_turns 1"."""
    if rec.get("mean_turns") is None:
        return None
    errors = rec.get("tool_errors") or 0
    reasons = ", ".join(f"{reason} {count}" for reason, count in (rec.get("stop_reasons") or {}).items())
    return (f"tool use {100 * (rec.get('tool_use_rate') or 0):.0f}%  tool calls {rec.get('tool_calls') or 0} "
            f"({errors} error{'' if errors == 1 else 's'})  turns {rec['mean_turns']:.2f}  stop {reasons}")


def _run_one(spec: "Path | object", run_dir: Optional[str | Path], extra: Optional[int],
             no_wait: bool, overrides: list[str] = (), report: bool = False,
             own_log: bool = True) -> tuple[str | Path, list[dict]]:
    """Run one spec (a file, with `overrides`, or a PipelineSpec) to its last round, printing a
    line per round (and with `report`, writing RUN/report/); returns (run folder, round records).
    With `own_log`, the libraries' output goes to RUN/logs/run.log (else to the caller's log)."""
    from pipelines.spec import load_spec

    with exit_codes():
        parsed = load_spec(spec, overrides=overrides) if isinstance(spec, Path) else spec
        if run_dir is not None:
            check_location(str(run_dir), run=True)  # a mistyped URL: refused before the loop (and torch) loads
    folder = run_dir or Path("runs") / parsed.run.name
    where = f" (logs: {command_log_path(folder, 'run')})" if own_log and is_object_url(str(folder)) else ""
    console.print(f"[bold]{parsed.run.name}[/] ({parsed.train.objective}, {parsed.run.rounds} rounds) -> {folder}"
                  f"{where}", soft_wrap=True)
    if own_log:
        command_log(folder, "run")

    from pipelines.reports.run_report import breakdown_line

    def on_round(rec: dict) -> None:
        reward = rec.get("reward_mean")
        console.print(f"  round {rec['round']:>3}: eval acc {_accuracy_text(rec):>6}  reward "
                      f"{'-' if reward is None else f'{reward:.3f}'}  kept groups {rec.get('kept_groups', 0)}  "
                      f"pairs {_pairs_text(rec)}  policy {rec.get('policy_version', 0)}  "
                      f"{rec.get('wall_seconds', 0):.1f}s", highlight=False, soft_wrap=True)
        turns = turns_line(rec)
        if turns:
            console.print(f"             {turns}", highlight=False, soft_wrap=True)
        breakdown = breakdown_line(rec)
        if breakdown:
            console.print(f"             {breakdown}", highlight=False, soft_wrap=True)

    from pipelines.loop.run import run_pipeline

    with exit_codes():
        records = run_pipeline(parsed, run_dir=folder, extra_rounds=extra, wait=not no_wait,
                               log=lambda msg: err_console.print(f"[dim]{msg}[/]", highlight=False, soft_wrap=True),
                               on_round=on_round, report=report)
    return folder, records


@app.command("run")
def run_command(
    spec: Path = typer.Argument(..., help="Pipeline spec (TOML), e.g. pipelines/specs/toy-grpo.toml."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Run folder, or an object-store URL "
                                                                  "(s3://bucket/runs/x; default: runs/<run.name>)."),
    rounds: Optional[str] = typer.Option(None, "--rounds", help="+K: extend a finished run by K rounds."),
    overrides: list[str] = typer.Option([], "--set", metavar="SECTION.KEY=VALUE",
                                        help="Override a spec key (value as TOML), e.g. --set run.rounds=60; "
                                             "repeatable. RUN/spec.toml records the result."),
    no_wait: bool = NO_WAIT,
) -> None:
    """Run the round loop (generate -> curate -> train -> evaluate); rerun to resume after a kill."""
    from store.run_files import REPORT_DIR, load_best

    folder, records = _run_one(spec, run_dir, _parse_extra_rounds(rounds), no_wait, overrides, report=True)
    show_table(f"{folder}", _ROUND_COLUMNS, [_round_row(rec) for rec in records])
    evaluated = [rec["eval_accuracy"] for rec in records if rec.get("eval_accuracy") is not None]
    peaks = [rec["peak_rss_mib"] for rec in records if rec.get("peak_rss_mib")]
    peak = f"; peak RSS {max(peaks) / 1024:.1f} GiB" if peaks else ""
    if evaluated:
        start, final = evaluated[0], evaluated[-1]
        console.print(f"eval accuracy {100 * start:.1f}% -> {100 * final:.1f}% "
                      f"({100 * (final - start):+.1f} points) in {records[-1].get('elapsed_seconds', 0):.0f} s{peak}")
    elif peak:
        console.print(peak.removeprefix("; "))
    best = load_best(str(folder))
    if best is not None:
        console.print(f"best checkpoint: round {best.round}, eval accuracy {100 * best.eval_accuracy:.1f}% "
                      f"(policy_version {best.policy_version}): {str(folder).rstrip('/')}/{best.checkpoint}")
    console.print(f"report: {str(folder).rstrip('/')}/{REPORT_DIR}")


@app.command("init")
def init_command(
    model: Path = typer.Option(..., "--model", help="Model folder (Hugging Face, safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help="Train prompts (Parquet or JSON Lines)."),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="Held-out prompts with a reference column "
                                                                  "(default: the train file, with a comment)."),
    objective: str = typer.Option("grpo", "--objective", help="grpo | gspo | pairwise | sft"),
    out: Path = typer.Option(Path("spec.toml"), "--out", help="Where to write the spec."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Write a commented starter spec for your model and prompts: max_tokens from the model's greedy answers, the
    reward (math or exact_match with a reference column), the eval set, the round's size, lr and memory from the
    model and this machine, each with its reason; what it cannot decide is a TODO `run` refuses."""
    from pipelines.cli.init_spec import check_objective, starter_spec
    from pipelines.spec import load_spec
    from store.storage import write_atomic

    if out.exists() and not force:
        raise fail(f"{out} exists: give another --out, or --force to replace it", EXIT_BAD_INPUT)
    with exit_codes():
        check_objective(objective)  # before transformers loads: a mistyped flag is one line at once
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # init has no run folder for a log: transformers' notices are dropped
        hf_logging.disable_progress_bar()
        text = starter_spec(model, prompts, objective, eval_file, out)
        write_atomic(out, text)
    console.print(f"wrote {out}")
    try:
        load_spec(out)
    except ValueError as exc:  # its TODOs: the spec is written, the user fills them in
        err_console.print(f"[yellow]to do before `groupforge run {out}`:[/] {escape(str(exc))}")
        return
    console.print(f"check it with: groupforge run {out} --set run.rounds=1")


@app.command("verify")
def verify_command(run: str = typer.Argument(..., help="Run folder or object-store URL."),
                   deep: bool = typer.Option(False, "--deep",
                                             help="Also hash every file against its manifest's sha256.")) -> None:
    """Check that a run folder is what its log says: every listed file there with its size
    (and with --deep its sha256), no manifest edited or from a newer groupforge, no foreign
    Parquet file in a table folder; files of killed commits are counted. Exit 0 when it is, 2
    with the first problem otherwise."""
    with exit_codes():
        check_location(run, run=True)
    if not is_object_url(run) and not Path(run).is_dir():
        raise fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    with exit_codes():
        found = check_run(run, deep=deep)
    pending = (f"; {found.orphans} file(s) of killed commits, listed by no commit (the next writer removes them)"
               if found.orphans else "")
    pending += f"; {found.retired} file(s) of earlier versions kept" if found.retired else ""
    size = f"{found.bytes / 2**20:,.1f} MiB" if found.bytes >= 2**20 else f"{found.bytes / 2**10:,.1f} KiB"
    console.print(f"{run}: {found.manifests} manifests, {found.files} files ({size}) match"
                  f"{' byte for byte' if deep else ''}{pending}", soft_wrap=True)


@app.command("migrate")
def migrate_command(run: Path = typer.Argument(..., help="Run folder."),
                    no_wait: bool = typer.Option(False, "--no-wait", help="Exit 3 if another job holds the run.")
                    ) -> None:
    """Take a run folder written by an older groupforge (RUN/_manifests/) or by another tool (Parquet
    files in the table folders) into the run's log (Delta tables and `_commits`). Any writing command does the same
    on its own; this does only that. Exit 0 (also when there is nothing to do)."""
    from store.run_store import RunStore

    local_run_folder(run)
    if not run.is_dir():
        raise fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    store = RunStore(run)
    with exit_codes():
        done = "already migrated" if store.logged else "migrated"
        if done == "migrated":  # a run with a log is left as it is: nothing written
            with store.lock(wait=not no_wait):
                pass
    state = store.state
    console.print(f"{run}: {done}: {len(state.manifests)} manifests, {len(state.files)} files live")


@app.command("report")
def report_command(run: str = typer.Argument(..., help="Run folder or object-store URL.")) -> None:
    """Rebuild RUN/report/ (plots and summary.md) from RUN/metrics.jsonl."""
    from pipelines.reports.run_report import report_run

    checked_run_folder(run)
    with exit_codes():
        folder = report_run(run)
    console.print(f"wrote {folder}")


@app.command("compare")
def compare_command(
    specs: list[Path] = typer.Argument(..., help="Pipeline specs, or one compare file (pipelines/specs/compare.toml)."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="Folder for the runs and the report (default: the compare file's out, "
                                            "or runs/compare)."),
    quick: bool = typer.Option(False, "--quick", help="Run the compare file's [compare.quick] study instead (a small "
                                                      "one, in [compare.quick] out: by default out + '-quick')."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Study runs at a time, each in a worker process with "
                                                      "cpu_count / jobs torch threads (their wall seconds then "
                                                      "include the contention)."),
    no_wait: bool = NO_WAIT,
) -> None:
    """Compare objectives at equal data; write OUT/report/compare.{png,md}.

    Spec files, or a compare file without `seeds` and `sweep`: each spec runs once from the same
    start model. A compare file with them runs a study (pipelines/studies/study.py): a sweep per objective
    scored on a validation split of the train prompts, then each objective's best setting over
    the seeds, reported with 95% confidence intervals. Every run is resumable: a rerun skips the
    finished ones."""
    from pipelines.reports.run_report import report_compare
    from pipelines.studies.compare_spec import load_compare, load_compare_section

    with exit_codes():
        section = load_compare_section(specs[0], quick) if len(specs) == 1 else None
        if quick and section is None:
            raise ValueError("--quick needs one compare file")
    if section is not None and section.study:
        command_log(out or Path(section.out), "compare")
        from pipelines.studies.study import run_study
        from pipelines.studies.study_report import report_study

        def log(message: str) -> None:
            console.print(message, markup=False, highlight=False, soft_wrap=True)

        with exit_codes():
            report_dir = report_study(run_study(section, out or Path(section.out), jobs=jobs, wait=not no_wait,
                                                log=log))
    else:
        with exit_codes():
            parsed, default_out = load_compare(specs)
        out = out or default_out or Path("runs/compare")
        command_log(out, "compare")
        runs = {}
        for spec in parsed.values():
            folder, _ = _run_one(spec, out / spec.run.name, None, no_wait, own_log=False)
            runs[spec.run.name] = folder
        report_dir = report_compare(runs, out / "report")
    console.print((report_dir / "compare.md").read_text(), markup=False, highlight=False)
    console.print(f"report: {report_dir}")


