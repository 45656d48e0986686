"""`groupforge model ...`: model folders made from other formats."""

from __future__ import annotations

from pathlib import Path

import typer

from pipelines.cli.app import app, console, err_console, exit_codes
from pipelines.models.gguf_import import DTYPES

model_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Model folders made from other formats.")
app.add_typer(model_app, name="model")


@model_app.command("import-gguf")
def import_gguf_command(
    file: Path = typer.Argument(..., help="The .gguf file (llama.cpp's format)."),
    out: Path = typer.Option(..., "--out", help="The model folder to write (must not exist, or be empty)."),
    dtype: str = typer.Option("float32", "--dtype", help=f"The weights' dtype: {' or '.join(DTYPES)}."),
) -> None:
    """Turn a GGUF file into a standard Hugging Face model folder (safetensors, config.json, tokenizer
    and chat template, generation_config.json), its weights dequantised; any groupforge command
    then takes the folder as a model."""
    from pipelines.models.gguf_import import import_gguf

    with exit_codes():
        path = import_gguf(file, out, dtype=dtype, progress=lambda line: err_console.print(
            line, highlight=False, markup=False, soft_wrap=True))
    console.print(f"model folder ready in {path}", highlight=False, markup=False, soft_wrap=True)


@model_app.command("tasks")
def tasks_command(
    task: str = typer.Option("addition", "--task", help="addition, subtraction, multiply, max or long-multiply "
                                                       "(pipelines/models/chat_tasks.py)."),
    out: Path = typer.Option(..., "--out", help="Folder for train.parquet and eval.parquet."),
    train: int = typer.Option(512, "--train", min=1, help="Train prompts."),
    eval: int = typer.Option(128, "--eval", min=1, help="Held-out eval prompts (disjoint from train)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the problems drawn."),
) -> None:
    """Write chat-format prompt files (one user turn, a number as the reference) for a chat model."""
    from pipelines.models.chat_tasks import write_task

    with exit_codes():
        train_path, eval_path = write_task(task, out, train=train, eval=eval, seed=seed)
    console.print(f"wrote {train_path} ({train} prompts) and {eval_path} ({eval})")


@model_app.command("tool-warm-start")
def tool_warm_start_command(
    model: Path = typer.Option(..., "--model", help="The chat model folder to start from."),
    out: Path = typer.Option(..., "--out", help="The model folder to write (must not exist, or be empty)."),
    task: str = typer.Option("long-multiply", "--task", help="The chat task whose problems the conversations pose."),
    prompts: int = typer.Option(128, "--prompts", min=1, help="Problems; each gives a conversation with the tools "
                                "and one without."),
    tool_share: float = typer.Option(0.5, "--tool-share", min=0.0, max=1.0, help="Share of the conversations with "
                                     "the tools that call the calculator (the rest answer directly)."),
    steps: int = typer.Option(40, "--steps", min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Conversations per step."),
    lr: float = typer.Option(5e-5, "--lr", help="AdamW learning rate (constant)."),
    tools_prompt: str = typer.Option("system", "--tools-prompt",
                                     help="How the tools are described: 'system' (a Hermes-form system message, for "
                                          "templates that ignore `tools`) or 'template'."),
    seed: int = typer.Option(0, "--seed", help="Seeds the problems, which conversations call the tool, the order."),
) -> None:
    """A short supervised pass teaching a chat model to call the calculator on some prompts
    (pipelines/models/tool_warm_start.py), so that RL on multi-turn rollouts has tool calls to
    reinforce. pipelines/specs/smollm2-tools.toml starts from its output."""
    from pipelines.models.tool_warm_start import tool_warm_start

    with exit_codes():
        path = tool_warm_start(model, out, task, prompts=prompts, tool_share=tool_share, steps=steps,
                               batch_size=batch_size, lr=lr, seed=seed, tools_prompt=tools_prompt,
                               log=lambda line: err_console.print(line, highlight=False, markup=False))
    console.print(f"model folder ready in {path}", highlight=False, markup=False, soft_wrap=True)
