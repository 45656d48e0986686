"""The commands that make and read a run's tables one step at a time: `generate`, `inspect`,
the curation stages (`score`, `filter`, `label`, `pair`, `curate`) and `export`.

The flags of `generate` are built from the pydantic models they fill
(`curation.generate.base.SamplingConfig` and `GeneratorConfig`) by `pipelines.cli.options`,
so each maps 1:1 to a spec field with the field's type, default and help text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from curation.generate.base import GeneratorConfig, SamplingConfig
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
from pipelines.cli.options import OVERRIDES, build, model_options
from store.storage import is_object_url


@app.command("generate")
@model_options(SamplingConfig, GeneratorConfig, aliases={"group_size": ["-G"]})
def generate_command(
    model: Path = typer.Option(..., "--model", help="Hugging Face model folder (safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help="Parquet or JSONL file with a 'prompt' or 'messages' column."),
    out: Path = typer.Option(..., "--out", help="Run folder to write tables into."),
    round: int = typer.Option(0, "--round", help="Round number (hive partition round=<n>)."),
    force: bool = typer.Option(False, "--force", help="Regenerate even if the round is up to date."),
    no_wait: bool = typer.Option(False, "--no-wait",
                                 help="Exit (code 3) instead of waiting when another job holds the run."),
    env_config: Optional[Path] = typer.Option(
        None, "--env-config", help=escape("TOML file with an [env] section (a spec's will do): each sample is a "
                                          "multi-turn trajectory against that environment, written with the "
                                          "trajectory columns.")),
    overrides: dict = OVERRIDES,
) -> None:
    """Sample G responses per prompt and write samples (with behavior_logprobs) to RUN/samples/round=<n>/;
    with --env-config, G multi-turn trajectories."""
    from curation.env.environments import check_model_environment
    from curation.generate.base import load_prompts
    from curation.generate.prompt_files import check_chat_template
    from curation.generate.stage import generate, resolve_backend
    from pipelines.spec import load_env_config
    from store.weights import check_model_folder

    local_run_folder(out)
    if not (model / "config.json").is_file():
        raise fail(f"--model {model}: not a Hugging Face model folder (no config.json)", EXIT_BAD_INPUT)
    with exit_codes():
        sampling = build(SamplingConfig, overrides)
        settings = build(GeneratorConfig, overrides)
        load_prompts(prompts)  # fail on a bad prompts file before any lock, generator or progress bar
        check_model_folder(model)  # and on a bad model folder (the lock writes the run's log)
        check_chat_template([str(prompts)], model)  # and on conversations the model cannot render
        env = load_env_config(env_config) if env_config is not None else None
        if env is not None:  # and on an environment, tool or template a multi-turn generate cannot use
            check_model_environment(env, model)
        backend = resolve_backend(settings.backend, model)
        command_log(out, "generate")
        with writer_lock(out, no_wait):
            with progress_bar() as bar:
                task = bar.add_task(f"generate round {round}", total=None)
                result = generate(
                    out, prompts, sampling, model=model, backend=backend, round=round, force=force,
                    chunk_prompts=settings.chunk_prompts,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                    generator_kwargs=settings.generator_kwargs(backend), env=env,
                )
    if result.skipped:
        from store.run_log import COMMITS
        from store.run_store import RunStore

        m = result.manifest
        seq = RunStore(out).state.commits[("generate", round)]
        console.print(
            f"round {round} is up to date (commit {seq} in {out}/{COMMITS}, "
            f"{m.get('rows_out')} samples from {m.get('created_at')}); nothing to do. Use --force to regenerate."
        )
        return
    tokens_per_s = result.response_tokens / result.sample_seconds if result.sample_seconds else 0.0
    show_table(f"generate round {round}", ["prompts", "rejected (too long)", "samples", "response tokens",
                                           "resumed chunks", "seconds", "sampling tokens/s"],
               [[str(result.prompts), str(result.rejected_prompts), str(result.samples), str(result.response_tokens),
                 str(result.resumed_chunks), f"{result.seconds:.1f}", f"{tokens_per_s:,.0f}"]])


@app.command("inspect")
def inspect_command(
    run: str = typer.Argument(..., help="Run folder or object-store URL."),
    rows: int = typer.Option(3, "--rows", help="Example rows to show per table."),
    stages: bool = typer.Option(False, "--stages", help="Print the stage graph instead: each stage, the tables "
                                                          "it reads and writes, its last run, rows in and out."),
) -> None:
    """Rows per table and round, stage manifests and example rows; with --stages, the stage graph."""
    from pipelines.reports.inspect_run import inspect_run, print_stage_graph

    checked_run_folder(run)
    with exit_codes():
        if stages:
            print_stage_graph(run, console)
        else:
            inspect_run(run, rows, console)


def _curate(stages: tuple[str, ...], run: str, only_round: Optional[int], config: Optional[Path], force: bool,
            no_wait: bool) -> None:
    """Run curation stages over rounds under the run's lock, then print one summary table."""
    from curation.stages.runner import run_stage
    from pipelines.loop.curate import load_curation_spec, rounds_to_process
    from store.run_store import RunStore

    checked_run_folder(run)
    reports = []
    with exit_codes():
        spec = load_curation_spec(config)
        rounds = rounds_to_process(run, only_round)
        if "score" in stages and any(reward.name == "reward_model" for reward in spec.score.rewards):
            command = "curate" if len(stages) > 1 else "score"
            if is_object_url(run):
                err_console.print(f"[dim]logs: {command_log_path(run, command)}[/]", highlight=False, soft_wrap=True)
            command_log(run, command)  # the reward model's transformers and torch
        with writer_lock(store := RunStore(run), no_wait):  # one job: one writer in the run's log
            with progress_bar() as bar:
                task = bar.add_task("curate", total=len(rounds) * len(stages))
                for round in rounds:
                    for stage in stages:
                        bar.update(task, description=f"{stage} round {round}")
                        reports.append(run_stage(stage, store, round, getattr(spec, stage), force=force))
                        bar.advance(task)
    rows = []
    for rep in reports:
        drops = ", ".join(f"{k}={v}" for k, v in sorted(rep.drops.items())) or "-"
        rows.append([rep.stage, str(rep.round), str(rep.rows_in), str(rep.rows_out), str(sum(rep.drops.values())),
                     drops if not rep.skipped else "up to date (skipped)", f"{rep.seconds:.2f}"])
    show_table(f"{run}: curation", ["stage", "round", "rows in", "rows out", "dropped", "drops by reason", "seconds"],
               rows, left=("stage", "drops by reason"))


