"""`groupforge init`: a commented starter spec for one's own model and prompts.

    groupforge init --model DIR --prompts FILE [--eval FILE] [--objective grpo] [--out spec.toml]

It checks the model folder (curation/generate/weights.py) and reads the prompts as the
generate stage does (curation/generate/base.py), then looks at what the spec depends on: the
prompt column or messages (and whether the tokenizer has a chat template for them), prompt
lengths in tokens, and the reference answers' lengths. From those it writes [generator]
max_tokens (twice the longest reference answer, at least 16), the reward (exact_match when
there is a reference column) and the eval set. Whatever it cannot decide is a string starting
with "TODO" that `load_spec` refuses, naming the key, until it is filled in.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OBJECTIVES = ("grpo", "gspo", "pairwise", "sft")
SAMPLED_ROWS = 2000  # prompts tokenized to measure lengths (a seeded sample of a large file)


@dataclass
class PromptFacts:
    """What init learned from the prompts file and the tokenizer."""

    rows: int
    column: str  # "prompt" or "messages"
    has_reference: bool
    chat_template: bool
    prompt_tokens: tuple[int, int]  # median, max over the sampled rows
    answer_tokens: tuple[int, int] | None  # median, max of the references, in tokens


def inspect_prompts(tokenizer, model: Path, prompts: Path) -> PromptFacts:
    """Columns and token lengths of `prompts` under `model`'s `tokenizer` (errors name the file)."""
    from curation.generate.base import load_prompts, tokenize_prompt

    table = load_prompts(prompts)
    n = table.num_rows
    rows = np.sort(np.random.default_rng(0).choice(n, size=min(n, SAMPLED_ROWS), replace=False))
    sample = table.take(rows).to_pylist()
    uses_messages = all(r["prompt"] is None for r in sample)
    chat_template = bool(getattr(tokenizer, "chat_template", None))
    if uses_messages and not chat_template:
        raise ValueError(f"prompts file {prompts}: prompts are given as 'messages', but the tokenizer of {model} "
                         "has no chat template to render them: give a 'prompt' column, or a model with one")
    lengths = [len(tokenize_prompt(tokenizer, r["prompt"], r["messages"] if r["prompt"] is None else None))
               for r in sample]
    references = [r["reference"] for r in sample if r["reference"] is not None]
    answers = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in references]
    return PromptFacts(rows=n, column="messages" if uses_messages else "prompt", has_reference=bool(references),
                       chat_template=chat_template,
                       prompt_tokens=(int(np.median(lengths)), max(lengths)),
                       answer_tokens=(int(np.median(answers)), max(answers)) if answers else None)


def starter_spec(model: str | Path, prompts: str | Path, objective: str = "grpo",
                 eval_file: str | Path | None = None, out: str | Path = "spec.toml") -> str:
    """The text of a commented spec for `model` and `prompts` (see the module docstring)."""
    from curation.generate.weights import check_model_folder

    if objective not in OBJECTIVES:
        raise ValueError(f"--objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    model, prompts = Path(model), Path(prompts)
    check_model_folder(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), trust_remote_code=False)
    facts = inspect_prompts(tokenizer, model, prompts)
    eval_facts = inspect_prompts(tokenizer, model, Path(eval_file)) if eval_file is not None else None
    if eval_facts is not None and not eval_facts.has_reference:
        raise ValueError(f"eval file {eval_file}: has no 'reference' values; eval scores greedy answers against them")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{model.resolve().name}-{objective}").strip("-.") or objective
    per_round = min(128, facts.rows)
    max_tokens, length_note = _max_tokens(facts)
    eval_note, eval_line = _eval_entry(facts, eval_facts, prompts, eval_file)
    limit = _line("eval_limit", min(200, (eval_facts or facts).rows), "greedy eval on the first N eval prompts")
    if facts.has_reference:
        reward = ['name = "exact_match"      # the response equals the reference; "math" compares math answers']
    else:
        reward = ['name = "TODO: a reward for prompts without a reference: a registered name or module:function"']
    lines = [
        f"# groupforge starter spec: {objective} on {model} with {prompts}",
        "# Written by `groupforge init`; every value is a starting point. Check it with",
        f"#   groupforge run {out} --set run.rounds=1",
        "# Keys and their meaning: README (The round loop) and `groupforge run --help`.",
        f"# Prompts: {facts.rows:,} rows, column '{facts.column}'"
        + (", rendered with the tokenizer's chat template" if facts.column == "messages" else "")
        + f"; {facts.prompt_tokens[0]} tokens (median), {facts.prompt_tokens[1]} at most.",
        "",
        "[run]",
        f'name = "{name}"',
        "rounds = 20               # each round: sample, score, filter, label, train; round 0 evaluates the start",
        "steps_per_round = 4",
        "seed = 0",
        "checkpoint_every = 5      # and the last round",
        '# trackers = ["tensorboard"]  # also mlflow, trackio, wandb (offline, RUN/trackers/; groupforge[trackers])',
        "",
        "[model]",
        f"path = {_toml(model)}",
        "",
        "[prompts]",
        f"train = [{_toml(prompts)}]",
        eval_note,
        eval_line,
        _line("per_round", per_round, "x group_size = samples per round"),
        limit,
        "",
        "[generator]",
        'backend = "auto"          # vllm where it is faster, else transformers',
        "group_size = 8            # responses per prompt: the group advantages are computed over",
        "temperature = 1.0",
        _line("max_tokens", max_tokens, length_note),
        "",
        "[[score.rewards]]",
        *reward,
        "",
        "[filter]",
        "drop_zero_variance = true # groups whose rewards are all equal carry no signal",
        "",
        "[train]",
        *_train_lines(objective, parameter_count(model)),
        "",
        "[eval]",
        'metric = "exact_match"',
        "every = 5                 # and round 0 and the last",
        "",
    ]
    return "\n".join(lines)


