"""`groupforge toy ...`: the embedded toy task and model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipelines.cli.app import console, exit_codes, toy_app
from pipelines.cli.options import OVERRIDES, build, model_options
from pipelines.toy.task import SHAPES, VARIANTS, ToyConfig
from pipelines.toy.tool_toy import ToolToyConfig


def _shape_text(fields: dict[str, int]) -> str:
    """A shape's fields as the help shows them: '(width 128, 2 layers, 4 heads, MLP 512)'."""
    return (f"(width {fields['hidden_size']}, {fields['num_layers']} layers, {fields['num_heads']} heads, "
            f"MLP {fields['intermediate_size']})")


@toy_app.command("build")
@model_options(ToyConfig)
def toy_build_command(
    variant: str = typer.Option("default", "--variant", help=f"Named config to start from ({', '.join(VARIANTS)}); "
                                                             "the ToyConfig flags given override its fields."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Named model shape: "
                                        + "; ".join(f"{name} {_shape_text(fields)}" for name, fields in SHAPES.items())
                                        + " (default: the task's). Applied over the variant; model flags override it."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for model/, train.parquet, eval.parquet "
                                       "(default: runs/toy, runs/toy-<variant>, runs/toy-scratchpad[-<variant>], "
                                       "or runs/toy-<config hash>)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data split and the warm start."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a matching toy is cached."),
    overrides: dict = OVERRIDES,
) -> None:
    """Build an embedded task (--task: addition, scratchpad, multiply, reverse, sort, max) and its
    warm-started Llama model (cached)."""
    from pipelines.toy.build import build_toy, default_out
    from pipelines.toy.task import shape_fields, variant_config

    with exit_codes():
        # the variant of the task given (its defaults differ), the shape, then the flags given on top
        config = build(ToyConfig, {**variant_config(variant, overrides.get("task", "addition")).model_dump(),
                                   **shape_fields(shape), **overrides})
        path = build_toy(out or default_out(config), seed=seed, force=force, progress=True, config=config)
    console.print(f"toy ready in {path}")


@toy_app.command("build-tools")
@model_options(ToolToyConfig)
def toy_build_tools_command(
    out: Path = typer.Option(Path("runs/toy-tools"), "--out", help="Folder for model/ (with its chat template), "
                             "train.parquet, eval.parquet, toy.json."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data split, the warm start's tool calls and its order."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a matching tool toy is cached."),
    overrides: dict = OVERRIDES,
) -> None:
    """Build the tool toy: a*b= (3-digit x 2-digit) with a calculator the model calls through its
    chat template, warm-started to call it on --tool-share of its conversations (cached).
    pipelines/specs/toy-tools.toml trains it on multi-turn rollouts."""
    from pipelines.toy.tool_toy import build_tool_toy

    with exit_codes():
        config = build(ToolToyConfig, overrides)
        path = build_tool_toy(out, seed=seed, config=config, force=force)
    console.print(f"tool toy ready in {path}")
