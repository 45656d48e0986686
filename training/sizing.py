"""Micro-batch size and activation checkpointing from the model's shape and a memory budget.

Torch-free (`groupforge init` and the spec loader use it). The whole process must fit a
budget: by default MEMORY_SHARE of the machine's RAM (the cgroup's limit where lower), or
of a GPU's memory less the share the engine takes (`gpu_memory_utilization`). What it holds:

    fixed   = weights + gradients + AdamW's two moments      4 P bytes each (fp32 master;
                                                              LoRA: the weights only)
            + the reference model, when the loss uses one     4 P (not with LoRA: adapters off)
            + the in-process engine: its weights and KV cache (`engine_bytes`)
            + RUNTIME_BYTES (torch, vLLM and Python themselves)
            + the LM head's logits chunk: chunk x vocab x 4 (x2 under autocast)
    per token, each of the L decoder layers keeps for backward
              a = ACT_HIDDEN x hidden + ACT_MLP x intermediate values (fp32; 2-byte under autocast)
              with checkpointing: CKPT_HIDDEN x hidden values per layer, plus one layer's `a` recomputed
    token_budget = (budget - fixed) / per_token, rounded down to a multiple of 256, at most 16,384

ACT_HIDDEN = 16 and ACT_MLP = 4 were measured on SmolLM2-135M (30 layers, hidden 576, MLP
1,536; 1.75-1.78 MB a token in fp32, the formula says 1.84), CKPT_HIDDEN = 10 the same way with
transformers' non-reentrant checkpointing (0.67-0.69 MB a token; the formula says 0.75: more
than the layer inputs alone, which would be 0.07); tests/training/test_sizing.py measures both
on this machine, on SmolLM2 and on the toy. Checkpointing is chosen only when the
budget cannot hold the longest training sequence without it, or less than MIN_TOKENS: on this
2-core CPU it cost 28% of the step's speed at equal tokens (BENCHMARKS "real model").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

GIB = 1024 ** 3
MEMORY_SHARE = 0.3
"""Default budget: this share of the machine's RAM (24 GiB -> 7.1 GiB), so that the process peaks under 10 GiB:
SmolLM2's round loop (vLLM in the process) peaked at 10.3 GiB RSS with 40% and 10.5 GiB with 35%, 1.2-2.3 GiB
above the plan, after the train steps (the engine's reload and eval while the allocator still holds the
trainer's freed pages): the formula does not model that yet, so the share leaves room for it."""
GPU_HEADROOM = 0.9
"""On a GPU the trainer may use GPU_HEADROOM - gpu_memory_utilization of its memory."""
RUNTIME_BYTES = int(1.5 * GIB)
"""torch, transformers, vLLM and Python's own resident memory, measured ~1.2-1.5 GiB."""
ACT_HIDDEN, ACT_MLP = 16, 4
"""Values a decoder layer keeps for backward, per token: 16 x hidden + 4 x MLP width."""
CKPT_HIDDEN = 10
"""With activation checkpointing, values a token costs per layer, in units of hidden (measured)."""
MIN_TOKENS = 1024
"""Below this many tokens a micro-batch, checkpointing's larger batches pay for its recompute."""
ROUND_TO = 256
MAX_TOKENS = 16384
"""The cap: past a few thousand tokens a micro-batch was no faster here (2,048 and 4,096 tokens of
SmolLM2 ran at the same tokens/s), so a larger one only holds memory."""
LOGITS_CHUNK = 2048
"""training.logprobs.token_logprobs' default chunk_tokens: one chunk's logits are kept."""


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, from a model's config.json."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    parameters: int

    @classmethod
    def from_config(cls, config: dict, parameters: int) -> "ModelShape":
        """From a config.json dict (Llama/Qwen/Mistral names; GPT-2's n_layer/n_embd too)."""
        text = config.get("text_config") or config
        layers = text.get("num_hidden_layers", text.get("n_layer"))
        hidden = text.get("hidden_size", text.get("n_embd"))
        if not layers or not hidden:
            raise ValueError("config.json has neither num_hidden_layers/hidden_size nor n_layer/n_embd: "
                             "set [train] token_budget by hand")
        intermediate = text.get("intermediate_size") or text.get("n_inner") or 4 * hidden
        return cls(int(layers), int(hidden), int(intermediate), int(text.get("vocab_size", 0)), int(parameters))

    @classmethod
    def of_folder(cls, folder: Path) -> "ModelShape":
        """From a model folder's config.json and its safetensors headers (no tensor is read)."""
        from store.weights import count_parameters

        return cls.from_config(json.loads((folder / "config.json").read_text()), count_parameters(folder))


def machine_memory() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def engine_bytes(parameters: int, dtype_bytes: int, kv_cache_bytes: int) -> int:
    """An in-process engine's memory: its copy of the weights and its KV cache."""
    return parameters * dtype_bytes + kv_cache_bytes


@dataclass(frozen=True)
class MicroBatchPlan:
    """The trainer's micro-batch size and checkpointing, and how they were derived."""

    token_budget: int
    checkpointing: bool
    budget_bytes: int
    fixed_bytes: int
    token_bytes: int
    """Activation bytes a token costs, as planned (with checkpointing if on)."""
    reason: str

    def describe(self) -> str:
        return (f"micro-batches of {self.token_budget:,} tokens"
                + (" with activation checkpointing" if self.checkpointing else "") + f": {self.reason}")


def plan_micro_batches(shape: ModelShape, *, longest_sequence: int, reference: bool, autocast: bool,
                       lora: bool = False, engine: int = 0, budget: int | None = None, budget_source: str = "",
                       checkpointing: Literal["auto", "on", "off"] = "auto") -> MicroBatchPlan:
    """The token budget and checkpointing for `shape` within `budget` bytes (see the module
    docstring). `engine`: bytes an engine in the same process holds (0 when it runs elsewhere);
    `longest_sequence`: the longest prompt + response the trainer will see."""
    if budget is None:
        budget, budget_source = int(MEMORY_SHARE * machine_memory()), f"{MEMORY_SHARE:.0%} of RAM"
    p, act_bytes = shape.parameters, 2 if autocast else 4
    head = LOGITS_CHUNK * shape.vocab * 4 * (2 if autocast else 1)
    copies = 1 if lora else (4 if reference else 3)
    fixed = 4 * p * copies + engine + RUNTIME_BYTES + head
    layer = (ACT_HIDDEN * shape.hidden + ACT_MLP * shape.intermediate) * act_bytes
    plain = shape.layers * layer
    checkpointed = shape.layers * CKPT_HIDDEN * shape.hidden * act_bytes + layer
    free = budget - fixed
    if free <= 0:
        raise ValueError(f"the memory budget ({budget / GIB:.1f} GiB, {budget_source}) is smaller than the model's "
                         f"weights, gradients, optimizer state and engine ({fixed / GIB:.1f} GiB): raise "
                         "[train] memory_budget, or use a smaller model or LoRA")
    use = {"on": True, "off": False}.get(checkpointing)
    if use is None:
        use = free // plain < max(MIN_TOKENS, longest_sequence)
    per_token = checkpointed if use else plain
    tokens = min(MAX_TOKENS, int(free // per_token) // ROUND_TO * ROUND_TO)
    if tokens < max(longest_sequence, 1):
        raise ValueError(f"the memory budget ({budget / GIB:.1f} GiB, {budget_source}) leaves room for {tokens} tokens "
                         f"a micro-batch{' even with checkpointing' if use else ''}, fewer than the longest sequence "
                         f"({longest_sequence} tokens): raise [train] memory_budget or lower max_tokens")
    layer_text = f"({ACT_HIDDEN} x {shape.hidden} + {ACT_MLP} x {shape.intermediate})"
    values = f"{shape.layers} x {CKPT_HIDDEN} x {shape.hidden} + {layer_text}" if use \
        else f"{shape.layers} layers x {layer_text}"
    reason = (f"{values} values = {per_token / 1e6:.2f} MB a token; {free / GIB:.1f} GiB left for them of a "
              f"{budget / GIB:.1f} GiB budget ({budget_source}) after {fixed / GIB:.1f} GiB of weights, gradients, "
              "AdamW"
              + (", reference" if reference else "") + (", engine" if engine else "") + " and runtime")
    return MicroBatchPlan(tokens, use, budget, fixed, per_token, reason)
