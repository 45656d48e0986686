"""A supervised warm start's moving parts, shared by the toys' builds and a chat model's tool
warm start: a conversation's token ids and labels as its chat template renders it, rows in a
seeded order, and one teacher-forced optimizer step."""

from __future__ import annotations

from typing import Any

import torch


def supervised_ids(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and labels that are -100 but on the assistant turns: each
    turn is the template's text after the conversation before it (with the generation prompt)."""
    kwargs = {"tools": tools} if tools else {}
    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True, **kwargs)
            piece = tokenizer.encode(head[len(done):], add_special_tokens=False)
            ids += piece
            labels += [-100] * len(piece)
            done = head
        text = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False, **kwargs)
        piece = tokenizer.encode(text[len(done):], add_special_tokens=False)
        ids += piece
        labels += piece if message["role"] == "assistant" else [-100] * len(piece)
        done = text
    return ids, labels


class SeededBatches:
    """Row indices of `n` examples, `batch_size` at a time, in a seeded random order that is
    drawn again whenever fewer than `batch_size` rows are left of it."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.order = torch.Generator().manual_seed(seed)
        self.permutation, self.cursor = torch.randperm(n, generator=self.order), 0

    def next(self) -> torch.Tensor:
        if self.cursor + self.batch_size > self.n:
            self.permutation, self.cursor = torch.randperm(self.n, generator=self.order), 0
        rows = self.permutation[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return rows


def supervised_step(model, optimizer, schedule, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    labels: torch.Tensor) -> float:
    """One teacher-forced step (labels -100 where nothing is learned); the batch's loss.
    `schedule`: a learning-rate scheduler stepped after the optimizer, or None."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    optimizer.step()
    if schedule is not None:
        schedule.step()
    return out.loss.item()
