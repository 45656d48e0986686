"""N long-lived engines over Ray (`[generator] engines = N`, `ray_address`): one `Generator` to the stage.

    sample(prompts, seeds) ──shard by a hash of each prompt's token ids──> engine 0 .. N-1 (Ray actors,
        │                                                                 each one vllm or hf generator)
        │ shards run at once; an engine that dies (killed, out of memory, node lost) is replaced by
        │ a fresh actor that loads the current weights first, and only its shard runs again
        ▼
    groups back in prompt order -> the generate stage stages and commits them as for one engine

- Every group has its own seed (`prompt_seed`) and vLLM draws a group from its seed alone,
  so with backend "vllm" the samples do not depend on N (hf's depend on their batch: see
  `curation.generate.hf`). A prompt meets the same engine every round (its prefix cache).
- The actors live as long as this object: the round loop keeps it across rounds, so no
  engine starts twice. `update_weights` puts a state dict into Ray's object store once (a
  checkpoint folder is read here, by this process, first) and every engine loads it from
  there; each engine answers with the fingerprint of what it loaded, and a mismatch is an error.
- No engine reads a path of this machine: the model goes to the engines as the spec names it,
  and a model on an object store (`s3://...`) is fetched by each node into its own cache
  (`store.location.local_folder`), so the nodes need no shared disk.
- Ray: `ray_address` None starts a private local instance (`ray.init(address="local")`: a
  stray cluster is never joined), "auto" joins the cluster `ray start` runs on this machine
  (or RAY_ADDRESS), anything else is the address of a cluster. When this process has called
  `ray.init` already, that instance is used and left running by `close`.
- Ray is imported only here, and only when engines > 1 or ray_address is set.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from pathlib import Path
from typing import Sequence

from curation.generate.base import Completion, SamplingConfig, tokenize_prompt
from store.errors import JobError
from store.weights import load_state_dict
from training.ray_cluster import actor_env, check_room, connect_ray

MAX_RESTARTS = 2
"""Fresh actors one call may start for one engine before the call fails."""


def engine_of(prompt_token_ids: Sequence[int], engines: int) -> int:
    """The engine (0 .. engines-1) that samples a prompt: a hash of its token ids, so the
    same prompt goes to the same engine in every round and call."""
    digest = hashlib.blake2b(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids), digest_size=8).digest()
    return int.from_bytes(digest, "little") % engines


class EngineError(JobError):
    """An engine actor kept dying: the call gave up on its shard."""


class _Engine:
    """What runs inside one Ray actor: a generator of `backend`, kept for the actor's life."""

    def __init__(self, backend: str, model: str, kwargs: dict, threads: int | None) -> None:
        import torch

        from curation.generate.stage import make_generator

        if threads:
            torch.set_num_threads(threads)
        self.generator = make_generator(backend, model, **kwargs)

    def describe(self) -> dict:
        import ray

        g = self.generator
        return {"name": g.name, "fingerprint": g.fingerprint, "max_model_len": g.max_model_len,
                "weights_sha256": g.weights_sha256, "policy_version": g.policy_version, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def sample(self, prompt_token_ids, seeds, cfg) -> list[list[Completion]]:
        return self.generator.sample(prompt_token_ids, seeds, cfg)

    def greedy(self, prompt_token_ids, max_tokens) -> list[str]:
        return self.generator.greedy(prompt_token_ids, max_tokens)

    def update_weights(self, weights, policy_version: int) -> str:
        self.generator.update_weights(weights, policy_version)
        return self.generator.weights_sha256


class RayGenerator:
    """A `Generator` over `engines` Ray actors, each holding a generator of `backend` started
    with `engine_kwargs` (see the module docstring)."""

    def __init__(
        self,
        backend: str,
        model: str | Path,
        engines: int,
        *,
        ray_address: str | None = None,
        engine_cpus: float = 1.0,
        engine_gpus: float = 0.0,
        policy_version: int = 0,
        trust_remote_code: bool = False,
        **engine_kwargs,
    ) -> None:
        from transformers import AutoTokenizer

        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        from store.location import local_folder

        self._owns_ray = connect_ray(ray_address)
        self.model = str(model)
        """The model as the engines get it: a path on every node, or an object-store URL."""
        self.backend = backend
        self.engines = engines
        self.tokenizer = AutoTokenizer.from_pretrained(local_folder(model), trust_remote_code=trust_remote_code)
        self._kwargs = {**engine_kwargs, "policy_version": policy_version, "trust_remote_code": trust_remote_code}
        self._options = {"num_cpus": engine_cpus, "num_gpus": engine_gpus, "scheduling_strategy": "SPREAD",
                         "max_restarts": 0, "runtime_env": {"env_vars": actor_env()}}
        self._threads = max(1, int(engine_cpus)) if engine_gpus == 0 else None
        self._weights = None  # what every engine holds beyond the base model: an ObjectRef
        # One call at a time (the loop samples the next round in a thread while it trains): an
        # actor runs its calls in order anyway, and a replaced engine gets the weights its
        # shard was meant for.
        self._busy = threading.RLock()
        self.restarts = 0
        """Fresh actors started in place of dead ones (all calls together)."""
        check_room([("engines", engines, engine_cpus, engine_gpus)], "generator.engine_cpus / engine_gpus")
        self._actors = [self._start() for _ in range(engines)]
        self.info = self._describe_all()
        first = self.info[0]
        self.name = first["name"]
        self.max_model_len = first["max_model_len"]
        self.policy_version = policy_version
        self.weights_sha256 = first["weights_sha256"]
        self._fingerprint = first["fingerprint"]

    # -- the Generator protocol -------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def tokenize(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, messages)

    def sample(self, prompt_token_ids: Sequence[list[int]], seeds: Sequence[int],
               cfg: SamplingConfig) -> list[list[Completion]]:
        shards = self._shards(prompt_token_ids)
        args = {e: ([list(prompt_token_ids[i]) for i in rows], [int(seeds[i]) for i in rows], cfg)
                for e, rows in shards.items()}
        with self._busy:
            results = self._call("sample", args)
        return _in_order(len(prompt_token_ids), shards, results)

    def greedy(self, prompt_token_ids: Sequence[list[int]], max_tokens: int) -> list[str]:
        shards = self._shards(prompt_token_ids)
        with self._busy:
            results = self._call("greedy", {e: ([list(prompt_token_ids[i]) for i in rows], max_tokens)
                                            for e, rows in shards.items()})
        return _in_order(len(prompt_token_ids), shards, results)

    def update_weights(self, weights: "dict | str | Path", policy_version: int) -> None:
        import ray

        if isinstance(weights, (str, Path)):  # a folder of this machine: the engines may be elsewhere
            weights = load_state_dict(weights)
        held = ray.put({name: tensor.detach().to("cpu") for name, tensor in weights.items()})
        with self._busy:
            shas = self._call("update_weights", {e: (held, policy_version) for e in range(self.engines)})
            if len(set(shas.values())) != 1:
                raise EngineError(f"engines loaded different weights for policy_version {policy_version}: "
                                  + ", ".join(f"engine {e} {sha[:12]}" for e, sha in sorted(shas.items())))
            self._weights = held
            self.policy_version = policy_version
            self.weights_sha256 = shas[0]
            self._fingerprint = self._fingerprint.rsplit("@", 1)[0] + "@" + self.weights_sha256[:16]

    def close(self) -> None:
        import ray

        actors, self._actors = getattr(self, "_actors", []), []
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if getattr(self, "_owns_ray", False) and ray.is_initialized():
            ray.shutdown()

    # -- engines ------------------------------------------------------------------------------

    def actor(self, engine: int):
        """The live Ray actor of `engine` (tests kill it)."""
        return self._actors[engine]

    def _start(self):
        actor = _remote_engine().options(**self._options)
        return actor.remote(self.backend, self.model, self._kwargs, self._threads)

    def _describe_all(self) -> list[dict]:
        import ray

        return ray.get([actor.describe.remote() for actor in self._actors])

    def _restart(self, engine: int) -> None:
        """A fresh actor in place of a dead one, holding the weights every engine holds."""
        import ray

        try:
            ray.kill(self._actors[engine], no_restart=True)
        except Exception:  # noqa: BLE001 - it is gone already
            pass
        self._actors[engine] = self._start()
        self.restarts += 1
        if self._weights is not None:
            ray.get(self._actors[engine].update_weights.remote(self._weights, self.policy_version))

    def _shards(self, prompt_token_ids: Sequence[list[int]]) -> dict[int, list[int]]:
        shards: dict[int, list[int]] = {}
        for i, ids in enumerate(prompt_token_ids):
            shards.setdefault(engine_of(ids, self.engines), []).append(i)
        return shards

    def _call(self, method: str, args: dict[int, tuple]) -> dict:
        """`method(*args[e])` on every engine e at once; a shard whose engine died runs again,
        alone, on a fresh engine (at most MAX_RESTARTS times per engine)."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        pending = {getattr(self._actors[e], method).remote(*a): e for e, a in args.items()}
        failures = dict.fromkeys(args, 0)
        results = {}
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            engine = pending.pop(ref)
            try:
                results[engine] = ray.get(ref)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                failures[engine] += 1
                if failures[engine] > MAX_RESTARTS:
                    raise EngineError(f"engine {engine} of {self.engines} died {failures[engine]} times during "
                                      f"{method} ({type(exc).__name__}); giving up on its shard") from exc
                time.sleep(0.1 * failures[engine])
                self._restart(engine)
                pending[getattr(self._actors[engine], method).remote(*args[engine])] = engine
        return results


_REMOTE = None


def _remote_engine():
    """`_Engine` as a Ray actor class (made once per process)."""
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(_Engine)
    return _REMOTE


def _in_order(n: int, shards: dict[int, list[int]], results: dict[int, list]) -> list:
    out: list = [None] * n
    for engine, rows in shards.items():
        for i, value in zip(rows, results[engine]):
            out[i] = value
    return out