_ROUND = typer.Option(None, "--round", help="Only this round (default: every round with samples).")
_CONFIG = typer.Option(None, "--config", help=escape("TOML spec with [score] [filter] [label] [pair] sections."))
_FORCE = typer.Option(False, "--force", help="Rerun even if up to date.")


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
    def command(run: str = typer.Argument(..., help="Run folder or object-store URL."), round: Optional[int] = _ROUND,
                config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = NO_WAIT) -> None:
        _curate(stages, run, round, config, force, no_wait)

    command.__doc__ = doc
    return command


for _name, (_stages, _doc) in _CURATE_COMMANDS.items():
    app.command(_name)(_curate_command(_stages, _doc))


@app.command("export")
def export_command(
    run: str = typer.Argument(..., help="Run folder or object-store URL."),
    format: str = typer.Option("preference", "--format", help="preference | prompt_only | unpaired | sft | messages "
                               "(multi-turn runs: whole conversations with their tools; --style conversational)"),
    style: str = typer.Option("standard", "--style", help="standard (text) | conversational (messages)"),
    round: Optional[list[int]] = typer.Option(None, "--round", help="Rounds to export (repeatable; default all)."),
    as_of: Optional[int] = typer.Option(None, "--as-of", metavar="ROUND",
                                        help="The run as it was when this round was done (later commits left out): "
                                             "the same bytes as an export taken then."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="A path ending in .parquet (that file), or a folder (an existing one, "
                                            "or a new name without a suffix) that gets <format>-<style>.parquet. "
                                            "The dataset card README.md goes in the file's folder. "
                                            "Default: RUN/exports/<format>-<style>.parquet."),
    append_to: Optional[str] = typer.Option(None, "--append-to", metavar="TABLE",
                                            help="Instead of a file: append the run's finished rounds that are not "
                                                 "in this Delta table yet (a folder or s3://, gs://, az:// URL) as "
                                                 "one new version, with its provenance."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="REPO",
                                              help="Also push the export and its card to this Hugging Face dataset "
                                                   "repo (private unless --public), with datasets' push_to_hub."),
    public: bool = typer.Option(False, "--public", help="With --push-to-hub: a public repo."),
) -> None:
    """Write a TRL-format dataset (Parquet, loadable with datasets.load_dataset) and the dataset card of its
    folder (README.md: features, splits, row counts, provenance from the run's manifests), so that
    datasets.load_dataset(folder) reads it too. A README.md that groupforge did not write is left as it is.
    With --append-to, append the new rounds to a versioned Delta table instead."""
    from pydantic import ValidationError

    from curation.card import foreign_card
    from curation.stages.export import ExportConfig
    from curation.stages.export import run_with_card as run_export
    from store.storage import is_object_url

    checked_run_folder(run)
    try:
        cfg = ExportConfig(format=format, style=style, rounds=round or None, append_to=append_to)
    except ValidationError as exc:
        raise fail("; ".join(f"--{e['loc'][0]}: {e['msg']}" for e in exc.errors()), EXIT_BAD_INPUT) from None
    if append_to is not None:
        _append(run, cfg, [flag for flag, value in (("--out", out), ("--as-of", as_of),
                                                     ("--push-to-hub", push_to_hub)) if value is not None])
        return
    if is_object_url(run) and out is None:
        raise fail(f"{run}: a run on an object store is exported with --out (a local file or folder) or "
                   "--append-to (a Delta table)", EXIT_BAD_INPUT)
    with exit_codes():
        path, rows, card = run_export(run, cfg, out, as_of)
    console.print(f"wrote {rows} rows ({format}, {style}) to {escape(str(path))}")
    if card is not None:
        console.print(f"dataset card: {escape(str(card))}")
    elif (foreign := foreign_card(path.parent)) is not None:
        err_console.print(f"[yellow]warning:[/] {escape(str(foreign))} was not written by groupforge: "
                          "left as it is, no dataset card written")
    if push_to_hub:
        from curation.card import push

        with exit_codes():
            url = push(path, push_to_hub, private=not public)
        console.print(f"pushed to {url}")


def _append(run: str, cfg, others: list[str]) -> None:
    """`export --append-to`: one new version of the Delta table, or nothing new."""
    from curation.stages.dataset import append_export

    if others:
        raise fail(f"--append-to writes a Delta table: {', '.join(others)} cannot go with it", EXIT_BAD_INPUT)
    with exit_codes():
        done = append_export(run, cfg)
    if done.version is None:
        console.print(f"{escape(done.table)}: nothing to append (every finished round of {escape(run)} is in it)")
    else:
        console.print(f"appended rounds {done.rounds} ({done.rows} rows, {cfg.format}) to {escape(done.table)} "
                      f"as version {done.version}")