def _max_tokens(facts: PromptFacts) -> tuple[int, str]:
    """[generator] max_tokens: twice the longest reference answer (at least 16), and its comment."""
    if facts.answer_tokens is None:
        return 256, "no reference answers to measure: set it to the longest response you want"
    return max(16, 2 * facts.answer_tokens[1]), (
        f"references are {facts.answer_tokens[0]} tokens (median), {facts.answer_tokens[1]} at most: "
        "twice the longest; raise it for reasoning before the answer")


def _eval_entry(facts: PromptFacts, eval_facts: PromptFacts | None, prompts: Path,
                eval_file: str | Path | None) -> tuple[str, str]:
    """The [prompts] eval key and the comment above it: the --eval file, else the train file when
    it has references (said to be no held-out set), else a TODO."""
    if eval_file is not None:
        return f"# {eval_facts.rows:,} held-out prompts with references", f"eval = {_toml(eval_file)}"
    if facts.has_reference:
        return ("# the train file itself (no --eval given): this measures accuracy on prompts it trains on;\n"
                "# give a held-out file with a reference column for an honest number"), f"eval = {_toml(prompts)}"
    return ("# the prompts have no reference column, so they cannot be the eval set",
            'eval = "TODO: a held-out prompts file with a reference column (eval scores greedy answers)"')


def _toml(value) -> str:
    """A TOML basic string (JSON's escaping is TOML's for these characters)."""
    return json.dumps(str(value), ensure_ascii=False)


def _line(key: str, value, note: str) -> str:
    """`key = value` with its comment in the column the other comments use."""
    return f"{key} = {value}".ljust(25) + f" # {note}"


def parameter_count(model: Path) -> int:
    """Weights in the model folder's safetensors files, from their headers (no tensor read)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def _train_lines(objective: str, parameters: int) -> list[str]:
    if parameters < 50_000_000:  # the toy's recipe (pipelines/specs/toy-grpo.toml) for tiny models
        lr = _line("lr", "2e-4", f"AdamW peak, for a {parameters / 1e6:.1f}M-weight model; "
                   "~1e-5 from ~1B weights")
    else:
        lr = _line("lr", "1e-5", f"AdamW peak, for a {parameters / 1e9:.2f}B-weight model; tiny models take ~2e-4")
    common = [lr, "warmup_steps = 10"]
    return {
        "grpo": ['objective = "grpo"', "batch_size = 256", *common],
        "gspo": ['objective = "gspo"        # sequence-level ratio; the paper\'s clip ranges by default',
                 "batch_size = 256", *common],
        "pairwise": ['objective = "pairwise"    # best vs worst of each group, soft labels', "reference = true "
                     "         # log-ratios against the frozen start model (DPO)", "beta = 0.1",
                     "batch_size = 128          # pairs per step", *common],
        "sft": ['objective = "sft"         # fine-tune on samples better than their group mean',
                "batch_size = 256", *common],
    }[objective]
