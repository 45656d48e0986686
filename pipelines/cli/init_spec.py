"""`groupforge init`: a commented starter spec for one's own model and prompts.

    groupforge init --model DIR --prompts FILE [--eval FILE] [--objective grpo] [--out spec.toml]

It checks the model folder (store/weights.py) and reads the prompts as the
generate stage does (curation/generate/base.py), then looks at what the spec depends on: the
prompt column or messages (and whether the tokenizer has a chat template for them), prompt
lengths in tokens, the reference answers, and the model's own greedy answers to a sample of
the prompts (a chat model answers in a sentence, not in the reference's few tokens). From
those it writes, each with its reason in a comment: [generator] max_tokens (1.5x the longest
greedy answer, at least twice the longest reference and 16), the reward and eval metric (math
when every reference is a number, else exact_match), the eval set, and from the model's size
and this machine's memory the [train] lr, dtype, token_budget and checkpointing
(training/sizing.py, as the trainer would size them). Whatever it cannot decide is a string
starting with "TODO" that `load_spec` refuses, naming the key, until it is filled in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OBJECTIVES = ("grpo", "gspo", "pairwise", "sft")
SAMPLED_ROWS = 2000  # prompts tokenized to measure lengths (a seeded sample of a large file)
PROBE_PROMPTS = 16  # prompts the model answers greedily to size max_tokens
PROBE_TOKENS = 256  # the longest greedy answer the probe waits for
GROUP_SIZE = 8  # responses per prompt that init writes
NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")


@dataclass
class PromptFacts:
    """What init learned from the prompts file and the tokenizer."""

    rows: int
    column: str  # "prompt" or "messages"
    has_reference: bool
    chat_template: bool
    prompt_tokens: tuple[int, int]  # median, max over the sampled rows
    answer_tokens: tuple[int, int] | None  # median, max of the references, in tokens
    numeric_references: bool = False  # every sampled reference is a number
    probe_ids: tuple[tuple[int, ...], ...] = ()  # PROBE_PROMPTS sampled prompts, as token ids


@dataclass
class GreedyAnswers:
    """The model's greedy answers to PROBE_PROMPTS of the prompts (lengths in tokens)."""

    lengths: list[int]

    @property
    def cut(self) -> int:
        """Answers still going at PROBE_TOKENS."""
        return sum(n >= PROBE_TOKENS for n in self.lengths)


def check_objective(objective: str) -> None:
    """A ValueError naming the choices for an objective init does not write."""
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective {objective!r}: one of {', '.join(OBJECTIVES)}")


def inspect_prompts(tokenizer, model: Path, prompts: Path, table) -> PromptFacts:
    """Columns and token lengths of the prompts file `prompts` (read as `table` by load_prompts)
    under `model`'s `tokenizer` (errors name the file)."""
    from curation.generate.base import tokenize_prompt

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
    probe = [tuple(tokenize_prompt(tokenizer, r["prompt"], r["messages"] if r["prompt"] is None else None))
             for r in sample[:PROBE_PROMPTS]]
    return PromptFacts(rows=n, column="messages" if uses_messages else "prompt", has_reference=bool(references),
                       chat_template=chat_template,
                       prompt_tokens=(int(np.median(lengths)), max(lengths)),
                       answer_tokens=(int(np.median(answers)), max(answers)) if answers else None,
                       numeric_references=bool(references) and all(NUMBER.match(t.strip()) for t in references),
                       probe_ids=tuple(probe))


def greedy_answers(model: Path, facts: PromptFacts) -> GreedyAnswers:
    """The model's greedy answers to the sampled prompts, up to PROBE_TOKENS tokens each
    (transformers, fp32: what the eval sees, not the tokens the references have)."""
    from curation.generate.hf import HFGenerator

    engine = HFGenerator(model, batch_size=PROBE_PROMPTS)
    texts = engine.greedy([list(ids) for ids in facts.probe_ids], PROBE_TOKENS)
    lengths = [len(engine.tokenizer(text, add_special_tokens=False).input_ids) for text in texts]
    return GreedyAnswers(lengths)


