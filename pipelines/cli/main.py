"""`groupforge ...`: the command line; no hidden globals.

The flags of `generate` and `train` are built from the pydantic models they fill
(`curation.generate.base.SamplingConfig` and `GeneratorConfig`, `training.config.TrainConfig`)
by `pipelines.cli.options`, so each maps 1:1 to a spec field with the field's type, default
and help text.

Exit codes: 0 ok, 2 bad input (a table, file or flag is wrong: the message says which),
3 the run is locked by another job (with --no-wait), 1 anything unexpected.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from curation.errors import JobError, NoSpaceError, is_no_space, no_space_error
from curation.generate.base import GeneratorConfig, SamplingConfig
from curation.store.run_store import RunLockedError, RunStore
from curation.store.verify import check_run
from pipelines.cli.options import OVERRIDES, build, model_options
from pipelines.toy.build import VARIANTS, ToyConfig
from training.config import TrainConfig

EXIT_BAD_INPUT = 2
EXIT_LOCKED = 3
EXIT_JOB = 1
EXIT_NO_SPACE = 4
DEBUG_ENV = "GROUPFORGE_DEBUG"  # set by --debug: errors keep their tracebacks

app = typer.Typer(add_completion=False, no_args_is_help=True, help="groupforge: table-first GRPO/GSPO post-training.")
toy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The embedded toy task and model.")
app.add_typer(toy_app, name="toy")
console = Console()
err_console = Console(stderr=True)


def _fail(message: str, code: int) -> "typer.Exit":
    # escaped: a message may quote TOML like "[filte]", which rich would take for markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def _exit_codes() -> Iterator[None]:
    """Bad input (a table, file, flag or spec: SchemaError and pydantic's ValidationError are
    ValueErrors) -> one error line, exit 2; a run locked by another job -> exit 3; a job that
    cannot go on (curation.errors.JobError) -> one error line, exit 1; a full disk -> one error
    line naming the folder, exit 4. With --debug (GROUPFORGE_DEBUG) every error keeps its traceback."""
    try:
        yield
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        if isinstance(exc, NoSpaceError) or is_no_space(exc):  # a full disk, whoever wrote
            message = str(exc) if isinstance(exc, NoSpaceError) else str(no_space_error(getattr(exc, "filename", None)))
            raise _fail(message, EXIT_NO_SPACE) from None
        if isinstance(exc, (FileNotFoundError, ValueError)):
            raise _fail(str(exc), EXIT_BAD_INPUT) from None
        if isinstance(exc, RunLockedError):
            raise _fail(str(exc), EXIT_LOCKED) from None
        if isinstance(exc, JobError):
            raise _fail(str(exc), EXIT_JOB) from None
        raise


def _print_version(value: bool) -> None:
    if value:
        from groupforge import __version__

        console.print(f"groupforge {__version__}")
        raise typer.Exit()


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show the traceback of every error (also: "
                                                                 f"{DEBUG_ENV}=1)."),
             version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print groupforge's version and exit.")) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


def _run_folder(run: Path) -> Path:
    """`run`, checked against its manifests (curation/store/verify.py) before a command reads it."""
    if not run.is_dir():
        raise _fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    with _exit_codes():
        check_run(run)
    return run


def _lock(run: Path, no_wait: bool):
    """The run's writer lock, waiting (and saying so) unless --no-wait."""
    return RunStore(run).lock(wait=not no_wait, on_wait=lambda msg: err_console.print(f"[yellow]waiting:[/] {msg}"))


