"""A tool-use warm start for a chat model: a short supervised pass on conversations in which the
model calls a calculator on some of its prompts, so that RL on multi-turn rollouts starts from a
model that calls it sometimes (SmolLM2-135M-Instruct never does on its own: 0 calls in 16
tries with the tools described in its system message).

    system     the tools, as the environment describes them (`tools_prompt`: its system message
               in the Hermes form, or the template's `tools`)
    user       What is 347 * 586? Reply with just the number.
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 586"}}</tool_call>
    tool       203342
    assistant  203342

on `tool_share` of the prompts (chosen by the seed), the direct answer on the rest; and as many
conversations without the tools (the user's question, the direct answer), so that the same
model answers a prompt that offers no tool as a run without tools asks it to. Only the
assistant turns are supervised; each turn is the template's rendering after the conversation
before it, so the tokens are those the multi-turn driver will see. The weights are written as
safetensors into a new model folder, with the tokenizer and its chat template.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from curation.env.environments import prompt_messages
from pipelines.models.chat_tasks import task_rows
from pipelines.toy.tool_toy import calls_tool


def expression_of(question: str) -> str:
    """The arithmetic of a task's question ('What is 347 * 586? ...' -> '347 * 586')."""
    found = re.search(r"\d+(?:\s*[-+*]\s*\d+)+", question)
    if found is None:
        raise ValueError(f"no arithmetic expression in {question!r}")
    return found.group(0)


def conversation(row: dict, environment: Any | None, calls: bool) -> list[dict[str, Any]]:
    """The supervised conversation of a prompt row: the environment's opening (None: the row's
    messages, no tools), then the answer (through a calculator call when `calls`)."""
    messages = environment.reset(row) if environment is not None else prompt_messages(row)
    if calls:
        call = {"name": "calculator", "arguments": {"expression": expression_of(messages[-1]["content"])}}
        messages += [{"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                     {"role": "tool", "content": row["reference"]}]
    return messages + [{"role": "assistant", "content": row["reference"]}]


def tool_warm_start(model: str | Path, out: str | Path, task: str, *, prompts: int = 128, tool_share: float = 0.5,
                    steps: int = 40, batch_size: int = 4, lr: float = 5e-5, seed: int = 0,
                    tools_prompt: str = "system", log=print) -> Path:
    """Write a warm-started copy of the model folder `model` to `out` (module docstring).
    The problems are task rows drawn with seed + 1000, apart from the task files' (seeds 0, 1)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):  # refused before torch and transformers load
        raise ValueError(f"--out {out}: exists and is not empty")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from curation.env.config import EnvConfig
    from curation.env.environments import opened_environment, template_tools
    from training.checkpoint import quiet_transformers
    from training.supervised import SeededBatches, supervised_ids, supervised_step

    started = time.perf_counter()
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(model)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    examples = []
    with opened_environment(EnvConfig(tools=["calculator"], tools_prompt=tools_prompt)) as environment:
        tools = template_tools(environment)
        for row in task_rows(task, prompts, seed + 1000):
            calls = calls_tool(row["messages"][-1]["content"], seed, tool_share)
            examples.append(supervised_ids(tokenizer, conversation(row, environment, calls), tools))
            examples.append(supervised_ids(tokenizer, conversation(row, None, False), None))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    batches = SeededBatches(len(examples), batch_size, seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy.train()
    for step in range(1, steps + 1):
        batch = [examples[i] for i in batches.next().tolist()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = supervised_step(policy, optimizer, None, input_ids, attention, labels)
        if step % 10 == 0 or step == steps:
            seconds = time.perf_counter() - started
            log(f"tool warm start: step {step}/{steps}  loss {loss:.3f}  ({seconds:.0f} s)")
    policy.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        with quiet_transformers():
            policy.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        (tmp / "tool_warm_start.json").write_text(json.dumps(
            {"from": str(model), "task": task, "prompts": prompts, "tool_share": tool_share, "steps": steps,
             "batch_size": batch_size, "lr": lr, "seed": seed, "tools_prompt": tools_prompt,
             "final_loss": round(loss, 4), "seconds": round(time.perf_counter() - started, 1)}, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
