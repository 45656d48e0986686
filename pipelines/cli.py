"""`groupforge ...`: the command line. Flags map 1:1 to function arguments; no hidden globals.

Exit codes: 0 ok, 2 bad input (a table, file or flag is wrong: the message says which),
3 the run is locked by another job (with --no-wait), 1 anything unexpected.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

EXIT_BAD_INPUT = 2
EXIT_LOCKED = 3

app = typer.Typer(add_completion=False, no_args_is_help=True, help="groupforge: table-first GRPO/GSPO post-training.")
toy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The embedded toy task and model.")
app.add_typer(toy_app, name="toy")
console = Console()
err_console = Console(stderr=True)


def _fail(message: str, code: int) -> "typer.Exit":
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


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
def generate(
    model: Path = typer.Option(..., "--model", help="Hugging Face model folder (safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help="Parquet or JSONL file with a 'prompt' or 'messages' column."),
    group_size: int = typer.Option(8, "--group-size", "-G", help="Responses sampled per prompt."),
    out: Path = typer.Option(..., "--out", help="Run folder to write tables into."),
    backend: str = typer.Option("vllm", "--backend", help="vllm | hf"),
    round: int = typer.Option(0, "--round", help="Round number (hive partition round=<n>)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Longest response in tokens."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1.0 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k sampling (0 = off)."),
    seed: int = typer.Option(0, "--seed", help="Base seed; per-prompt seeds derive from it, the round and prompt_id."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context length (default: the model's)."),
    chunk_prompts: int = typer.Option(256, "--chunk-prompts", help="Prompts per engine call; finished chunks survive a kill."),
    force: bool = typer.Option(False, "--force", help="Regenerate even if the round is up to date."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Exit (code 3) instead of waiting when another job holds the run."),
) -> None:
    """Sample G responses per prompt and write samples (with behavior_logprobs) to RUN/samples/round=<n>/."""
    from curation.generate.base import SamplingConfig, load_prompts
    from curation.generate.stage import generate as run_generate
    from curation.schema import SchemaError
    from curation.store import RunLockedError, RunStore

    if backend not in {"vllm", "hf"}:
        raise _fail(f"--backend must be 'vllm' or 'hf', got {backend!r}", EXIT_BAD_INPUT)
    if not (model / "config.json").is_file():
        raise _fail(f"--model {model}: not a Hugging Face model folder (no config.json)", EXIT_BAD_INPUT)
    try:
        sampling = SamplingConfig(group_size=group_size, max_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, top_k=top_k, seed=seed)
        load_prompts(prompts)  # fail on a bad prompts file before any lock, engine or progress bar
        store = RunStore(out)
        with store.lock(wait=not no_wait, on_wait=lambda msg: err_console.print(f"[yellow]waiting:[/] {msg}")):
            with _progress() as bar:
                task = bar.add_task(f"generate round {round}", total=None)
                result = run_generate(
                    out, prompts, sampling, model=model, backend=backend, round=round, force=force,
                    chunk_prompts=chunk_prompts,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                    generator_kwargs={"dtype": dtype, "max_model_len": max_model_len},
                )
    except (SchemaError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    except RunLockedError as exc:
        raise _fail(str(exc), EXIT_LOCKED) from None
    if result.skipped:
        m = result.manifest
        console.print(
            f"round {round} is up to date (manifest {out}/_manifests/generate-round={round}.json, "
            f"{m.get('rows_out')} samples from {m.get('created_at')}); nothing to do. Use --force to regenerate."
        )
        return
    tokens_per_s = result.response_tokens / result.sample_seconds if result.sample_seconds else 0.0
    summary = Table(title=f"generate round {round}", show_header=True)
    for column in ("prompts", "rejected (too long)", "samples", "response tokens", "resumed chunks", "seconds", "sampling tokens/s"):
        summary.add_column(column, justify="right")
    summary.add_row(str(result.prompts), str(result.rejected_prompts), str(result.samples), str(result.response_tokens),
                    str(result.resumed_chunks), f"{result.seconds:.1f}", f"{tokens_per_s:,.0f}")
    console.print(summary)


@app.command()
def inspect(
    run: Path = typer.Argument(..., help="Run folder."),
    rows: int = typer.Option(3, "--rows", help="Example rows to show per table."),
) -> None:
    """Row counts per table and round, stage manifests, and a few example rows."""
    from pipelines.inspect import inspect_run

    if not run.is_dir():
        raise _fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    try:
        inspect_run(run, rows, console)
    except ValueError as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None


def _curate(stages: tuple[str, ...], run: Path, round: Optional[int], config: Optional[Path], force: bool,
            no_wait: bool) -> None:
    """Run curation stages over rounds under the run's lock, then print one summary table."""
    from curation.schema import SchemaError
    from curation.store import RunLockedError, RunStore
    from pipelines.curate import load_curation_spec, rounds_to_process, run_stage

    if not run.is_dir():
        raise _fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    reports = []
    try:
        spec = load_curation_spec(config)
        rounds = rounds_to_process(run, round)
        with RunStore(run).lock(wait=not no_wait, on_wait=lambda msg: err_console.print(f"[yellow]waiting:[/] {msg}")):
            with _progress() as bar:
                task = bar.add_task("curate", total=len(rounds) * len(stages))
                for r in rounds:
                    for stage in stages:
                        bar.update(task, description=f"{stage} round {r}")
                        reports.append(run_stage(stage, run, r, spec, force=force))
                        bar.advance(task)
    except (SchemaError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    except RunLockedError as exc:
        raise _fail(str(exc), EXIT_LOCKED) from None
    table = Table(title=f"{run}: curation")
    for column in ("stage", "round", "rows in", "rows out", "dropped", "drops by reason", "seconds"):
        table.add_column(column, justify="left" if column in ("stage", "drops by reason") else "right")
    for rep in reports:
        drops = ", ".join(f"{k}={v}" for k, v in sorted(rep.drops.items())) or "-"
        table.add_row(rep.stage, str(rep.round), str(rep.rows_in), str(rep.rows_out),
                      str(sum(rep.drops.values())), drops if not rep.skipped else "up to date (skipped)",
                      f"{rep.seconds:.2f}")
    console.print(table)


_ROUND = typer.Option(None, "--round", help="Only this round (default: every round with samples).")
_CONFIG = typer.Option(None, "--config", help="TOML spec with [score] [filter] [label] [pair] sections.")
_FORCE = typer.Option(False, "--force", help="Rerun even if up to date.")
_NO_WAIT = typer.Option(False, "--no-wait", help="Exit (code 3) instead of waiting for another job's lock.")


@app.command()
def score(run: Path = typer.Argument(..., help="Run folder."), round: Optional[int] = _ROUND,
          config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = _NO_WAIT) -> None:
    """Apply reward functions: RUN/scores (one column per reward + the weighted `reward`)."""
    _curate(("score",), run, round, config, force, no_wait)


@app.command("filter")
def filter_(run: Path = typer.Argument(..., help="Run folder."), round: Optional[int] = _ROUND,
            config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = _NO_WAIT) -> None:
    """Drop zero-variance groups, duplicates, ... : every dropped row lands in RUN/rejects with a reason."""
    _curate(("filter",), run, round, config, force, no_wait)


@app.command()
def label(run: Path = typer.Argument(..., help="Run folder."), round: Optional[int] = _ROUND,
          config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = _NO_WAIT) -> None:
    """Group statistics and advantages: RUN/groups."""
    _curate(("label",), run, round, config, force, no_wait)


@app.command()
def pair(run: Path = typer.Argument(..., help="Run folder."), round: Optional[int] = _ROUND,
         config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = _NO_WAIT) -> None:
    """Preference pairs inside groups, with soft labels: RUN/pairs."""
    _curate(("pair",), run, round, config, force, no_wait)


@app.command()
def curate(run: Path = typer.Argument(..., help="Run folder."), round: Optional[int] = _ROUND,
           config: Optional[Path] = _CONFIG, force: bool = _FORCE, no_wait: bool = _NO_WAIT) -> None:
    """score, filter, label and pair in order (defaults: exact_match, zero-variance and
    duplicate filters, grpo advantages, max_min soft-label pairs)."""
    _curate(("score", "filter", "label", "pair"), run, round, config, force, no_wait)


@app.command()
def export(
    run: Path = typer.Argument(..., help="Run folder."),
    format: str = typer.Option("preference", "--format", help="preference | prompt_only | unpaired | sft"),
    style: str = typer.Option("standard", "--style", help="standard (text) | conversational (messages)"),
    round: Optional[list[int]] = typer.Option(None, "--round", help="Rounds to export (repeatable; default all)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Parquet file (default RUN/exports/<format>-<style>.parquet)."),
) -> None:
    """Write a TRL-format dataset (Parquet, loadable with datasets.load_dataset)."""
    from pydantic import ValidationError

    from curation.schema import SchemaError
    from curation.stages.export import ExportConfig
    from curation.stages.export import run as run_export

    if not run.is_dir():
        raise _fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    try:
        cfg = ExportConfig(format=format, style=style, rounds=round or None)
        path, rows = run_export(run, cfg, out)
    except ValidationError as exc:
        raise _fail("; ".join(f"--{e['loc'][0]}: {e['msg']}" for e in exc.errors()), EXIT_BAD_INPUT) from None
    except (SchemaError, ValueError) as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    console.print(f"wrote {rows} rows ({format}, {style}) to {path}")


def _parse_rounds(text: Optional[str]) -> Optional[list[int]]:
    """'0,1,3' or '2-5' or '0,2-4' -> a list of rounds; None stays None."""
    if text is None:
        return None
    rounds: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            rounds.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise _fail(f"--rounds {text!r}: expected numbers like 0,1,3 or 2-5", EXIT_BAD_INPUT) from None
    return rounds


@app.command()
def train(
    run: Path = typer.Argument(..., help="Run folder with curated tables."),
    steps: int = typer.Option(..., "--steps", help="Train until this optimizer step (total, across calls)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Base model folder (needed when RUN has no checkpoint)."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with a [train] section; flags override it."),
    objective: Optional[str] = typer.Option(None, "--objective", help="grpo | gspo | gspo_token | pairwise | sft"),
    rounds: Optional[str] = typer.Option(None, "--rounds", help="Rounds to train on, e.g. 0,1 or 0-3 (default: all)."),
    max_staleness: Optional[int] = typer.Option(None, "--max-staleness", help="Drop rounds older than this (in rounds)."),
    sft_min_reward: Optional[float] = typer.Option(None, "--sft-min-reward", help="sft: reward >= this (default: advantage > 0)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences (pairwise: pairs) per step."),
    token_budget: Optional[int] = typer.Option(None, "--token-budget", help="Padded tokens per micro-batch."),
    old_logprobs: Optional[str] = typer.Option(None, "--old-logprobs", help="generator | recompute"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Default: the rounds' sampling temperature."),
    eps_low: Optional[float] = typer.Option(None, "--eps-low", help="Lower clip range."),
    eps_high: Optional[float] = typer.Option(None, "--eps-high", help="Upper clip range."),
    dual_clip: Optional[float] = typer.Option(None, "--dual-clip", help="Dual-clip constant c > 1."),
    beta: Optional[float] = typer.Option(None, "--beta", help="KL weight, or pairwise temperature."),
    kl: Optional[str] = typer.Option(None, "--kl", help="k1 | k2 | k3"),
    agg: Optional[str] = typer.Option(None, "--agg", help="token-mean | seq-mean-token-mean | seq-mean-token-sum-norm"),
    norm_len: Optional[int] = typer.Option(None, "--norm-len", help="seq-mean-token-sum-norm constant."),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Pairwise margin."),
    length_normalize: Optional[bool] = typer.Option(None, "--length-normalize/--no-length-normalize", help="Pairwise: mean log-prob."),
    reference: Optional[bool] = typer.Option(None, "--reference/--no-reference", help="Pairwise: use the reference model (DPO)."),
    ref_model: Optional[str] = typer.Option(None, "--ref-model", help="Reference model folder (default: the base model)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate."),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help="AdamW weight decay."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help="Linear warmup steps."),
    lr_schedule: Optional[str] = typer.Option(None, "--lr-schedule", help="constant | cosine"),
    decay_steps: Optional[int] = typer.Option(None, "--decay-steps", help="cosine: step of the final lr."),
    max_grad_norm: Optional[float] = typer.Option(None, "--max-grad-norm", help="Gradient clipping norm (0: off)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the row order."),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Checkpoint every N steps."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", help="Checkpoints kept (0: all)."),
    no_wait: bool = _NO_WAIT,
) -> None:
    """Train on the run's curated tables; checkpoints in RUN/checkpoints, one line per step in RUN/metrics.jsonl."""
    from curation.schema import SchemaError
    from curation.store import RunLockedError, RunStore
    from pipelines.spec import load_section
    from training.config import TrainConfig
    from training.trainer import train as run_train

    flags = dict(objective=objective, rounds=_parse_rounds(rounds), max_staleness=max_staleness,
                 sft_min_reward=sft_min_reward, batch_size=batch_size, token_budget=token_budget,
                 old_logprobs=old_logprobs, temperature=temperature, eps_low=eps_low, eps_high=eps_high,
                 dual_clip=dual_clip, beta=beta, kl=kl, agg=agg, norm_len=norm_len, gamma=gamma,
                 length_normalize=length_normalize, reference=reference, ref_model=ref_model, lr=lr,
                 weight_decay=weight_decay, warmup_steps=warmup_steps, lr_schedule=lr_schedule,
                 decay_steps=decay_steps, max_grad_norm=max_grad_norm, dtype=dtype, seed=seed,
                 save_every=save_every, keep_last=keep_last)
    if not run.is_dir():
        raise _fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    try:
        cfg = load_section(TrainConfig, config, "train", overrides=flags)
    except ValueError as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    try:
        with RunStore(run).lock(wait=not no_wait, on_wait=lambda msg: err_console.print(f"[yellow]waiting:[/] {msg}")):
            with _progress() as bar:
                task = bar.add_task(f"train {cfg.objective}", total=None)

                def progress(done: int, total: int, metrics: dict) -> None:
                    bar.update(task, completed=done, total=total,
                               description=f"train {cfg.objective} step {metrics['step']} loss {metrics['loss']:.4f}")

                result = run_train(run, cfg, steps=steps, model=model, progress=progress)
    except (SchemaError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    except RunLockedError as exc:
        raise _fail(str(exc), EXIT_LOCKED) from None
    if result.skipped:
        console.print(f"{run}: already at step {result.end_step} (>= --steps {steps}); nothing to do")
        return
    m = result.last_metrics
    table = Table(title=f"{run}: train {cfg.objective}")
    for column in ("steps", "rounds", "rows", "last loss", "grad norm", "tokens/s", "seconds", "checkpoint"):
        table.add_column(column, justify="right")
    table.add_row(f"{result.start_step} -> {result.end_step}", ",".join(map(str, result.rounds)), str(result.rows),
                  f"{m.get('loss', float('nan')):.4f}", f"{m.get('grad_norm', float('nan')):.3f}",
                  f"{m.get('tokens_per_s', 0):,.0f}", f"{result.seconds:.1f}", str(result.checkpoint))
    console.print(table)


def _parse_extra_rounds(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    if not text.startswith("+") or not text[1:].isdigit() or int(text[1:]) < 1:
        raise _fail(f"--rounds {text!r}: expected +K (e.g. +3) to extend the run by K rounds; "
                    "set [run].rounds in the spec for the total", EXIT_BAD_INPUT)
    return int(text[1:])


def _round_table(title: str) -> Table:
    table = Table(title=title)
    for column in ("round", "eval acc", "reward mean", "kept groups", "pairs", "samples", "policy", "gen tok/s",
                   "train tok/s", "seconds"):
        table.add_column(column, justify="right")
    return table


def _round_row(table: Table, rec: dict) -> None:
    reward = rec.get("reward_mean")
    table.add_row(str(rec["round"]), f"{100 * rec['eval_accuracy']:.1f}%", "-" if reward is None else f"{reward:.3f}",
                  str(rec.get("kept_groups", 0)), str(rec.get("pairs", 0)), str(rec.get("samples", 0)),
                  str(rec.get("policy_version", 0)), f"{rec.get('gen_tokens_per_s', 0):,.0f}",
                  f"{rec.get('train_tokens_per_s', 0):,.0f}", f"{rec.get('wall_seconds', 0):.1f}")


def _run_one(spec: "Path | object", run_dir: Optional[Path], extra: Optional[int], no_wait: bool) -> tuple[Path, list[dict]]:
    """Run one spec (a file or a PipelineSpec) to its last round, printing a line per round;
    returns (run folder, round records)."""
    from curation.schema import SchemaError
    from curation.store import RunLockedError
    from pipelines.run import run_pipeline
    from pipelines.spec import load_spec

    try:
        parsed = load_spec(spec) if isinstance(spec, Path) else spec
    except ValueError as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    folder = run_dir or Path("runs") / parsed.run.name
    console.print(f"[bold]{parsed.run.name}[/] ({parsed.train.objective}, {parsed.run.rounds} rounds) -> {folder}")

    def on_round(rec: dict) -> None:
        reward = rec.get("reward_mean")
        console.print(f"  round {rec['round']:>3}: eval acc {100 * rec['eval_accuracy']:5.1f}%  reward "
                      f"{'-' if reward is None else f'{reward:.3f}'}  kept groups {rec.get('kept_groups', 0)}  "
                      f"pairs {rec.get('pairs', 0)}  policy {rec.get('policy_version', 0)}  "
                      f"{rec.get('wall_seconds', 0):.1f}s", highlight=False)

    try:
        records = run_pipeline(parsed, run_dir=folder, extra_rounds=extra, wait=not no_wait,
                               log=lambda msg: err_console.print(f"[dim]{msg}[/]", highlight=False),
                               on_round=on_round)
    except (SchemaError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    except RunLockedError as exc:
        raise _fail(str(exc), EXIT_LOCKED) from None
    return folder, records


@app.command("run")
def run_(
    spec: Path = typer.Argument(..., help="Pipeline spec (TOML), e.g. pipelines/specs/toy-grpo.toml."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run folder (default: runs/<run.name>)."),
    rounds: Optional[str] = typer.Option(None, "--rounds", help="+K: extend a finished run by K rounds."),
    no_wait: bool = _NO_WAIT,
) -> None:
    """Run the round loop (generate -> curate -> train -> evaluate); rerun to resume after a kill."""
    from pipelines.report import report_run

    folder, records = _run_one(spec, run_dir, _parse_extra_rounds(rounds), no_wait)
    table = _round_table(f"{folder}")
    for rec in records:
        _round_row(table, rec)
    console.print(table)
    if records:
        start, final = records[0]["eval_accuracy"], records[-1]["eval_accuracy"]
        console.print(f"eval accuracy {100 * start:.1f}% -> {100 * final:.1f}% "
                      f"({100 * (final - start):+.1f} points) in {records[-1].get('elapsed_seconds', 0):.0f} s")
    console.print(f"report: {report_run(folder)}")


@app.command()
def report(run: Path = typer.Argument(..., help="Run folder.")) -> None:
    """Rebuild RUN/report/ (plots and summary.md) from RUN/metrics.jsonl."""
    from pipelines.report import report_run

    try:
        folder = report_run(run)
    except ValueError as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    console.print(f"wrote {folder}")


@app.command()
def compare(
    specs: list[Path] = typer.Argument(..., help="Pipeline specs, or one compare file (pipelines/specs/compare.toml)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for the runs and the report (default: runs/compare)."),
    no_wait: bool = _NO_WAIT,
) -> None:
    """Run each spec from the same starting model at equal data, then write OUT/report/compare.{png,md}."""
    from pipelines.report import report_compare
    from pipelines.spec import load_compare

    try:
        parsed, default_out = load_compare(specs)
    except ValueError as exc:
        raise _fail(str(exc), EXIT_BAD_INPUT) from None
    out = out or default_out or Path("runs/compare")
    runs = {}
    for spec in parsed.values():
        folder, _ = _run_one(spec, out / spec.run.name, None, no_wait)
        runs[spec.run.name] = folder
    report_dir = report_compare(runs, out / "report")
    console.print((report_dir / "compare.md").read_text(), markup=False, highlight=False)
    console.print(f"report: {report_dir}")


@toy_app.command("build")
def toy_build(
    out: Path = typer.Option(Path("runs/toy"), "--out", help="Folder for model/, train.parquet, eval.parquet."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data split and the warm start."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a matching toy is cached."),
) -> None:
    """Build the embedded arithmetic task and its warm-started Llama model (cached)."""
    from pipelines.toy import build_toy

    path = build_toy(out, seed=seed, force=force, progress=True)
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