def _show_table(title: str, columns: list[str], rows: list[list[str]], left: tuple[str, ...] = ()) -> None:
    """A table of text cells on stdout: a rich table when the console is wide enough for every
    cell, else the same cells as plain aligned text, so a pipe or a narrow terminal never gets
    a number cut to "16,9…" (lines longer than the terminal wrap instead)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    if console.measure(table, options=console.options.update(max_width=1 << 16)).maximum <= console.width:
        console.print(table)
        return
    widths = [max(len(cell) for cell in cells) for cells in zip(columns, *rows)]
    lines = [title] + ["  ".join(cell.ljust(w) if column in left else cell.rjust(w)
                                 for cell, w, column in zip(cells, widths, columns)).rstrip()
                       for cells in [columns, *rows]]
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=False,
    )


@app.command()
@model_options(SamplingConfig, GeneratorConfig, aliases={"group_size": ["-G"]})
def generate(
    model: Path = typer.Option(..., "--model", help="Hugging Face model folder (safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help="Parquet or JSONL file with a 'prompt' or 'messages' column."),
    out: Path = typer.Option(..., "--out", help="Run folder to write tables into."),
    round: int = typer.Option(0, "--round", help="Round number (hive partition round=<n>)."),
    force: bool = typer.Option(False, "--force", help="Regenerate even if the round is up to date."),
    no_wait: bool = typer.Option(False, "--no-wait",
                                 help="Exit (code 3) instead of waiting when another job holds the run."),
    overrides: dict = OVERRIDES,
) -> None:
    """Sample G responses per prompt and write samples (with behavior_logprobs) to RUN/samples/round=<n>/."""
    from curation.generate.base import load_prompts
    from curation.generate.stage import generate as run_generate
    from curation.generate.stage import resolve_backend

    if not (model / "config.json").is_file():
        raise _fail(f"--model {model}: not a Hugging Face model folder (no config.json)", EXIT_BAD_INPUT)
    with _exit_codes():
        sampling = build(SamplingConfig, overrides)
        settings = build(GeneratorConfig, overrides)
        load_prompts(prompts)  # fail on a bad prompts file before any lock, generator or progress bar
        backend = resolve_backend(settings.backend, model)
        with _lock(out, no_wait):
            with _progress() as bar:
                task = bar.add_task(f"generate round {round}", total=None)
                result = run_generate(
                    out, prompts, sampling, model=model, backend=backend, round=round, force=force,
                    chunk_prompts=settings.chunk_prompts,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                    generator_kwargs=settings.generator_kwargs(backend),
                )
    if result.skipped:
        m = result.manifest
        console.print(
            f"round {round} is up to date (manifest {out}/_manifests/generate-round={round}.json, "
            f"{m.get('rows_out')} samples from {m.get('created_at')}); nothing to do. Use --force to regenerate."
        )
        return
    tokens_per_s = result.response_tokens / result.sample_seconds if result.sample_seconds else 0.0
    _show_table(f"generate round {round}", ["prompts", "rejected (too long)", "samples", "response tokens",
                                            "resumed chunks", "seconds", "sampling tokens/s"],
                [[str(result.prompts), str(result.rejected_prompts), str(result.samples), str(result.response_tokens),
                  str(result.resumed_chunks), f"{result.seconds:.1f}", f"{tokens_per_s:,.0f}"]])


@app.command()
def inspect(
    run: Path = typer.Argument(..., help="Run folder."),
    rows: int = typer.Option(3, "--rows", help="Example rows to show per table."),
    stages: bool = typer.Option(False, "--stages", help="Print the stage graph instead: each stage, the tables "
                                                          "it reads and writes, its last run, rows in and out."),
) -> None:
    """Rows per table and round, stage manifests and example rows; with --stages, the stage graph."""
    from pipelines.reports import inspect_run as inspect_module

    _run_folder(run)
    with _exit_codes():
        if stages:
            inspect_module.print_stage_graph(run, console)
        else:
            inspect_module.inspect_run(run, rows, console)


def _curate(stages: tuple[str, ...], run: Path, only_round: Optional[int], config: Optional[Path], force: bool,
            no_wait: bool) -> None:
    """Run curation stages over rounds under the run's lock, then print one summary table."""
    from curation.stages.runner import run_stage
    from pipelines.loop.curate import load_curation_spec, rounds_to_process

    _run_folder(run)
    reports = []
    with _exit_codes():
        spec = load_curation_spec(config)
        rounds = rounds_to_process(run, only_round)
        with _lock(run, no_wait):
            with _progress() as bar:
                task = bar.add_task("curate", total=len(rounds) * len(stages))
                for round in rounds:
                    for stage in stages:
                        bar.update(task, description=f"{stage} round {round}")
                        reports.append(run_stage(stage, run, round, getattr(spec, stage), force=force))
                        bar.advance(task)
    rows = []
    for rep in reports:
        drops = ", ".join(f"{k}={v}" for k, v in sorted(rep.drops.items())) or "-"
        rows.append([rep.stage, str(rep.round), str(rep.rows_in), str(rep.rows_out), str(sum(rep.drops.values())),
                     drops if not rep.skipped else "up to date (skipped)", f"{rep.seconds:.2f}"])
    _show_table(f"{run}: curation", ["stage", "round", "rows in", "rows out", "dropped", "drops by reason", "seconds"],
                rows, left=("stage", "drops by reason"))