def starter_spec(model: str | Path, prompts: str | Path, objective: str = "grpo",
                 eval_file: str | Path | None = None, out: str | Path = "spec.toml") -> str:
    """The text of a commented spec for `model` and `prompts` (see the module docstring)."""
    from curation.generate.base import load_prompts
    from store.weights import check_model_folder, count_parameters

    check_objective(objective)
    model, prompts = Path(model), Path(prompts)
    table = load_prompts(prompts)  # a bad prompts file is refused before the model's libraries load
    eval_table = load_prompts(Path(eval_file)) if eval_file is not None else None
    check_model_folder(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), trust_remote_code=False)
    facts = inspect_prompts(tokenizer, model, prompts, table)
    eval_facts = inspect_prompts(tokenizer, model, Path(eval_file), eval_table) if eval_file is not None else None
    if eval_facts is not None and not eval_facts.has_reference:
        raise ValueError(f"eval file {eval_file}: has no 'reference' values; eval scores greedy answers against them")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{model.resolve().name}-{objective}").strip("-.") or objective
    parameters = count_parameters(model)
    shape = _round_shape(facts, parameters)
    max_tokens, length_note = _max_tokens(facts, greedy_answers(model, facts))
    eval_note, eval_line = _eval_entry(facts, eval_facts, prompts, eval_file)
    limit = _line("eval_limit", min(200, (eval_facts or facts).rows), "greedy eval on the first N eval prompts")
    metric, metric_note = _metric(facts)
    if facts.has_reference:
        reward = [f'name = "{metric}"'.ljust(25) + f" # {metric_note}"]
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
        _line("steps_per_round", shape.steps, shape.steps_note),
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
        _line("per_round", shape.per_round, shape.per_round_note),
        limit,
        "",
        "[generator]",
        'backend = "auto"          # vllm where it is faster, else transformers',
        _line("group_size", GROUP_SIZE, "responses per prompt: the group advantages are computed over"),
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
        *_train_lines(objective, parameters, shape),
        *_memory_lines(model, facts, max_tokens, parameters, objective),
        "",
        "[eval]",
        _line("metric", f'"{metric}"', "greedy answers scored like the reward"),
        "every = 5                 # and round 0 and the last",
        "",
    ]
    return "\n".join(lines)


