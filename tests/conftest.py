"""Shared fixtures. The toy is built once into runs/toy (cached there across test runs).

`make test` runs the tests on two pytest-xdist workers, one test file at a time each (the Ray
files together on one worker: each starts a local cluster), the longest files first; every
worker and what it starts runs one torch thread, so two workers fill two cores."""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

# In-process vLLM engine (fast start) with a small KV cache; no hub access.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch starts: two workers, two cores

REPO = Path(__file__).resolve().parents[1]

# Files that take minutes: scheduled first, so that the other worker is not left waiting at
# the end for one of them. The rest follow in collection order.
LONG_FILES = (
    "tests/faults/test_faults.py",
    "tests/pipelines/test_run_ray.py",
    "tests/pipelines/test_run.py",
    "tests/curation/test_generate_ray.py",
    "tests/training/test_ddp.py",
    "tests/pipelines/test_toy_variants.py",
    "tests/training/test_trainer.py",
    "tests/pipelines/test_trackers.py",
    "tests/pipelines/test_cli.py",
    "tests/pipelines/test_init.py",
    "tests/pipelines/test_toy_scratchpad.py",
)
RAY_FILES = ("test_generate_ray.py", "test_generate_ray_cluster.py", "test_run_ray.py")


def pytest_collection_modifyitems(config, items):
    """Under xdist (`--dist loadgroup`), one group per file, or "ray" for the files that
    start a Ray cluster; the long files first."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        file = item.nodeid.split("::")[0]
        group = "ray" if file.rsplit("/", 1)[-1] in RAY_FILES else file
        item.add_marker(pytest.mark.xdist_group(group))

    def rank(item) -> int:
        file = item.nodeid.split("::")[0]
        return LONG_FILES.index(file) if file in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file stays


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Held while a test builds (or finds cached) the toy at `out`: two xdist workers that
    want the same toy build it once, the second waiting for the first's cache."""
    with open(Path(tempfile.gettempdir()) / f"groupforge-test-build-{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def toy_dir() -> Path:
    from pipelines.toy.build import build_toy

    out = REPO / "runs" / "toy"
    with build_lock(out):
        return build_toy(out, progress=False)


def make_toy_run(toy_dir: Path, folder: Path, prompts_from: str, n_prompts: int, group_size: int,
                 max_tokens: int, rounds=(0, 1), **sampling) -> Path:
    """A run with `rounds` of the first `n_prompts` toy prompts of `prompts_from`
    ("train" or "eval"), sampled with the transformers backend (fast to start); seed = round;
    `sampling`: more SamplingConfig settings (temperature, top_p, top_k)."""
    import pyarrow.parquet as pq

    from curation.generate.base import SamplingConfig
    from curation.generate.stage import generate

    prompts_file = folder / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / f"{prompts_from}.parquet").slice(0, n_prompts), prompts_file)
    run_dir = folder / "run"
    for round in rounds:
        generate(run_dir, prompts_file, SamplingConfig(group_size=group_size, max_tokens=max_tokens, seed=round,
                                                       **sampling),
                 model=toy_dir / "model", backend="hf", round=round)
    return run_dir
