"""The toy's tasks and their config: `ToyConfig` (task, model, warm start), the problems and
the supervised responses of each task, and the named `VARIANTS`.

This module stays light (pydantic, numpy, pyarrow): the CLI generates `groupforge toy build`'s
flags from ToyConfig. The build itself (torch, transformers) is pipelines/toy/build.py.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from curation.rewards.scratchpad import final_answer, scratchpad_solution

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM's CPU attention supports (`CPUAttentionBackend.get_supported_head_sizes`)."""


Task = Literal["addition", "scratchpad"]
TASKS: tuple[str, ...] = get_args(Task)
"""The toy's tasks; addition is the default."""
TASK_DESCRIPTIONS = {
    "addition": "two-digit addition; reward = exact match of response.strip() with reference",
    "scratchpad": "addition with a column-by-column scratchpad; reward = final_answer (the text after the last "
    "'####' equals reference), partial credit = scratchpad_steps",
}
TASK_DEFAULTS: dict[str, dict] = {
    # 3-digit operands (36-37 tokens per response), a train set the size of a warm start
    # rather than all 809,600 prompts, a quarter of the addition model's weights and one
    # thread: ~4x longer sequences make tokens the cost of the build and of every RL round
    "scratchpad": {
        "operand_min": 100,
        "operand_max": 999,
        "n_train": 20000,
        "hidden_size": 64,
        "num_heads": 2,
        "intermediate_size": 256,
        "target_accuracy": 0.25,  # accuracy climbs in jumps here (0.12 -> 0.29 -> 0.41 in 10 steps)
        "num_threads": 1,
    },
}
"""The field defaults of a task other than addition, where they differ from ToyConfig's."""


class ToyConfig(BaseModel):
    """Everything that determines the built toy, together with the seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- task ---
    task: Task = Field(
        "addition",
        exclude_if=lambda v: v == "addition",
        description="addition: '37+48=' -> '85'. scratchpad: '347+586=' -> '7+6+0=13 4+8+1=13 3+5+1=09 #### 933' "
        "(20-60 tokens; reward final_answer), whose fields default to: "
        + ", ".join(f"{k} {v}" for k, v in TASK_DEFAULTS["scratchpad"].items())
        + ".",
    )
    operand_min: int = Field(10, description="Smallest operand (inclusive).")
    operand_max: int = Field(99, description="Largest operand (inclusive).")
    n_eval: int = Field(400, description="Prompts held out for eval; train prompts come from the rest.")
    # Fields beyond TOY_VERSION 1's leave the dump (the cache key) while at their default,
    # so the builds cached under version 1 stay valid.
    n_train: int | None = Field(
        None,
        ge=1,
        exclude_if=lambda v: v is None,
        description="Train prompts: the first n of the seeded shuffle after the eval prompts "
        "(512 to 7,700 with the default operands); unset: all of them.",
    )

    # --- model ---
    hidden_size: int = Field(128, description="Width of the residual stream.")
    num_layers: int = Field(2, description="Transformer blocks.")
    num_heads: int = Field(
        4,
        description="Attention heads; head_dim = hidden_size / num_heads must be one vLLM's "
        "CPU attention supports (32, 64, 80, 96, 112, 128, ...).",
    )
    intermediate_size: int = Field(512, description="MLP width.")
    max_position_embeddings: int = Field(
        64, description="Longest sequence (prompt + response) the model accepts."
    )

    # --- warm start ---
    batch_size: int = Field(128, description="Sequences per optimizer step.")
    learning_rate: float = Field(1e-3, description="AdamW learning rate (constant after warmup).")
    warmup_steps: int = Field(20, description="Linear learning-rate warmup.")
    max_steps: int = Field(1500, description="Give up on reaching the target after this many.")
    eval_every: int = Field(5, description="Steps between greedy eval-accuracy checks.")
    target_accuracy: float = Field(
        0.30, description="Stop at the first check whose greedy eval accuracy reaches this."
    )
    label_noise: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        exclude_if=lambda v: v == 0.0,
        description="Fraction of the warm start's supervised answers replaced by a wrong one "
        "(off by 1-10, chosen by the seed); train.parquet keeps the right references.",
    )
    num_threads: int = Field(2, description="torch intra-op threads (fixed for determinism).")

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data):
        """Fields not given take the task's defaults (TASK_DEFAULTS), then the field defaults."""
        if isinstance(data, dict) and data.get("task") in TASK_DEFAULTS:
            return {**TASK_DEFAULTS[data["task"]], **data}
        return data

    @model_validator(mode="after")
    def _buildable(self) -> ToyConfig:
        check_toy_config(self)
        return self


def check_toy_config(config: ToyConfig) -> None:
    """One-line ValueError unless vLLM can load the model and the prompts can be split as
    asked (also run on configs that skipped validation, e.g. `model_copy(update=...)`)."""
    head_dim, rem = divmod(config.hidden_size, config.num_heads)
    if rem:
        raise ValueError(f"hidden_size {config.hidden_size} not divisible by num_heads {config.num_heads}")
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim = hidden_size / num_heads = {config.hidden_size} / {config.num_heads} = {head_dim} "
            f"is not a head size vLLM's CPU attention supports: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}"
        )
    n_problems = (config.operand_max - config.operand_min + 1) ** 2
    if not 0 < config.n_eval < n_problems:
        raise ValueError(f"n_eval={config.n_eval} must be between 1 and {n_problems - 1}")
    if config.n_train is not None and config.n_train > n_problems - config.n_eval:
        raise ValueError(
            f"n_train={config.n_train} is more than the {n_problems - config.n_eval} prompts left after "
            f"n_eval={config.n_eval} (operands {config.operand_min}..{config.operand_max})"
        )
    if config.task != "addition":
        if config.label_noise:
            raise ValueError(f"label_noise is for the addition task only, not {config.task}")
        longest = longest_prompt(config) + longest_response(config) + 1  # + EOS
        if longest > config.max_position_embeddings:
            raise ValueError(
                f"max_position_embeddings={config.max_position_embeddings} is shorter than the longest "
                f"{config.task} sequence ({longest} tokens with operands up to {config.operand_max})"
            )


