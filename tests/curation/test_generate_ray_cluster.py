"""Multi-node Ray: a head (no CPUs for work) and two worker nodes on this machine
(`ray.cluster_utils.Cluster`), one vLLM engine on each node, joined by address as a user's
`ray_address` would; the samples equal one in-process engine's (the session fixture
`one_engine_samples`, shared with test_generate_ray.py)."""

from __future__ import annotations

import os

import ray
from ray.cluster_utils import Cluster

from curation.generate.base import GeneratorConfig
from curation.generate.stage import generate, make_generator
from curation.store.run_store import RunStore
from tests.helpers import RAY_SAMPLING, ray_temp_dir, sample_columns


def test_one_engine_per_node_on_a_three_node_cluster(toy_dir, ray_prompts_file, one_engine_samples, tmp_path):
    prompts_file = ray_prompts_file

    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster records its address in /tmp/ray whatever temp_dir says
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "temp_dir": ray_temp_dir()})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    try:
        settings = GeneratorConfig(engines=2, dtype="float32", ray_address=cluster.address)
        engines = make_generator("vllm", toy_dir / "model", **settings.generator_kwargs("vllm"))
        try:
            nodes = {info["node_id"] for info in engines.info}
            assert nodes == {w.node_id for w in workers}  # one engine on each worker node, none on the head
            generate(tmp_path / "run", prompts_file, RAY_SAMPLING, generator=engines, chunk_prompts=32)
        finally:
            engines.close()
        assert not ray.is_initialized()  # the generator joined the cluster, so it left it on close
    finally:
        cluster.shutdown()
    samples = RunStore(tmp_path / "run").read("samples")
    assert samples.num_rows == 96 * RAY_SAMPLING.group_size
    assert sample_columns(samples) == sample_columns(one_engine_samples)
