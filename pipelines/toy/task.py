"""The toy's tasks and their config: `ToyConfig` (task, model, warm start), the problems and
the supervised responses of each task, and the named `VARIANTS`.

This module stays light (pydantic, numpy, pyarrow): the CLI generates `groupforge toy build`'s
flags from ToyConfig. The build itself (torch, transformers) is pipelines/toy/build.py.
"""

from __future__ import annotations

import math
import re
from typing import Literal, get_args

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipelines.toy.families import FAMILIES, example

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM's CPU attention supports (`CPUAttentionBackend.get_supported_head_sizes`)."""


Task = Literal["addition", "scratchpad", "multiply", "reverse", "sort", "max"]
TASKS: tuple[str, ...] = get_args(Task)
"""The toy's tasks (pipelines/toy/families.py); addition is the default."""
assert TASKS == tuple(FAMILIES), "Task lists the families of FAMILIES, in order"
TASK_DESCRIPTIONS = {name: family.description for name, family in FAMILIES.items()}
TASK_DEFAULTS: dict[str, dict] = {name: family.defaults for name, family in FAMILIES.items() if family.defaults}
"""The field defaults of a task other than addition, where they differ from ToyConfig's."""
SHUFFLE_ALL = 1 << 24
"""Up to this many problems, the split shuffles all of them; beyond, it draws SAMPLED of them."""
SAMPLED = 1 << 20


def _task_help() -> str:
    """The --task help: each family's example, then the fields whose defaults it changes."""
    parts = []
    for name in TASKS:
        prompt, response = example(name)
        defaults = ", ".join(f"{k} {v}" for k, v in TASK_DEFAULTS.get(name, {}).items())
        parts.append(f"{name}: {prompt!r} -> {response!r}" + (f" ({defaults})" if defaults else ""))
    return ". ".join(parts) + ". A task's defaults apply to the fields not given."


class ToyConfig(BaseModel):
    """Everything that determines the built toy, together with the seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- task ---
    task: Task = Field(
        "addition",
        exclude_if=lambda v: v == "addition",
        description=_task_help(),
    )
    operand_min: int = Field(10, description="Smallest operand (inclusive); multiply's second operand is a digit "
                             "1-9 whatever this is.")
    operand_max: int = Field(99, description="Largest operand (inclusive).")
    n_eval: int = Field(400, description="Prompts held out for eval; train prompts come from the rest.")
    # Fields beyond TOY_VERSION 1's leave the dump (the cache key) while at their default,
    # so the builds cached under version 1 stay valid.
    n_train: int | None = Field(
        None,
        ge=1,
        exclude_if=lambda v: v is None,
        description="Train prompts: the first n of the seeded shuffle after the eval prompts, so every n "
        "shares one eval set (addition: up to 7,700; multiply: up to 88,700; reverse, sort, max: up to 1,048,176); "
        "unset: all of them.",
    )
    warm_start_prompts: int | None = Field(
        None,
        ge=1,
        exclude_if=lambda v: v is None,
        description="The warm start learns the first max(n_train, this) prompts after the eval prompts, so every "
        "smaller train set gets the same warm-started model and RL trains on prompts it learned from; unset: the "
        "train prompts.",
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
    if not 0 <= config.operand_min <= config.operand_max:
        raise ValueError(f"operands {config.operand_min}..{config.operand_max}: need 0 <= operand_min <= operand_max")
    n_problems = problem_count(config)
    n_problems = n_problems if n_problems <= SHUFFLE_ALL else SAMPLED  # the ones the split takes from
    if not 0 < config.n_eval < n_problems:
        raise ValueError(f"n_eval={config.n_eval} must be between 1 and {n_problems - 1}")
    if config.n_train is not None and config.n_train > n_problems - config.n_eval:
        raise ValueError(
            f"n_train={config.n_train} is more than the {n_problems - config.n_eval} prompts left after "
            f"n_eval={config.n_eval} (operands {config.operand_min}..{config.operand_max})"
        )
    if config.warm_start_prompts is not None and config.warm_start_prompts > n_problems - config.n_eval:
        raise ValueError(
            f"warm_start_prompts={config.warm_start_prompts} is more than the {n_problems - config.n_eval} prompts "
            f"left after n_eval={config.n_eval} (operands {config.operand_min}..{config.operand_max})"
        )
    if config.label_noise and config.task != "addition":
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


def operand_ranges(config: ToyConfig) -> tuple[tuple[int, int], ...]:
    """The inclusive range of each operand of the config's task."""
    return FAMILIES[config.task].operands(config.operand_min, config.operand_max)


def problem_count(config: ToyConfig) -> int:
    """How many problems (operand tuples) the config's operand ranges make."""
    return math.prod(hi - lo + 1 for lo, hi in operand_ranges(config))


