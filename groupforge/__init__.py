"""groupforge: offline, table-first GRPO/GSPO post-training.

The front door: the dozen names a user needs, each re-exported from the module that owns it
(`store/`, `curation/`, `training/`, `pipelines/`; see docs/ARCHITECTURE.md). Deep imports keep working.

    import groupforge as gf

    spec = gf.load_spec("pipelines/specs/toy-grpo.toml")
    records = gf.run_pipeline(spec)                       # the round loop

    engine = gf.make_generator("vllm", "runs/toy/model")  # or step by step
    gf.generate("runs/r", "runs/toy/train.parquet", gf.SamplingConfig(group_size=8), generator=engine)
    gf.curate("runs/r")                                   # score -> filter -> label -> pair
    gf.train("runs/r", gf.TrainConfig(objective="gspo"), steps=10, model="runs/toy/model")
    gf.RunStore("runs/r").read("groups")                  # any table, validated

Names are imported on first use, so `import groupforge` loads neither torch nor vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = importlib.metadata.version("groupforge")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

# public name -> the module that owns it
_EXPORTS = {
    "RunStore": "store.run_store",
    "SamplingConfig": "curation.generate.base",
    "generate": "curation.generate.stage",
    "make_generator": "curation.generate.stage",
    "register_reward": "curation.rewards.registry",
    "curate": "pipelines.loop.curate",
    "TrainConfig": "training.config",
    "train": "training.trainer",
    "get_policy_loss": "training.objectives",
    "get_pair_loss": "training.objectives",
    "load_spec": "pipelines.spec",
    "run_pipeline": "pipelines.loop.run",
}

__all__ = [  # the same names as _EXPORTS (a test checks), written out for readers and linters
    "__version__", "RunStore", "SamplingConfig", "generate", "make_generator", "register_reward", "curate",
    "TrainConfig", "train", "get_policy_loss", "get_pair_loss", "load_spec", "run_pipeline",
]

if TYPE_CHECKING:
    from curation.generate.base import SamplingConfig
    from curation.generate.stage import generate, make_generator
    from curation.rewards.registry import register_reward
    from pipelines.loop.curate import curate
    from pipelines.loop.run import run_pipeline
    from pipelines.spec import load_spec
    from store.run_store import RunStore
    from training.config import TrainConfig
    from training.objectives import get_pair_loss, get_policy_loss
    from training.trainer import train


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'groupforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
