"""Multi-node Ray without a shared disk: a head (no CPUs for work) and two worker nodes on this
machine (`ray.cluster_utils.Cluster`), each with its own cache folder (GROUPFORGE_CACHE in the
node's environment), the model and the run only on the S3 endpoint (moto's server over HTTP).

- One vLLM engine on each node, joined by address as a user's `ray_address` would: each node
  fetches the model into its own cache, and the samples equal one in-process engine's (the
  session fixture `one_engine_samples`, shared with test_generate_ray.py; `make test-exhaustive`).
- The round loop with two engines and two ddp trainer ranks spread over the nodes, run by the
  CLI with the run on S3, one rank killed, then rerun: each node holds its own copy of the
  model and of the checkpoint its rank resumed from, only rank 0's node the ones it wrote, and
  the bucket holds a whole run (`make test-exhaustive`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
from ray.cluster_utils import Cluster

from curation.generate.base import GeneratorConfig
from curation.generate.stage import generate, make_generator
from store.faults import FAULT_ENV
from store.location import CACHE_ENV
from store.run_store import RunStore
from tests.helpers import (
    E2E_SPEC,
    RAY_SAMPLING,
    REPO,
    check_tables,
    ray_temp_dir,
    round_records,
    sample_columns,
    step_records,
)
from training.ray_cluster import KILL_RANK_ENV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_url(s3_server, toy_dir) -> str:
    """The toy model uploaded to the S3 endpoint, and its URL."""
    bucket = s3_server.bucket()
    client = s3_server.client()
    for path in sorted((toy_dir / "model").iterdir()):
        if path.is_file():
            client.upload_file(str(path), bucket, f"models/model/{path.name}")
    return f"s3://{bucket}/models/model"


@pytest.fixture(scope="module")
def cluster(s3_server, tmp_path_factory):
    """A head with no CPUs and two worker nodes of 1 CPU, each node with its own cache folder
    (`caches`, by node id) in its environment, and a driver cache for this process."""
    root = tmp_path_factory.mktemp("nodes")
    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster records its address in /tmp/ray whatever temp_dir says
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "temp_dir": ray_temp_dir()})
    caches = {}
    for i in range(2):
        node = cluster.add_node(num_cpus=1, env_vars={CACHE_ENV: str(root / f"node-{i}")})
        caches[node.node_id] = root / f"node-{i}"
    cluster.wait_for_nodes()
    cluster.caches = caches
    cluster.driver_cache = root / "driver"
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.exhaustive  # vLLM on Ray is checked on one node by test_generate_ray.py, the nodes' copies below
def test_one_engine_per_node_each_from_its_own_copy_of_the_model(cluster, model_url, ray_prompts_file,
                                                                  one_engine_samples, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(cluster.driver_cache))
    settings = GeneratorConfig(engines=2, dtype="float32", ray_address=cluster.address)
    engines = make_generator("vllm", model_url, **settings.generator_kwargs("vllm"))
    try:
        nodes = {info["node_id"] for info in engines.info}
        assert nodes == set(cluster.caches)  # one engine on each worker node, none on the head
        generate(tmp_path / "run", ray_prompts_file, RAY_SAMPLING, generator=engines, chunk_prompts=32)
    finally:
        engines.close()
    assert not ray.is_initialized()  # the generator joined the cluster, so it left it on close
    for cache in cluster.caches.values():
        assert [p.name for p in cache.glob("models/*/model/config.json")] == ["config.json"]
    samples = RunStore(tmp_path / "run").read("samples")
    assert samples.num_rows == 96 * RAY_SAMPLING.group_size
    assert sample_columns(samples) == sample_columns(one_engine_samples)


CLUSTER_RUN = """
[generator]
backend = "hf"
group_size = 4
max_tokens = 6
engines = 2
engine_cpus = 0.5
ray_address = "{address}"

[filter]
drop_duplicates = false

[train]
objective = "grpo"
batch_size = 32
token_budget = 256
lr = 1e-4
strategy = "ddp"
nproc = 2
rank_cpus = 0.5
"""


@pytest.mark.exhaustive  # a deployment of paths make test checks one by one: Ray engines killed and resumed
# (test_run_ray.py, test_generate_ray.py), runs on S3 after kills (tests/faults), trainer ranks (test_ddp.py)
def test_the_loop_on_two_nodes_with_the_run_only_on_s3_and_a_killed_rank(cluster, model_url, s3_server, toy_dir,
                                                                        tmp_path):
    """2 engines and 2 ddp trainer ranks (Ray actors, half a CPU each) spread over the two
    nodes; SIGKILL rank 1 after step 3: the run stops with one error line naming the rank, and
    the rerun resumes from the bucket, starting its ranks once."""
    text = E2E_SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"')
    text = text.replace(f'path = "{toy_dir}/model"', f'path = "{model_url}"')
    text = text[:text.index("[generator]")] + CLUSTER_RUN.format(address=cluster.address)
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/runs/cluster"
    env = {**os.environ, CACHE_ENV: str(cluster.driver_cache), "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pipelines.cli", "run", str(spec), "--run-dir", url]
    crash = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**env, FAULT_ENV: "train.step_logged:3", KILL_RANK_ENV: "1"})
    assert crash.returncode == 1 and "Traceback" not in crash.stderr, crash.stderr[-3000:]
    assert "error: trainer rank 1 of 2 died training toward step 4" in crash.stderr, crash.stderr[-3000:]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("starting 2 trainer ranks (ddp)") == 1
    assert not (tmp_path / "runs").exists() and not (REPO / "runs" / "e2e").exists()

    for cache in cluster.caches.values():  # every node read the model from its own copy
        assert len(list(cache.glob("models/*/model/model.safetensors"))) == 1
    steps = [sorted(p.name for p in c.glob("runs/*/cluster/checkpoints/step-*")) for c in cluster.caches.values()]
    # rank 0 writes a checkpoint in its node's cache, then to the bucket; on resume, each rank
    # fetches the one it starts from into its own node's cache
    assert sorted(steps) == [["step-2"], ["step-2", "step-4"]]
    mirror = tmp_path / "mirror"
    keys = s3_server.download(bucket, "runs/cluster", mirror)
    assert "checkpoints/step-4/trainer_state.json" in keys
    check_tables(mirror)
    records = round_records(mirror)
    assert [r["round"] for r in records] == [0, 1, 2]  # round 0: the start model's eval
    assert [r["policy_version"] for r in records] == [0, 2, 4]
    assert [r["samples"] for r in records[1:]] == [24 * 4] * 2
    assert [r["step"] for r in step_records(mirror)] == [1, 2, 3, 4]  # rank 0 alone writes them