def _max_tokens(facts: PromptFacts, greedy: GreedyAnswers) -> tuple[int, str]:
    """[generator] max_tokens: 1.5x the model's longest greedy answer to the sampled prompts,
    rounded up to a multiple of 16, at least twice the longest reference and 16; and its comment."""
    longest = max(greedy.lengths, default=0)
    floor = 2 * facts.answer_tokens[1] if facts.answer_tokens else 0
    value = max(16, floor, -(-int(1.5 * longest) // 16) * 16)
    note = (f"the model's greedy answers to {len(greedy.lengths)} prompts: {int(np.median(greedy.lengths))} tokens "
            f"(median), {longest} at most; 1.5x that")
    if greedy.cut:
        note += f" ({greedy.cut} still going at {PROBE_TOKENS}: raise it for longer reasoning)"
    if facts.answer_tokens:
        note += f", at least twice the longest reference ({facts.answer_tokens[1]} tokens)"
    return value, note


@dataclass
class RoundShape:
    """[prompts] per_round, [run] steps_per_round and [train] batch_size, with their reasons."""

    per_round: int
    per_round_note: str
    steps: int
    steps_note: str
    batch_size: int
    share_prompts: bool = False


def _round_shape(facts: PromptFacts, parameters: int) -> RoundShape:
    """128 prompts and 4 steps of 256 for tiny models or on a GPU. On a CPU a model of 50M weights
    or more trains at ~100-300 tokens/s: 16 prompts x 8 and 2 steps of 64 (each sample about
    once, a round of ~2 min for 0.1B), each prompt trained once per group (share_prompts: 0.73x
    the train time on SmolLM2's 47-token chat prompts, BENCHMARKS, real model)."""
    import torch

    if parameters < 50_000_000 or torch.cuda.is_available():
        return RoundShape(min(128, facts.rows), "x group_size = samples per round", 4, "", 256)
    per_round = min(16, facts.rows)
    batch = per_round * GROUP_SIZE // 2
    return RoundShape(per_round, f"x group_size = samples per round; a {parameters / 1e9:.2f}B model trains at "
                                 "~100-300 tokens/s on a CPU: ~2 min a round",
                      2, f"2 steps of {batch} samples: each sample about once", batch, True)


def _metric(facts: PromptFacts) -> tuple[str, str]:
    """The reward and eval metric for prompts with references, and why."""
    if facts.numeric_references:
        return "math", "every reference is a number: math-verify finds it in a sentence too"
    return "exact_match", 'the response equals the reference; "math" compares math answers'


def matmul_speed(dtype, rows: int = 256, hidden: int = 576, width: int = 1536) -> float:
    """GFLOP/s of a (rows x hidden) @ (hidden x width) matmul in `dtype` on the CPU, best of 3."""
    import time

    import torch

    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, width, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * rows * hidden * width / best / 1e9


def _memory_lines(model: Path, facts: PromptFacts, max_tokens: int, parameters: int, objective: str) -> list[str]:
    """[train] dtype, token_budget and checkpointing for this machine, as the trainer sizes them
    (training/sizing.py) with a vLLM engine in the same process, each with its reason."""
    import torch

    from curation.generate.stage import resolve_backend
    from training.config import TrainConfig
    from training.sizing import GIB, ModelShape, engine_bytes, plan_micro_batches

    if torch.cuda.is_available():
        return [_line("dtype", '"auto"', "bfloat16 autocast on this GPU"),
                "# token_budget: sized by the trainer from the GPU's memory (training/sizing.py)"]
    fp32, bf16 = matmul_speed(torch.float32), matmul_speed(torch.bfloat16)
    faster = bf16 > 1.2 * fp32
    dtype = _line("dtype", '"bfloat16"' if faster else '"float32"',
                  f"this CPU's matmuls: {fp32:.0f} GFLOP/s in float32, {bf16:.1f} in bfloat16 (measured by init)")
    shape = ModelShape.of_folder(model)
    engine = engine_bytes(parameters, 4, GIB) if resolve_backend("auto", model) == "vllm" else 0
    reference = TrainConfig(objective=objective, reference=objective == "pairwise").uses_reference()
    plan = plan_micro_batches(shape, longest_sequence=facts.prompt_tokens[1] + max_tokens, reference=reference,
                              autocast=faster, engine=engine)
    lines = [dtype, f"# {plan.reason}"]
    lines.append(_line("token_budget", plan.token_budget, "padded tokens per micro-batch, from the line above"))
    lines.append(_line("checkpointing", '"on"' if plan.checkpointing else '"off"',
                       "recompute layers in backward only when the budget needs it (slower a token)"))
    return lines


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
    """`key = value` with its comment (if any) in the column the other comments use."""
    return f"{key} = {value}".ljust(25) + f" # {note}" if note else f"{key} = {value}"


def _train_lines(objective: str, parameters: int, shape: RoundShape) -> list[str]:
    if parameters < 50_000_000:  # the toy's recipe (pipelines/specs/toy-grpo.toml) for tiny models
        lr = _line("lr", "2e-4", f"AdamW peak, for a {parameters / 1e6:.1f}M-weight model; "
                   "~1e-5 from ~1B weights")
    else:
        lr = _line("lr", "1e-5", f"AdamW peak, for a {parameters / 1e9:.2f}B-weight model; tiny models take ~2e-4")
    common = [lr, "warmup_steps = 10"]
    batch = f"batch_size = {shape.batch_size}"
    if shape.share_prompts and objective != "pairwise":
        common.append(_line("share_prompts", "true", "each prompt trained once per group, its responses after it"))
    return {
        "grpo": ['objective = "grpo"', batch, *common],
        "gspo": ['objective = "gspo"        # sequence-level ratio; the paper\'s clip ranges by default', batch,
                 *common],
        "pairwise": ['objective = "pairwise"    # best vs worst of each group, soft labels', "reference = true "
                     "         # log-ratios against the frozen start model (DPO)", "beta = 0.1",
                     _line("batch_size", shape.batch_size // 2, "pairs per step"), *common],
        "sft": ['objective = "sft"         # fine-tune on samples better than their group mean', batch, *common],
    }[objective]
