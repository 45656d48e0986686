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

# The longest files (about a minute or more): scheduled first, so that the other worker is not left waiting at
# the end for one of them. The rest follow in collection order.
LONG_FILES = (
    "tests/pipelines/test_real_model.py",
    "tests/faults/test_faults.py",
    "tests/training/test_sizing.py",
    "tests/pipelines/test_run_ray.py",
    "tests/curation/test_generate_ray.py",
    "tests/training/test_ddp.py",
    "tests/store/test_concurrency.py",
    "tests/pipelines/test_init.py",
    "tests/pipelines/test_bad_inputs.py",
    "tests/pipelines/test_object_store_failures.py",
    "tests/training/test_trainer.py",
    "tests/curation/test_turns.py",
    "tests/bench/test_gpu_check.py",
)
RAY_FILES = ("test_generate_ray.py", "test_generate_ray_cluster.py", "test_run_ray.py", "test_gpu_check.py",
             "test_ray_cluster.py")


def _group(nodeid: str) -> str:
    """The xdist group of a test: "ray" for the files that start a Ray cluster, else its file."""
    file = nodeid.split("::")[0]
    return "ray" if file.rsplit("/", 1)[-1] in RAY_FILES else file


EXHAUSTIVE_TIMEOUT = 2700
"""Seconds an exhaustive test may run (pyproject's 900 for the others): the toy variants' and
families' builds take minutes each on a fast host and twice that on a slow one."""


def pytest_collection_modifyitems(config, items):
    """An exhaustive test's time limit; under xdist (`--dist loadgroup`), one group per file, or
    "ray" for the files that start a Ray cluster, and the long files first."""
    for item in items:
        if item.get_closest_marker("exhaustive") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(EXHAUSTIVE_TIMEOUT))
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item.nodeid)))

    def rank(item) -> int:
        file = item.nodeid.split("::")[0]
        return LONG_FILES.index(file) if file in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file stays


@pytest.hookimpl(tryfirst=True)  # before xdist's (trylast) reads the option
def pytest_configure(config):
    """Under `--dist loadgroup` a worker that dies (a crash, or pytest-timeout ending a hung test)
    is not replaced unless `--max-worker-restart` says so: xdist's scope scheduler does not take
    a replacement in, and the session never ends (seen with a test that calls os._exit, also
    when the dead worker's test is kept from running again; xdist's own loadscope ends in an
    INTERNALERROR). Without a replacement the dead worker's test fails by name and pytest ends
    non-zero (the tests still queued on that worker do not run)."""
    if getattr(config.option, "dist", None) == "loadgroup" and config.option.maxworkerrestart is None:
        config.option.maxworkerrestart = "0"


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
    from store.storage import open_storage

    if request.param == "local":
        return open_storage(tmp_path / "run")
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket()}/runs/x")


@pytest.fixture(scope="session")
def ray_prompts_file(toy_dir, tmp_path_factory) -> Path:
    """The prompts of the Ray engine tests: the first 96 toy train prompts."""
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("ray-prompts") / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / "train.parquet").slice(0, 96), path)
    return path


@pytest.fixture(scope="session")
def one_engine_samples(toy_dir, ray_prompts_file, tmp_path_factory):
    """`ray_prompts_file` sampled with `RAY_SAMPLING` by one in-process vLLM engine (no Ray), 32
    prompts a call: the reference the Ray engine tests compare with. Session-scoped, so the Ray
    files (one xdist worker runs them all) start that engine once."""
    from curation.generate.stage import generate
    from curation.generate.vllm import VLLMGenerator
    from store.run_store import RunStore
    from tests.helpers import RAY_SAMPLING

    run = tmp_path_factory.mktemp("one-engine") / "run"
    generator = VLLMGenerator(toy_dir / "model", dtype="float32")
    try:
        generate(run, ray_prompts_file, RAY_SAMPLING, generator=generator, chunk_prompts=32)
    finally:
        generator.close()
    return RunStore(run).read("samples")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as `make real-model` imports it (runs/models/SmolLM2-135M-Instruct; its
    GGUF in runs/models/wheels/). Missing, it fails the test rather than skip it: CI without the
    model must not pass quietly."""
    folder = REPO / "runs" / "models" / "SmolLM2-135M-Instruct"
    if not (folder / "config.json").is_file():
        pytest.fail(f"no real model in {folder}: run `make real-model`", pytrace=False)
    return folder
