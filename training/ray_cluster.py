"""The Ray connection that engines (curation/generate/ray_engines.py) and trainer ranks
(training/ray_ranks.py) share: join or start Ray once, the actors' environment, and the check
that the cluster has room for what a run asks.

Ray is imported inside the functions only: importing this module costs nothing.
"""

from __future__ import annotations

import os
import time


def connect_ray(address: str | None) -> bool:
    """Join Ray unless this process has already: `address` None starts a private local
    instance ("local": a stray cluster is never joined), else `ray.init(address)`. Returns
    whether this call started the connection (its caller then ends it with `ray.shutdown`)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address="local" if address is None else address, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": actor_env()})
    return True


ROOM_WAIT_SECONDS = 10.0
"""How long a shortfall of free CPUs or GPUs is looked at again before it is an error: Ray's
count of free resources lags the end of an actor (`ray.kill` returns before the actor's CPUs
are free, ~0.1 s here; ray#34917), and a job that has just closed its engines asks for their
CPUs at once."""


def check_room(asks: list[tuple[str, int, float, float]], settings: str, wait: float = ROOM_WAIT_SECONDS) -> None:
    """Fail in one line, before any actor starts, when the Ray cluster has not got the free
    CPUs and GPUs that `asks` [(what, count, cpus each, gpus each)] add up to: Ray would
    otherwise wait for them for ever. A shortfall is looked at again for `wait` seconds first
    (ROOM_WAIT_SECONDS). `settings` names the keys to change."""
    import ray

    deadline = time.monotonic() + wait
    while (short := _shortfall(asks, ray.available_resources(), settings)) is not None:
        if time.monotonic() >= deadline:
            raise ValueError(short)
        time.sleep(0.1)


def _shortfall(asks: list[tuple[str, int, float, float]], free: dict, settings: str) -> str | None:
    """What `asks` lack of the `free` resources, as check_room's message; None when they fit."""
    for kind, index in (("CPU", 2), ("GPU", 3)):
        need = sum(ask[1] * ask[index] for ask in asks)
        if need > free.get(kind, 0) + 1e-9:
            parts = " + ".join(f"{ask[1]} {ask[0]} x {ask[index]:g}" for ask in asks if ask[index])
            return (f"{parts} {kind}s = {need:g} {kind}s, but the Ray cluster has {free.get(kind, 0):g} free; "
                    f"lower {settings} (fractions are fine) or add nodes")
    return None


KILL_RANK_ENV = "GROUPFORGE_KILL_RANK"
"""Fault injection for tests: with store.faults.FAULT_ENV, only this trainer rank runs its kill points."""


def actor_env() -> dict[str, str]:
    """Environment of the actors: vLLM in-process with a small CPU KV cache (as for one engine
    in this process), quiet logs; whatever the user set wins. The fault-injection variables,
    when this process has them, go along, so a kill point fires in an actor on any node."""
    from store.faults import FAULT_ENV

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    faults = {k: os.environ[k] for k in (FAULT_ENV, KILL_RANK_ENV) if k in os.environ}
    return {**{k: os.environ.get(k, v) for k, v in env.items()}, **faults}