_ROUND = typer.Option(None, "--round", help="Only this round (default: every round with samples).")
_CONFIG = typer.Option(None, "--config", help=escape("TOML spec with [score] [filter] [label] [pair] sections."))
_FORCE = typer.Option(False, "--force", help="Rerun even if up to date.")
_NO_WAIT = typer.Option(False, "--no-wait", help="Exit (code 3) instead of waiting for another job's lock.")


_CURATE_COMMANDS = {
    "score": (("score",), "Apply reward functions: RUN/scores (one column per reward + the weighted `reward`)."),
    "filter": (("filter",), "Drop zero-variance groups, duplicates, ... : every dropped row lands in RUN/rejects "
                            "with a reason."),
    "label": (("label",), "Group statistics and advantages: RUN/groups."),
    "pair": (("pair",), "Preference pairs inside groups, with soft labels: RUN/pairs."),
    "curate": (("score", "filter", "label", "pair"), "score, filter, label and pair in order (defaults: "
               "exact_match, zero-variance and duplicate filters, grpo advantages, max_min soft-label pairs)."),
}


def _curate_command(stages: tuple[str, ...], doc: str):
    def command(run: Path = typer.Argument(..., help="Run folder."), round: Optional[int] = _ROUND,
                config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = _NO_WAIT) -> None:
        _curate(stages, run, round, config, force, no_wait)

    command.__doc__ = doc
    return command


for _name, (_stages, _doc) in _CURATE_COMMANDS.items():
    app.command(_name)(_curate_command(_stages, _doc))


@app.command()
def export(
    run: Path = typer.Argument(..., help="Run folder."),
    format: str = typer.Option("preference", "--format", help="preference | prompt_only | unpaired | sft"),
    style: str = typer.Option("standard", "--style", help="standard (text) | conversational (messages)"),
    round: Optional[list[int]] = typer.Option(None, "--round", help="Rounds to export (repeatable; default all)."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="Parquet file (default RUN/exports/<format>-<style>.parquet)."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="REPO",
                                              help="Also push the export and its card to this Hugging Face dataset "
                                                   "repo (private unless --public), with datasets' push_to_hub."),
    public: bool = typer.Option(False, "--public", help="With --push-to-hub: a public repo."),
) -> None:
    """Write a TRL-format dataset (Parquet, loadable with datasets.load_dataset) and the folder's dataset card
    (README.md: features, splits, row counts, provenance from the run's manifests)."""
    from pydantic import ValidationError

    from curation.stages.export import ExportConfig
    from curation.stages.export import run_with_card as run_export

    _run_folder(run)
    try:
        cfg = ExportConfig(format=format, style=style, rounds=round or None)
    except ValidationError as exc:
        raise _fail("; ".join(f"--{e['loc'][0]}: {e['msg']}" for e in exc.errors()), EXIT_BAD_INPUT) from None
    with _exit_codes():
        path, rows, card = run_export(run, cfg, out)
    console.print(f"wrote {rows} rows ({format}, {style}) to {path}")
    if card is None:
        err_console.print(f"[yellow]warning:[/] {path.parent / 'README.md'} was not written by groupforge: "
                          "left as it is, no dataset card written")
    else:
        console.print(f"dataset card: {card}")
    if push_to_hub:
        from curation.card import push

        with _exit_codes():
            url = push(path, push_to_hub, private=not public)
        console.print(f"pushed to {url}")


