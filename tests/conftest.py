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


@pytest.fixture(scope="session")
def toy_dir() -> Path:
    from pipelines.toy.build import build_toy

    out = REPO / "runs" / "toy"
    with build_lock(out):
        return build_toy(out, progress=False)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3-compatible server on 127.0.0.1 (tests/s3_server.py), one per worker, with the
    standard AWS variables pointing at it in this process's environment."""
    from tests.s3_server import S3Server, aws_env_applied, restore_env

    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    before = aws_env_applied(server)
    try:
        yield server
    finally:
        restore_env(before)
        server.stop()


@pytest.fixture(params=["local", "s3"])
def run_storage(request, tmp_path):
    """A run's storage, once as a local folder and once under a new bucket of the S3 server."""
    from curation.store.storage import open_storage

    if request.param == "local":
        return open_storage(tmp_path / "run")
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket()}/runs/x")
