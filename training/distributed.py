"""The trainer under torch.distributed (`[train] strategy = "ddp"`): ranks, row shards, and
the sums that make N ranks take the single-process step.

    groupforge train RUN --strategy ddp ...                        # one process: a world of 1
    torchrun --nproc-per-node 2 -m pipelines.cli.main train RUN --strategy ddp ...

Each optimizer step draws the same global rows on every rank (training.schedule.step_rows)
and rank r takes rows r, r + N, r + 2N, ... of them. The step's normaliser (sequences, tokens,
pair weights) is summed over the ranks before any loss is computed, so each rank's loss is
its share of the global step loss; after backward the gradients are summed over the ranks
(one flat all-reduce), so every rank holds the single-process gradient, clips it the same
way and takes the same AdamW step: the weights stay equal without a broadcast. Metrics are
summed the same way (the averages are weighted by the global counts). Rank 0 alone writes:
metrics.jsonl, checkpoints (plain HF folders, so a run resumes under any world size) and
the recomputed old log-probs' cache.

The process group is the caller's (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...);
`ensure_process_group` starts it from those variables when nobody has (gloo on CPU, nccl on
CUDA). Without them, "ddp" is a world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from training.objectives import Normalizer

if TYPE_CHECKING:
    from training.config import TrainConfig

__all__ = ["Placement", "Ranks", "StepSync", "close_process_group", "ensure_process_group", "ranks"]


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes run files."""
        return self.rank == 0

    def shard(self, rows):
        """This rank's rows of a step: every world-th one, starting at its rank."""
        return rows[self.rank :: self.world]


def ensure_process_group(device: torch.device) -> None:
    """Start the default process group from torchrun's environment, when it is set and no
    group is running (backend: nccl on CUDA, gloo otherwise)."""
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def close_process_group() -> None:
    """End the default process group, when one runs (every rank first waits for the others)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def ranks() -> Ranks:
    """This process's rank and the world size (0 and 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


class StepSync:
    """What accumulate_gradients sums over the ranks of a step; the identity in a world of one."""

    def __init__(self, device: torch.device, world: int = 1, gradients: bool = True):
        self.device, self.world, self.sum_gradients = device, world, gradients

    def normalizer(self, local: Normalizer) -> Normalizer:
        """The step's global counts from each rank's own."""
        if self.world == 1:
            return local
        values = [local.num_seqs, local.num_tokens, local.weight_sum or 0.0, local.weight_sum is not None]
        total = self._sum([float(v) for v in values])
        return Normalizer(num_seqs=total[0], num_tokens=total[1], weight_sum=total[2] if total[3] else None)

    def gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks, in place (a missing one counts as 0);
        not with FSDP2, which reduces them itself."""
        if self.world == 1 or not self.sum_gradients:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def sums(self, values: dict[str, float]) -> dict[str, float]:
        """Each key's value summed over the ranks (a key a rank lacks counts as 0 there)."""
        if self.world == 1:
            return values
        keys: list[list[str]] = [[] for _ in range(self.world)]
        dist.all_gather_object(keys, sorted(values))
        names = sorted(set().union(*keys))
        return dict(zip(names, self._sum([values.get(name, 0.0) for name in names])))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()


@dataclass(frozen=True)
class Placement:
    """Where a trainer call runs: the device, the ranks, whether FSDP2 shards the policy, and
    the step's cross-rank sums. `of` starts the process group when the strategy needs one."""

    device: torch.device
    world: Ranks
    sharded: bool
    sync: StepSync

    @classmethod
    def of(cls, cfg: TrainConfig) -> Placement:
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.strategy != "single":
            ensure_process_group(device)
            if device.type == "cuda" and cfg.device is None:
                device = torch.device("cuda", torch.cuda.current_device())
        world = ranks() if cfg.strategy != "single" else Ranks()
        sharded = cfg.strategy == "fsdp2" and world.world > 1
        # FSDP sums the gradients itself
        return cls(device, world, sharded, StepSync(device, world.world, gradients=not sharded))