@app.command()
@model_options(TrainConfig)
def train(
    run: Path = typer.Argument(..., help="Run folder with curated tables."),
    steps: int = typer.Option(..., "--steps", help="Train until this optimizer step (total, across calls)."),
    model: Optional[Path] = typer.Option(None, "--model",
                                         help="Base model folder (needed when RUN has no checkpoint)."),
    config: Optional[Path] = typer.Option(None, "--config", help=escape("TOML file with a [train] section; the "
                                                                        "flags given override its keys.")),
    no_wait: bool = _NO_WAIT,
    overrides: dict = OVERRIDES,
) -> None:
    """Train on the run's curated tables; checkpoints in RUN/checkpoints, one line per step in RUN/metrics.jsonl."""
    from pipelines.spec import load_section
    from training.distributed import close_process_group
    from training.trainer import train as run_train

    _run_folder(run)
    with _exit_codes():
        cfg = load_section(TrainConfig, config, "train", overrides=overrides)
        if cfg.strategy != "single" and cfg.nproc > 1 and "RANK" not in os.environ:
            with _lock(run, no_wait):  # held for the whole group; its rank 0 knows (GROUP_LOCK_ENV)
                raise typer.Exit(_torchrun(cfg.nproc, run))
        if cfg.strategy != "single" and os.environ.get("RANK", "0") != "0":
            run_train(run, cfg, steps=steps, model=model)  # rank 0 holds the lock for the group and prints
            close_process_group()
            return
        locked = os.environ.get(GROUP_LOCK_ENV) == str(run.resolve())
        with contextlib.nullcontext() if locked else _lock(run, no_wait):
            with _progress() as bar:
                task = bar.add_task(f"train {cfg.objective}", total=None)

                def progress(done: int, total: int, metrics: dict) -> None:
                    bar.update(task, completed=done, total=total,
                               description=f"train {cfg.objective} step {metrics['step']} loss {metrics['loss']:.4f}")

                result = run_train(run, cfg, steps=steps, model=model, progress=progress)
        close_process_group()
    if result.skipped:
        console.print(f"{run}: already at step {result.end_step} (>= --steps {steps}); nothing to do")
        return
    m = result.last_metrics
    _show_table(f"{run}: train {cfg.objective}",
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
        raise _fail(f"--rounds {text!r}: expected +K (e.g. +3) to extend the run by K rounds; "
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


def _run_one(spec: "Path | object", run_dir: Optional[Path], extra: Optional[int],
             no_wait: bool, overrides: list[str] = (), report: bool = False) -> tuple[Path, list[dict]]:
    """Run one spec (a file, with `overrides`, or a PipelineSpec) to its last round, printing a
    line per round (and with `report`, writing RUN/report/); returns (run folder, round records)."""
    from pipelines.loop.run import run_pipeline
    from pipelines.spec import load_spec

    with _exit_codes():
        parsed = load_spec(spec, overrides=overrides) if isinstance(spec, Path) else spec
    folder = run_dir or Path("runs") / parsed.run.name
    console.print(f"[bold]{parsed.run.name}[/] ({parsed.train.objective}, {parsed.run.rounds} rounds) -> {folder}")

    from pipelines.reports.run_report import breakdown_line

    def on_round(rec: dict) -> None:
        reward = rec.get("reward_mean")
        console.print(f"  round {rec['round']:>3}: eval acc {_accuracy_text(rec):>6}  reward "
                      f"{'-' if reward is None else f'{reward:.3f}'}  kept groups {rec.get('kept_groups', 0)}  "
                      f"pairs {_pairs_text(rec)}  policy {rec.get('policy_version', 0)}  "
                      f"{rec.get('wall_seconds', 0):.1f}s", highlight=False, soft_wrap=True)
        breakdown = breakdown_line(rec)
        if breakdown:
            console.print(f"             {breakdown}", highlight=False, soft_wrap=True)

    with _exit_codes():
        records = run_pipeline(parsed, run_dir=folder, extra_rounds=extra, wait=not no_wait,
                               log=lambda msg: err_console.print(f"[dim]{msg}[/]", highlight=False, soft_wrap=True),
                               on_round=on_round, report=report)
    return folder, records


@app.command("run")
def run_(
    spec: Path = typer.Argument(..., help="Pipeline spec (TOML), e.g. pipelines/specs/toy-grpo.toml."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run folder (default: runs/<run.name>)."),
    rounds: Optional[str] = typer.Option(None, "--rounds", help="+K: extend a finished run by K rounds."),
    overrides: list[str] = typer.Option([], "--set", metavar="SECTION.KEY=VALUE",
                                        help="Override a spec key (value as TOML), e.g. --set run.rounds=60; "
                                             "repeatable. RUN/spec.toml records the result."),
    no_wait: bool = _NO_WAIT,
) -> None:
    """Run the round loop (generate -> curate -> train -> evaluate); rerun to resume after a kill."""
    from curation.store.runlog import REPORT_DIR

    folder, records = _run_one(spec, run_dir, _parse_extra_rounds(rounds), no_wait, overrides, report=True)
    _show_table(f"{folder}", _ROUND_COLUMNS, [_round_row(rec) for rec in records])
    evaluated = [rec["eval_accuracy"] for rec in records if rec.get("eval_accuracy") is not None]
    if evaluated:
        start, final = evaluated[0], evaluated[-1]
        console.print(f"eval accuracy {100 * start:.1f}% -> {100 * final:.1f}% "
                      f"({100 * (final - start):+.1f} points) in {records[-1].get('elapsed_seconds', 0):.0f} s")
    console.print(f"report: {folder / REPORT_DIR}")


@app.command()
def init(
    model: Path = typer.Option(..., "--model", help="Model folder (Hugging Face, safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help="Train prompts (Parquet or JSON Lines)."),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="Held-out prompts with a reference column "
                                                                  "(default: the train file, with a comment)."),
    objective: str = typer.Option("grpo", "--objective", help="grpo | gspo | pairwise | sft"),
    out: Path = typer.Option(Path("spec.toml"), "--out", help="Where to write the spec."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Write a commented starter spec for your model and prompts: max_tokens from the answers' lengths, the
    reward (exact_match with a reference column), the eval set; what it cannot decide is a TODO `run` refuses."""
    from curation.store.runlog import write_atomic
    from pipelines.cli.init_spec import starter_spec
    from pipelines.spec import load_spec

    if out.exists() and not force:
        raise _fail(f"{out} exists: give another --out, or --force to replace it", EXIT_BAD_INPUT)
    with _exit_codes():
        text = starter_spec(model, prompts, objective, eval_file, out)
        write_atomic(out, text)
    console.print(f"wrote {out}")
    try:
        load_spec(out)
    except ValueError as exc:  # its TODOs: the spec is written, the user fills them in
        err_console.print(f"[yellow]to do before `groupforge run {out}`:[/] {escape(str(exc))}")
        return
    console.print(f"check it with: groupforge run {out} --set run.rounds=1")


@app.command()
def verify(run: Path = typer.Argument(..., help="Run folder."),
           deep: bool = typer.Option(False, "--deep", help="Also hash every file against its manifest's sha256.")
           ) -> None:
    """Check that a run folder is what its manifests say: every listed file there with its size,
    rows (and with --deep its sha256), no manifest edited or from a newer groupforge, no foreign
    Parquet file in a table folder. Exit 0 when it is, 2 with the first problem otherwise."""
    if not run.is_dir():
        raise _fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    with _exit_codes():
        found = check_run(run, deep=deep)
    pending = (f"; {found.pending} commit(s) left pending by a kill (the next run finishes them)"
               if found.pending else "")
    console.print(f"{run}: {found.manifests} manifests, {found.files} files ({found.bytes / 2**20:,.1f} MiB) match"
                  f"{' byte for byte' if deep else ''}{pending}", soft_wrap=True)


@app.command()
def report(run: Path = typer.Argument(..., help="Run folder.")) -> None:
    """Rebuild RUN/report/ (plots and summary.md) from RUN/metrics.jsonl."""
    from pipelines.reports.run_report import report_run

    _run_folder(run)
    with _exit_codes():
        folder = report_run(run)
    console.print(f"wrote {folder}")


@app.command()
def compare(
    specs: list[Path] = typer.Argument(..., help="Pipeline specs, or one compare file (pipelines/specs/compare.toml)."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="Folder for the runs and the report (default: the compare file's out, "
                                            "or runs/compare)."),
    quick: bool = typer.Option(False, "--quick", help="Run the compare file's [compare.quick] study instead (a small "
                                                      "one, in [compare.quick] out: by default out + '-quick')."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Study runs at a time, each in a worker process with "
                                                      "cpu_count / jobs torch threads (their wall seconds then "
                                                      "include the contention)."),
    no_wait: bool = _NO_WAIT,
) -> None:
    """Compare objectives at equal data; write OUT/report/compare.{png,md}.

    Spec files, or a compare file without `seeds` and `sweep`: each spec runs once from the same
    start model. A compare file with them runs a study (pipelines/studies/study.py): a sweep per objective
    scored on a validation split of the train prompts, then each objective's best setting over
    the seeds, reported with 95% confidence intervals. Every run is resumable: a rerun skips the
    finished ones."""
    from pipelines.reports.run_report import report_compare
    from pipelines.spec import load_compare, load_compare_section

    with _exit_codes():
        section = load_compare_section(specs[0], quick) if len(specs) == 1 else None
        if quick and section is None:
            raise ValueError("--quick needs one compare file")
    if section is not None and section.study:
        from pipelines.studies.study import run_study
        from pipelines.studies.study_report import report_study

        def log(message: str) -> None:
            console.print(message, markup=False, highlight=False, soft_wrap=True)

        with _exit_codes():
            report_dir = report_study(run_study(section, out or Path(section.out), jobs=jobs, wait=not no_wait,
                                                log=log))
    else:
        with _exit_codes():
            parsed, default_out = load_compare(specs)
        out = out or default_out or Path("runs/compare")
        runs = {}
        for spec in parsed.values():
            folder, _ = _run_one(spec, out / spec.run.name, None, no_wait)
            runs[spec.run.name] = folder
        report_dir = report_compare(runs, out / "report")
    console.print((report_dir / "compare.md").read_text(), markup=False, highlight=False)
    console.print(f"report: {report_dir}")


@toy_app.command("build")
@model_options(ToyConfig)
def toy_build(
    variant: str = typer.Option("default", "--variant", help=f"Named config to start from ({', '.join(VARIANTS)}); "
                                                             "the ToyConfig flags given override its fields."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for model/, train.parquet, eval.parquet "
                                       "(default: runs/toy, runs/toy-<variant>, runs/toy-scratchpad[-<variant>], "
                                       "or runs/toy-<config hash>)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data split and the warm start."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a matching toy is cached."),
    overrides: dict = OVERRIDES,
) -> None:
    """Build an embedded arithmetic task (--task addition or scratchpad) and its warm-started Llama model
    (cached)."""
    from pipelines.toy.build import build_toy, default_out, variant_config

    with _exit_codes():
        # the variant of the task given (its defaults differ), then the flags given on top
        config = build(ToyConfig, {**variant_config(variant, overrides.get("task", "addition")).model_dump(),
                                   **overrides})
        path = build_toy(out or default_out(config), seed=seed, force=force, progress=True, config=config)
    console.print(f"toy ready in {path}")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the engine's INFO lines out of the tables
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
