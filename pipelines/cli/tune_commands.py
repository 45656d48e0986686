"""`groupforge tune SPEC`: the lr chosen on a validation split of the spec's train prompts within
a time budget (pipelines/studies/tune.py), written into a copy of the spec with the evidence."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from pipelines.cli.app import EXIT_BAD_INPUT, app, command_log, console, exit_codes, fail, show_table


@app.command("tune")
def tune_command(
    spec: Path = typer.Argument(..., help="Pipeline spec (TOML) whose train.lr to tune."),
    out: Optional[Path] = typer.Option(None, "--out", help=escape("The tuned spec: SPEC's text with lr replaced and "
                                                                  "the evidence as a comment above [train] (default: "
                                                                  "WORK/<spec stem>.tuned.toml); beside it "
                                                                  "<OUT stem>.tune.json.")),
    work: Optional[Path] = typer.Option(None, "--work", help="Folder of the split and the trial runs (default: "
                                                             "runs/<spec stem>-tune); a rerun skips finished trials."),
    budget_minutes: float = typer.Option(5.0, "--budget-minutes", help="Wall minutes for the whole tune: the trials' "
                                                                       "rounds are fitted to it, and no trial starts "
                                                                       "once it is spent."),
    lrs: Optional[str] = typer.Option(None, "--lrs", help="Candidate learning rates, comma-separated (default: the "
                                                          "spec's lr, a third of it and three times it)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Rounds of each trial (default: as many as "
                                                                       "the budget fits, measured by a two-round "
                                                                       "probe, at most the spec's)."),
    val_prompts: Optional[int] = typer.Option(None, "--val-prompts", min=1, help="Train prompts held out for "
                                              "validation (default: 256 or a fifth of them, whichever is fewer)."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Trials at a time, each in a worker process with "
                                                      "cpu_count / jobs torch threads."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seeds the split and the trial runs (default: the "
                                                            "spec's run.seed)."),
) -> None:
    """Pick the spec's train.lr on a validation split held out from the spec's train prompts: one short run per
    candidate within the budget, scored by the mean of its last 3 validation evals (ties: the smaller lr).
    Writes the tuned spec (the original text, lr replaced) and its evidence; the eval prompts choose nothing."""
    from pipelines.studies.spec_text import format_float
    from pipelines.studies.tune import Trial, TuneRequest, parse_lrs, run_tune, write_tuned

    if budget_minutes <= 0:
        raise fail(f"--budget-minutes {budget_minutes:g}: must be more than 0", EXIT_BAD_INPUT)
    if not spec.is_file():
        raise fail(f"{spec}: spec file not found", EXIT_BAD_INPUT)
    with exit_codes():
        candidates = parse_lrs(lrs) if lrs is not None else None
    work = work or Path("runs") / f"{spec.stem}-tune"
    command_log(work, "tune")  # imports torch and transformers: after the checks of the flags
    request = TuneRequest(spec, out or work / f"{spec.stem}.tuned.toml", work, 60 * budget_minutes, candidates,
                          rounds, val_prompts, jobs, seed)

    def log(message: str) -> None:
        console.print(message, markup=False, highlight=False, soft_wrap=True)

    with exit_codes():
        result = run_tune(request, log)
        tuned, evidence = write_tuned(result)

    def score(trial: "Trial") -> str:
        return "not tried" if not trial.tried else "-" if trial.score is None else f"{100 * trial.score:.1f}%"

    show_table(f"{spec}: lr candidates, best first", ["lr", "validation", "rounds", "seconds", "run"],
               [[format_float(t.lr), score(t), str(t.rounds or "-"), "-" if t.seconds is None else f"{t.seconds:.0f}",
                 str(t.run_dir or "-")] for t in result.trials], left=("run",))
    console.print(f"lr {format_float(result.spec.train.lr)} -> {format_float(result.chosen.lr)}: wrote {tuned} and "
                  f"{evidence}",
                  highlight=False, soft_wrap=True)
