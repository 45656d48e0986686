"""The tool-using toy: multiplication the 0.5M toy cannot learn by heart, and a calculator it
can call through a chat template of its own.

    prompt            a*b=                 a in 100..999, b in 10..99: a 4-5 digit product
    with tools        <bos>[calculator]a*b=   (the template names each tool it is given)
    a tool call       <tool_call>{"name":"calculator","arguments":{"expression":"a*b"}}</tool_call><eos>
    the tool's turn   (product)             (the template's rendering of the tool message)
    the answer        product<eos>

The frame of a call (`<tool_call>`, the JSON up to the expression, its end) is a handful of
whole-word tokens beside the characters, as a real tokenizer's vocabulary would have them, so
a call is ~12 tokens and the parser reads it as any Hermes-style call.

The warm start learns two kinds of conversation for every train prompt: without tools, the
direct answer; with tools, a call to the calculator on `tool_share` of them (chosen by the
seed) and the direct answer on the rest. Only the model's tokens are supervised (the prompt and
the tool's turn are masked). So the model starts out calling the tool sometimes, and mostly
answering by heart, which it does badly: RL on the multi-turn rollouts has something to learn.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from pipelines.toy.families import CHARACTERS
from pipelines.toy.task import problem_order

TOOL_TOY_VERSION = 1
TOOL = "calculator"
TOOL_WORDS = (f"[{TOOL}]", "<tool_call>", "</tool_call>", '{"name":"calculator","arguments":{"expression":"', '"}}')
"""The vocabulary's whole-word tokens: the tools mark, a call's frame."""
CHARACTERS_TOOLS = CHARACTERS + "()"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}{{ message.content }}"
    "{% elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}({{ message.content }})"
    "{% endif %}{% endfor %}"
)
"""No generation prompt: the answer follows the prompt (or the tool's turn) directly."""


class ToolToyConfig(BaseModel):
    """Everything that determines the built tool toy, with the seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a_min: int = Field(100, description="Smallest first operand.")
    a_max: int = Field(999, description="Largest first operand.")
    b_min: int = Field(10, description="Smallest second operand.")
    b_max: int = Field(99, description="Largest second operand.")
    n_eval: int = Field(400, description="Prompts held out for eval.")
    n_train: int = Field(20000, description="Train prompts (the warm start learns them too).")
    tool_share: float = Field(0.1, ge=0.0, le=1.0, description="Share of the with-tools conversations of the "
                              "warm start that call the calculator.")
    hidden_size: int = Field(128, description="Width of the residual stream (the toy's).")
    num_layers: int = Field(2, description="Transformer blocks.")
    num_heads: int = Field(4, description="Attention heads (head_dim 32: one vLLM's CPU attention supports).")
    intermediate_size: int = Field(512, description="MLP width.")
    max_position_embeddings: int = Field(128, description="Longest sequence (RoPE: no weight depends on it); "
                                         "room for a tool error's message.")
    batch_size: int = Field(128, description="Conversations per warm start step.")
    learning_rate: float = Field(1e-3, description="AdamW learning rate (constant after warmup).")
    warmup_steps: int = Field(20, description="Linear learning-rate warmup.")
    steps: int = Field(600, description="Warm start optimizer steps.")
    num_threads: int = Field(2, description="torch intra-op threads (fixed for determinism).")


def call_text(expression: str) -> str:
    """The assistant's text of a calculator call on `expression`."""
    return f"{TOOL_WORDS[1]}{TOOL_WORDS[3]}{expression}{TOOL_WORDS[4]}{TOOL_WORDS[2]}"


def make_tool_tokenizer(config: ToolToyConfig):
    """The toy's character tokenizer with the tool words added and the chat template set."""
    from pipelines.toy.model import make_tokenizer

    tokenizer = make_tokenizer(config.max_position_embeddings, CHARACTERS_TOOLS)
    tokenizer.add_tokens(list(TOOL_WORDS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def problems(config: ToolToyConfig, seed: int) -> tuple[pa.Table, pa.Table]:
    """(train, eval) prompts `a*b=` with their products as references: eval the first `n_eval`
    of a seeded shuffle of all pairs, train the next `n_train`."""
    width = config.b_max - config.b_min + 1
    count = (config.a_max - config.a_min + 1) * width
    if config.n_eval + config.n_train > count:
        raise ValueError(f"n_eval + n_train = {config.n_eval + config.n_train} is more than the {count} problems")
    order = problem_order(count, seed)

    def table(idx: np.ndarray) -> pa.Table:
        a, b = idx // width + config.a_min, idx % width + config.b_min
        return pa.table({"prompt": pa.array([f"{x}*{y}=" for x, y in zip(a, b)], pa.string()),
                         "reference": pa.array([str(x * y) for x, y in zip(a, b)], pa.string())})

    return table(order[config.n_eval:config.n_eval + config.n_train]), table(order[:config.n_eval])


def calls_tool(prompt: str, seed: int, share: float) -> bool:
    """Whether a warm start's with-tools conversation of `prompt` calls the calculator: a seeded
    hash of the prompt below `share` (this toy's, and a chat model's tool warm start)."""
    digest = hashlib.sha256(f"{seed}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def conversation(tokenizer, prompt: str, reference: str, *, tools: bool, call: bool) -> tuple[list[int], list[int]]:
    """Token ids of one supervised conversation and their labels (-100 off the model's tokens):
    the prompt, a calculator call and its result when `call`, the answer."""
    from training.supervised import supervised_ids

    messages = [{"role": "user", "content": prompt}]
    if call:
        messages += [{"role": "assistant", "content": call_text(prompt.rstrip("="))},
                     {"role": "tool", "content": reference}]
    messages.append({"role": "assistant", "content": reference})
    return supervised_ids(tokenizer, messages, [{"type": "function", "function": {"name": TOOL}}] if tools else None)


def warm_start(model, tokenizer, train: pa.Table, config: ToolToyConfig, seed: int) -> dict:
    """Teacher-forced SFT on the conversations of every train prompt (module docstring)."""
    import torch

    from training.supervised import SeededBatches, supervised_step

    examples = []
    for prompt, reference in zip(train.column("prompt").to_pylist(), train.column("reference").to_pylist()):
        examples.append(conversation(tokenizer, prompt, reference, tools=False, call=False))
        examples.append(conversation(tokenizer, prompt, reference, tools=True,
                                     call=calls_tool(prompt, seed, config.tool_share)))
    width = max(len(ids) for ids, _ in examples)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in examples])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
    attention = (torch.arange(width)[None, :] < torch.tensor([len(ids) for ids, _ in examples])[:, None]).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps)))
    batches, loss = SeededBatches(len(examples), config.batch_size, seed), float("nan")
    model.train()
    for _ in range(config.steps):
        rows = batches.next()
        loss = supervised_step(model, optimizer, schedule, input_ids[rows], attention[rows], labels[rows])
    model.eval()
    return {"steps": config.steps, "final_loss": round(loss, 4), "conversations": len(examples)}


