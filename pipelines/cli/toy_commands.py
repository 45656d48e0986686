"""`groupforge toy ...`: the embedded toy task and model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipelines.cli.app import console, exit_codes, toy_app
from pipelines.cli.options import OVERRIDES, build, model_options
from pipelines.toy.task import VARIANTS, ToyConfig


@toy_app.command("build")
@model_options(ToyConfig)
def toy_build_command(
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
    from pipelines.toy.build import build_toy, default_out
    from pipelines.toy.task import variant_config

    with exit_codes():
        # the variant of the task given (its defaults differ), then the flags given on top
        config = build(ToyConfig, {**variant_config(variant, overrides.get("task", "addition")).model_dump(),
                                   **overrides})
        path = build_toy(out or default_out(config), seed=seed, force=force, progress=True, config=config)
    console.print(f"toy ready in {path}")