def problem_order(n_problems: int, seed: int) -> np.ndarray:
    """Problem indices in the seeded order the split takes them: a permutation of all of them, or,
    beyond SHUFFLE_ALL problems, the first SAMPLED distinct ones of 2 x SAMPLED seeded draws
    (of which some 1.97 x SAMPLED are distinct there)."""
    rng = np.random.default_rng(seed)
    if n_problems <= SHUFFLE_ALL:
        return rng.permutation(n_problems)
    draws = rng.integers(0, n_problems, size=2 * SAMPLED)
    _, first = np.unique(draws, return_index=True)
    return draws[np.sort(first)][:SAMPLED]


def make_problems(config: ToyConfig, seed: int) -> tuple[pa.Table, pa.Table]:
    """All problems of the task over its operand ranges, split into (train, eval) by the seed:
    eval is the first `n_eval` of a seeded shuffle, train the next `n_train` (all the rest
    when unset), so every train-set size shares the same eval prompts."""
    check_toy_config(config)
    order = problem_order(problem_count(config), seed)
    n_train = config.n_train or len(order) - config.n_eval
    return _problems(config, order[config.n_eval : config.n_eval + n_train]), _problems(config, order[: config.n_eval])


def warm_start_problems(config: ToyConfig, seed: int) -> pa.Table:
    """The problems the warm start learns: the train problems, or, with `warm_start_prompts`
    above n_train, the first that many after the eval problems (the train problems first), so
    that a train set of 256 prompts starts from the same model as one of 8,192."""
    check_toy_config(config)
    order = problem_order(problem_count(config), seed)
    n_train = config.n_train or len(order) - config.n_eval
    n_warm = max(n_train, config.warm_start_prompts or 0)
    return _problems(config, order[config.n_eval : config.n_eval + n_warm])


def _problems(config: ToyConfig, idx: np.ndarray) -> pa.Table:
    """The prompt and reference of each problem index: problem i is the i-th operand tuple in
    row-major order (addition: a, then b)."""
    family = FAMILIES[config.task]
    ranges = operand_ranges(config)
    offsets = np.unravel_index(idx, [hi - lo + 1 for lo, hi in ranges])
    problems = list(zip(*((offset + lo).tolist() for offset, (lo, _) in zip(offsets, ranges))))
    return pa.table(
        {
            "prompt": pa.array([family.prompt(*p) for p in problems], pa.string()),
            "reference": pa.array([family.reference(*p) for p in problems], pa.string()),
        }
    )


def operands_of(prompt: str) -> tuple[int, ...]:
    """The operands of a prompt: its numbers, in order ('3471*6=' -> (3471, 6))."""
    return tuple(int(n) for n in re.findall(r"\d+", prompt))


def longest_prompt(config: ToyConfig) -> int:
    """Tokens of the longest prompt: BOS + the prompt of the largest operands (the longest
    in every family)."""
    return 1 + len(FAMILIES[config.task].prompt(*(hi for _, hi in operand_ranges(config))))


def longest_response(config: ToyConfig) -> int:
    """Characters (= tokens, without EOS) of the longest supervised response of the task: that
    of the largest operands (the longest in every family)."""
    family = FAMILIES[config.task]
    return len((family.response or family.reference)(*(hi for _, hi in operand_ranges(config))))


def response_answer(config: ToyConfig, response: str) -> str | None:
    """The final answer a response gives: all of it, stripped, or what follows the last
    `####` (scratchpad; None without one). Exact match with the reference is the reward."""
    return FAMILIES[config.task].answer(response)


def supervised_responses(train: pa.Table, config: ToyConfig, seed: int) -> list[str]:
    """The responses the warm start learns: the family's response to each prompt, or, where
    it has none, the reference (`supervised_answers`, with addition's label noise)."""
    response = FAMILIES[config.task].response
    if response is None:
        return supervised_answers(train, config, seed)
    return [response(*operands_of(prompt)) for prompt in train.column("prompt").to_pylist()]


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


SHAPES: dict[str, dict[str, int]] = {
    "narrow": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},  # the scratchpad's
    "base": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512},  # addition's
    "deep": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512},
    "wide": {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "intermediate_size": 1024},
}
"""Named model shapes (`groupforge toy build --shape`): the model fields they set, each with a head
size vLLM's CPU attention supports. The warm start stops on the same target accuracy whatever the
shape, so shapes differ in capacity, not in where RL starts."""


def shape_fields(shape: str | None) -> dict[str, int]:
    """The model fields of a named shape ({} for None); a one-line error naming the shapes otherwise."""
    if shape is None:
        return {}
    if shape not in SHAPES:
        raise ValueError(f"unknown toy shape {shape!r}: one of {', '.join(SHAPES)}")
    return SHAPES[shape]


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