def measures(model, tokenizer, eval_: pa.Table) -> dict:
    """The built model on the eval prompts: greedy accuracy without tools, and with tools the
    mean probability that its first token opens a tool call (its sampled tool-use rate)."""
    import torch

    from pipelines.toy.model import generate_responses

    prompts, references = eval_.column("prompt").to_pylist(), eval_.column("reference").to_pylist()
    greedy = generate_responses(model, tokenizer, prompts, max_new_tokens=8)
    accuracy = float(np.mean([g[0].strip() == r for g, r in zip(greedy, references)]))
    schemas = [{"type": "function", "function": {"name": TOOL}}]
    with torch.no_grad():
        ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=schemas,
                                                          tokenize=True, add_generation_prompt=True, return_dict=False)
                            for p in prompts])  # every prompt has the same length: a*b= with fixed widths
        first = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
    open_id = tokenizer.convert_tokens_to_ids(TOOL_WORDS[1])
    return {"eval_accuracy_without_tools": accuracy,
            "eval_tool_call_probability": round(float(first[:, open_id].mean()), 4)}


def build_tool_toy(out: str | Path = "runs/toy-tools", seed: int = 0, config: ToolToyConfig | None = None,
                   force: bool = False) -> Path:
    """Build (or reuse, when toy.json records the same config and seed) the tool toy at `out`:
    model/ (with its chat template), train.parquet, eval.parquet, toy.json. Built in a folder
    beside `out` and renamed into place, as the toy is (pipelines/toy/build.py)."""
    import torch

    from pipelines.toy.build import _remove_abandoned_builds, _replace_dir, _temp_prefix, _torch_threads
    from pipelines.toy.model import make_model
    from store.errors import disk_write
    from training.checkpoint import quiet_transformers

    out, config = Path(out), config or ToolToyConfig()
    key = {"version": TOOL_TOY_VERSION, "seed": seed, "config": config.model_dump()}
    meta_file = out / "toy.json"
    if not force and meta_file.exists() and {k: json.loads(meta_file.read_text()).get(k) for k in key} == key:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(out)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out, "building"), dir=out.parent))
    try:
        tmp.chmod(0o755)
        started = time.perf_counter()
        with disk_write(out), quiet_transformers(), _torch_threads(config.num_threads):
            train, eval_ = problems(config, seed)
            pq.write_table(train, tmp / "train.parquet")
            pq.write_table(eval_, tmp / "eval.parquet")
            torch.manual_seed(seed)
            tokenizer = make_tool_tokenizer(config)
            model = make_model(config, tokenizer)
            warm = warm_start(model, tokenizer, train, config, seed)
            model.save_pretrained(tmp / "model", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "model")
            for path in (tmp / "model").iterdir():
                path.chmod(0o644)
            meta = {**key, "task": "a*b= (3-digit x 2-digit) with a calculator tool; reward = exact match",
                    "parameters": sum(p.numel() for p in model.parameters()), "warm_start": warm,
                    **measures(model, tokenizer, eval_), "seconds": round(time.perf_counter() - started, 1)}
            (tmp / "toy.json").write_text(json.dumps(meta, indent=2) + "\n")
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