# ---------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------


def make_problems(config: ToyConfig, seed: int) -> tuple[pa.Table, pa.Table]:
    """All `a+b=` prompts over the operand range, split into (train, eval) by the seed: eval
    is the first `n_eval` of a seeded shuffle, train the next `n_train` (all the rest when
    unset), so every train-set size shares the same eval prompts."""
    check_toy_config(config)
    operands = np.arange(config.operand_min, config.operand_max + 1)
    a, b = (x.ravel() for x in np.meshgrid(operands, operands, indexing="ij"))
    order = np.random.default_rng(seed).permutation(len(a))
    n_train = config.n_train or len(a) - config.n_eval

    def table(idx: np.ndarray) -> pa.Table:
        return pa.table(
            {
                "prompt": pa.array([f"{a[i]}+{b[i]}=" for i in idx], pa.string()),
                "reference": pa.array([str(a[i] + b[i]) for i in idx], pa.string()),
            }
        )

    return table(order[config.n_eval : config.n_eval + n_train]), table(order[: config.n_eval])


def longest_prompt(config: ToyConfig) -> int:
    """Tokens of the longest prompt: BOS + "a+b=" with both operands at their widest."""
    return 1 + 2 * len(str(config.operand_max)) + 2


def longest_response(config: ToyConfig) -> int:
    """Characters (= tokens, without EOS) of the longest reference response of the task."""
    if config.task == "addition":
        return len(str(2 * config.operand_max))
    return len(scratchpad_solution(config.operand_max, config.operand_max))


def response_answer(config: ToyConfig, response: str) -> str | None:
    """The final answer a response gives: all of it (addition), or what follows the last
    `####` (scratchpad; None without one). Exact match with the reference is the reward."""
    return response.strip() if config.task == "addition" else final_answer(response)


def supervised_responses(train: pa.Table, config: ToyConfig, seed: int) -> list[str]:
    """The responses the warm start learns: `supervised_answers` (addition), or the full
    scratchpad solution of each prompt."""
    if config.task == "addition":
        return supervised_answers(train, config, seed)
    operands = (prompt.removesuffix("=").split("+") for prompt in train.column("prompt").to_pylist())
    return [scratchpad_solution(int(a), int(b)) for a, b in operands]


def supervised_answers(train: pa.Table, config: ToyConfig, seed: int) -> list[str]:
    """The answers the warm start learns: the references, except for a seeded `label_noise`
    fraction of rows whose answer is off by 1-10 (a plausible slip, never the right one)."""
    answers = train.column("reference").to_pylist()
    n_wrong = round(config.label_noise * len(answers))
    if n_wrong == 0:
        return answers
    rng = np.random.default_rng([seed, 1])  # a stream apart from the split's
    rows = rng.choice(len(answers), size=n_wrong, replace=False)
    offsets = rng.integers(1, 11, size=n_wrong) * rng.choice([-1, 1], size=n_wrong)
    for row, offset in zip(rows.tolist(), offsets.tolist()):
        right = int(answers[row])
        answers[row] = str(right + offset if right + offset >= 0 else right - offset)
    return answers


# ---------------------------------------------------------------------------------------
# Named variants: the same task with another model, train set or warm start
# ---------------------------------------------------------------------------------------

VARIANTS: dict[str, ToyConfig] = {
    # the default toy: 2 layers x 128, all 7,700 train prompts, clean warm start to 30%
    "default": ToyConfig(),
    # twice the depth: a model with more capacity, warm-started to the same accuracy
    "deep": ToyConfig(num_layers=4),
    # a quarter of the supervised answers wrong: a miscalibrated start, ~25% greedy
    "noisy": ToyConfig(label_noise=0.25, target_accuracy=0.25),
    # 768 train prompts and a weaker start: RL must generalise from few prompts
    "small": ToyConfig(n_train=768, target_accuracy=0.20),
}
"""Task variants for benchmarks: recipe defaults are chosen on these together, never on one."""


def variant_config(variant: str, task: str = "addition") -> ToyConfig:
    """The config of a named variant of a task: for addition the variant itself, for another
    task the task's config with the fields the variant changes (e.g. deep: 4 layers); a
    one-line error naming the variants (or tasks) otherwise."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown toy variant {variant!r}: one of {', '.join(VARIANTS)}")
    if task == "addition":
        return VARIANTS[variant]
    if task not in TASKS:
        raise ValueError(f"unknown toy task {task!r}: one of {', '.join(TASKS)}")
    try:
        return ToyConfig(**VARIANTS[variant].model_dump(exclude_defaults=True), task=task)
    except ValidationError as exc:
        problems = "; ".join(err["msg"].removeprefix("Value error, ") for err in exc.errors())
        raise ValueError(f"toy variant {variant!r} of the {task} task: {problems}") from None
