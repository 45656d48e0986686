"""Trainer ranks kept for a whole round loop: `[train] strategy = "ddp" | "fsdp2"` with `nproc` > 1.

    TrainerRanks(nproc) ── nproc Ray actors, started once; rank 0 names the rendezvous
        │                  (its node's address, a free port); each rank's process group
        │                  (gloo on CPU, nccl on CUDA) starts on its first train call and stays
        ▼
    train(run_dir, cfg, steps) on every rank at once, each with its own TrainSession: the
    weights and AdamW state stay in the ranks between rounds (no process start per round)

Every rank runs `training.trainer.train` as under torchrun (training/distributed.py: row
shards, global normaliser, gradient sums; rank 0 writes metrics, checkpoints and returns the
new weights for the engines). A rank that dies (killed, out of memory, node lost) stops the
group: the others are killed too (they would wait in a collective) and the call raises
`RankDied`; a rerun resumes from the newest checkpoint, replaying the rounds after it.

Ray is imported only here and in training/ray_cluster.py (the connection and the room check,
shared with the engines). The ranks need no shared disk when the run and the model are on an
object store: every rank opens the run by its URL, reads the tables from it and keeps the
checkpoint it resumes from and the model in its node's cache (store/location.py);
rank 0 alone writes checkpoints, to the store. A run in a local folder must be a path every
rank can reach (on several machines: a shared file system).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from store.errors import JobError
from training.ray_cluster import KILL_RANK_ENV, check_room, connect_ray

if TYPE_CHECKING:
    from training.trainer import LoopOptions

ERROR_WAIT_S = 60.0
"""After one rank's train call failed: how long the others may take to fail as well."""


class RankDied(JobError):
    """A trainer rank's process died during a train call."""


class _Rank:
    """What runs inside one Ray actor: a rank's environment and its live TrainSession."""

    def __init__(self, threads: int | None) -> None:
        import torch

        from training.trainer import TrainSession

        if threads:
            torch.set_num_threads(threads)
        self.session = TrainSession()

    def endpoint(self) -> tuple[str, int]:
        """This node's address and a free port for the group's rendezvous (rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def join(self, rank: int, world: int, address: str, port: int, one_gpu: bool) -> int:
        from store.faults import FAULT_ENV

        # A rank sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES): it is cuda:0 there.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0" if one_gpu else str(rank),
                          MASTER_ADDR=address, MASTER_PORT=str(port))
        if os.environ.get(KILL_RANK_ENV, str(rank)) != str(rank):
            os.environ.pop(FAULT_ENV, None)
        return os.getpid()

    def train(self, run_dir: str, cfg, steps: int, model: str | None, options):
        from training.trainer import train

        return train(run_dir, cfg, steps=steps, model=model, session=self.session, options=options)


class TrainerRanks:
    """`nproc` trainer ranks as Ray actors (`rank_cpus`, `rank_gpus` each); `train` takes the
    arguments of `training.trainer.train` and returns rank 0's TrainResult."""

    def __init__(self, nproc: int, *, rank_cpus: float = 1.0, rank_gpus: float = 0.0,
                 ray_address: str | None = None) -> None:
        import ray

        self._owns_ray = connect_ray(ray_address)
        check_room([("trainer ranks", nproc, rank_cpus, rank_gpus)], "train.rank_cpus / rank_gpus")
        remote = ray.remote(_Rank).options(num_cpus=rank_cpus, num_gpus=rank_gpus, max_restarts=0,
                                           scheduling_strategy="SPREAD")
        threads = max(1, int(rank_cpus)) if rank_gpus == 0 else None
        self.nproc = nproc
        self._actors = [remote.remote(threads) for _ in range(nproc)]
        address, port = ray.get(self._actors[0].endpoint.remote())
        self.pids = ray.get([a.join.remote(rank, nproc, address, port, rank_gpus > 0)
                             for rank, a in enumerate(self._actors)])
        self.step = 0
        """The optimizer step the ranks' live sessions hold (0 before the first call)."""
        self.live = False

    def train(self, run_dir: str | Path, cfg, *, steps: int, model: str | Path | None,
              options: LoopOptions | None = None):
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        from training.trainer import LoopOptions

        if not self._actors:
            raise RankDied("the trainer ranks were stopped after a rank died; rerun to resume")
        options = options or LoopOptions()
        ranks_options = [dataclasses.replace(options, return_state=options.return_state and rank == 0)
                         for rank in range(self.nproc)]  # the weights come back from rank 0 only
        refs = [a.train.remote(str(run_dir), cfg, steps, None if model is None else str(model), ranks_options[rank])
                for rank, a in enumerate(self._actors)]
        self.live = False
        pending = dict(zip(refs, range(self.nproc)))
        results, errors = {}, {}
        while pending:
            # once a rank has failed, the others get a while to fail too (the same bad data
            # fails every rank before any collective); one still busy then waits in a collective
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=ERROR_WAIT_S if errors else None)
            if not ready:
                self.close(keep_ray=True)
                rank = min(errors)
                raise RankDied(f"trainer rank {rank} of {self.nproc} failed toward step {steps} while others "
                               "went on; the ranks were stopped. Rerun to resume.") from errors[rank]
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                self.close(keep_ray=True)
                raise RankDied(f"trainer rank {rank} of {self.nproc} died training toward step {steps} "
                               f"({type(exc).__name__}); the other ranks were stopped. Rerun to resume from "
                               "the newest checkpoint.") from exc
            except Exception as exc:  # noqa: BLE001 - the rank's own error (Ray re-raises it as its class)
                errors[rank] = exc
        if errors:
            raise errors[min(errors)]
        self.step, self.live = results[0].end_step, True
        return results[0]

    def close(self, keep_ray: bool = False) -> None:
        import ray

        actors, self._actors = self._actors, []
        self.live = False
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._owns_ray and not keep_ray and ray.is_initialized():
            ray.shutdown()
