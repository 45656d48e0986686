"""A supervised warm start's two moving parts, shared by the toys' builds and a chat model's tool
warm start: rows in a seeded order, and one teacher-forced optimizer step."""

from __future__ import annotations

import torch


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
