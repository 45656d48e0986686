"""Shared fixtures. The toy is built once into runs/toy (cached there across test runs).

`make test` runs the tests on two pytest-xdist workers, one test file at a time each (the Ray
files together on one worker: each starts a local cluster), the longest files first; every
worker and what it starts runs one torch thread, so two workers fill two cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# In-process vLLM engine (fast start) with a small KV cache; no hub access.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch starts: two workers, two cores

from tests.helpers import REPO, build_lock  # noqa: E402  (after the environment above)

# Files that take minutes: scheduled first, so that the other worker is not left waiting at
# the end for one of them. The rest follow in collection order.
LONG_FILES = (
    "tests/faults/test_faults.py",
    "tests/pipelines/test_run_ray.py",
    "tests/pipelines/test_run.py",
    "tests/curation/test_generate_ray.py",
    "tests/training/test_ddp.py",
    "tests/training/test_trainer.py",
    "tests/pipelines/test_trackers.py",
    "tests/pipelines/test_cli.py",
    "tests/pipelines/test_init.py",
    "tests/pipelines/test_toy_scratchpad.py",
)
RAY_FILES = ("test_generate_ray.py", "test_generate_ray_cluster.py", "test_run_ray.py")


def _group(nodeid: str) -> str:
    """The xdist group of a test: "ray" for the files that start a Ray cluster, else its file."""
    file = nodeid.split("::")[0]
    return "ray" if file.rsplit("/", 1)[-1] in RAY_FILES else file


def pytest_collection_modifyitems(config, items):
    """Under xdist (`--dist loadgroup`), one group per file, or "ray" for the files that
    start a Ray cluster; the long files first."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item.nodeid)))

    def rank(item) -> int:
        file = item.nodeid.split("::")[0]
        return LONG_FILES.index(file) if file in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file stays


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # first: xdist answers loadgroup itself
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups above taken from the node ids. xdist's own passes a
    group on by appending "@group" to each item's node id, which pytest 9 ignores (a node id
    is derived from the node's path): each test would be a group of its own, a file's tests
    spread over both workers, its module fixtures built on each (again whenever a worker
    switches files), and the Ray files run at once."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return FileGroups(config, log)


@pytest.fixture(scope="session")
def toy_dir() -> Path:
    from pipelines.toy.build import build_toy

    out = REPO / "runs" / "toy"
    with build_lock(out):
        return build_toy(out, progress=False)
