"""One TRL `GRPOTrainer` run on a toy for bench/loop.py (needs `make bench-trl`: trl==1.16.0).

The setup a new user would write for this model on CPU, made fair (GRPOConfig field names
checked in trl 1.16.0's grpo_config.py):

- `bf16=False` (TRL defaults to True), `gradient_checkpointing=False` (TRL defaults to True),
  `use_cpu=True`; `use_vllm=False`: TRL samples with the policy's own transformers `generate`
  (its vLLM modes need a server or a colocated CUDA engine);
- `lr_scheduler_type="constant"`: TRL's linear decay runs to 0 over `max_steps`, and a run cut
  by a wall-clock budget would decay towards a step it never reaches;
- `beta=0` (no reference model, like groupforge), `num_iterations=1`, G = `num_generations`,
  `max_completion_length`, `temperature` as groupforge samples; TRL's other defaults stay
  (loss_type "dapo", epsilon 0.2, scale_rewards "group", max_grad_norm 1.0, AdamW);
- a round's shape: `per_device_train_batch_size` completions per optimizer step and
  `steps_per_generation` steps per generation batch of prompts x G completions;
- a round's micro-batches: `job["micro_batch"]` completions per forward/backward (default: the
  whole step) with `gradient_accumulation_steps` making up the step, as groupforge's token
  budget splits a step for a real model's activation memory;
- the reward is groupforge's own (`job["metric"]`, default `exact_match`, TRL's reward
  signature); a toy's prompts are plain text tokenized with BOS, as groupforge does; a chat
  task's `messages` are TRL's conversational prompts (its chat template renders them, and the
  reward reads the assistant message's text).

Clock: `on_train_begin` starts it (model load, dataset and trainer construction are start-up),
in wall and in process CPU seconds; a greedy eval of the eval prompts (`EvalCallback`,
transformers `generate`, every `eval_every` optimizer steps and at the end) is timed and
subtracted, as groupforge's eval is. The run stops at the first step past `minutes` of
training seconds.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from _curves import Curve  # bench/ is on sys.path when a bench runs as a script

from curation.generate.base import tokenize_prompt
from curation.rewards.registry import get_reward


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts: list, references: list[str], max_tokens: int,
                    metric: str = "exact_match") -> float:
    """Mean `metric` of the greedy responses (one left-padded batch, cut at EOS); a prompt is a
    text or a conversation (a list of messages, rendered with the chat template)."""
    ids = [tokenize_prompt(tokenizer, None, p) if isinstance(p, list) else tokenize_prompt(tokenizer, p, None)
           for p in prompts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         do_sample=False, max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=pad, top_k=None, top_p=None, temperature=None)
    model.train(was_training)
    texts = []
    for row in out[:, width:].tolist():
        cut = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    values = get_reward(metric)([None] * len(texts), texts, reference=references)
    return sum(values) / len(values)


def text_reward(metric: str):
    """groupforge's reward `metric` in TRL's reward signature; a conversational completion (a list
    holding the assistant message) is scored on its text."""
    reward = get_reward(metric)

    def score(prompts, completions, reference, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward([None] * len(texts), texts, reference=reference)

    score.__name__ = metric
    return score


def run_trl(job: dict) -> dict:
    """Train with TRL on job["toy"] for job["minutes"] training minutes; the run's Curve as a dict."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    toy = Path(job["toy"])
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    model = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32)
    column = job.get("column", "prompt")
    metric = job.get("metric", "exact_match")
    train = pq.read_table(toy / "train.parquet").select([column, "reference"]).to_pydict()
    train = {"prompt": train[column], "reference": train["reference"]}  # TRL's column name
    evals = pq.read_table(toy / "eval.parquet").to_pydict()
    micro = job.get("micro_batch") or job["batch_size"]
    steps_per_generation = job["prompts_per_generation"] * job["group_size"] // micro
    args = GRPOConfig(
        output_dir=str(job["out_dir"]), seed=job["seed"], learning_rate=job["lr"], lr_scheduler_type="constant",
        bf16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False, beta=0.0, num_iterations=1,
        num_generations=job["group_size"], max_completion_length=job["max_tokens"], temperature=job["temperature"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=job["batch_size"] // micro,
        steps_per_generation=steps_per_generation, max_steps=1_000_000, logging_steps=50, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    reward = text_reward(metric)
    optimizer_steps_per_generation = steps_per_generation * micro // job["batch_size"]
    curve = Curve("trl", job["variant"], job["seed"], extra={"lr": job["lr"], "steps_per_generation":
                                                             optimizer_steps_per_generation})
    budget = job["minutes"] * 60.0
    samples_per_generation = job["prompts_per_generation"] * job["group_size"]

    class EvalCallback(TrainerCallback):
        """Greedy eval every `eval_every` steps; its seconds are taken off the training clock."""

        def __init__(self) -> None:
            self.begin = self.cpu_begin = 0.0
            self.eval_seconds = self.eval_cpu = 0.0

        def train_seconds(self) -> float:
            return time.perf_counter() - self.begin - self.eval_seconds

        def evaluate(self, model, step: int) -> None:
            seconds, cpu = self.train_seconds(), time.process_time() - self.cpu_begin - self.eval_cpu
            tic, cpu_tic = time.perf_counter(), time.process_time()
            accuracy = greedy_accuracy(model, tokenizer, evals[column], evals["reference"], job["max_tokens"], metric)
            self.eval_seconds += time.perf_counter() - tic
            self.eval_cpu += time.process_time() - cpu_tic
            samples = math.ceil(step / optimizer_steps_per_generation) * samples_per_generation
            curve.add(seconds, samples, accuracy, cpu, os.getloadavg()[0])
            print(f"trl {job['variant']} seed {job['seed']} lr {job['lr']:g}: step {step} {seconds:.0f}s "
                  f"{samples} samples accuracy {accuracy:.3f}", flush=True)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            curve.extra["startup_seconds"] = round(time.perf_counter() - started, 2)
            self.begin, self.cpu_begin = time.perf_counter(), time.process_time()
            self.evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            over = self.train_seconds() >= budget
            if state.global_step % job["eval_every"] == 0 or over:
                self.evaluate(model, state.global_step)
            if over:
                control.should_training_stop = True
                curve.extra.update(steps=state.global_step, eval_seconds=round(self.eval_seconds, 2))

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict(train),
                          processing_class=tokenizer, callbacks=[EvalCallback()])
    trainer.train()
    curve.extra["wall_seconds"] = round(time.perf_counter() - started, 2)
    return curve.to_dict()
