"""curation/generate/ray_engines.py: the generate stage over 2 vLLM engines on a local Ray
instance gives exactly prompts x G rows, the same samples as one in-process engine; an engine
killed (SIGKILL) mid-shard is replaced and only its shard runs again; new weights reach every
engine (their log-probs are the new model's)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from curation.generate.base import GeneratorConfig
from curation.generate.ray_engines import RayGenerator, engine_of
from curation.generate.stage import generate, make_generator
from store.run_store import RunStore
from tests.helpers import (
    RAY_SAMPLING,
    load_fp32,
    mean_abs_diff,
    perturbed_model,
    ray_temp_dir,
    sample_columns,
    transformers_logprobs,
)

SAMPLING = RAY_SAMPLING


@pytest.fixture(scope="module")
def engines(toy_dir):
    """Two vLLM engines (one CPU each) on a private 2-CPU Ray instance."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=ray_temp_dir(),
             logging_level="WARNING")
    settings = GeneratorConfig(engines=2, dtype="float32")
    generator = make_generator("vllm", toy_dir / "model", **settings.generator_kwargs("vllm"))
    yield generator
    generator.close()
    ray.shutdown()


def test_two_engines_equal_one(engines, ray_prompts_file, one_engine_samples, tmp_path):
    assert isinstance(engines, RayGenerator) and engines.engines == 2
    assert len({info["pid"] for info in engines.info}) == 2
    result = generate(tmp_path / "run", ray_prompts_file, SAMPLING, generator=engines, chunk_prompts=32)
    samples = RunStore(tmp_path / "run").read("samples")
    assert result.samples == samples.num_rows == 96 * SAMPLING.group_size
    assert sample_columns(samples) == sample_columns(one_engine_samples)
    # both engines had work: the shards split the prompts
    ids = samples.column("prompt_token_ids").to_pylist()[:: SAMPLING.group_size]
    assert {engine_of(p, 2) for p in ids} == {0, 1}


def test_engine_killed_mid_shard_is_retried_alone(engines, toy_dir, tmp_path):
    """SIGKILL one engine's process while it samples; its shard runs again on a fresh engine,
    and the round is exactly the round of a call nobody killed."""
    prompts_file = tmp_path / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / "train.parquet").slice(0, 512), prompts_file)
    generate(tmp_path / "calm", prompts_file, SAMPLING, generator=engines, chunk_prompts=512)
    victim = ray.get(engines.actor(1).describe.remote())["pid"]
    survivor, restarts = engines.actor(0), engines.restarts
    idle = _cpu_seconds(victim)

    def kill_when_sampling():  # the engine's CPU time climbs once its shard arrives
        deadline = time.monotonic() + 60
        while _cpu_seconds(victim) < idle + 0.05 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_sampling)
    killer.start()
    generate(tmp_path / "run", prompts_file, SAMPLING, generator=engines, chunk_prompts=512)
    killer.join()
    assert engines.restarts == restarts + 1
    assert engines.actor(0) is survivor  # the other engine was left alone
    assert ray.get(engines.actor(1).describe.remote())["pid"] != victim
    samples = RunStore(tmp_path / "run").read("samples")
    assert samples.num_rows == 512 * SAMPLING.group_size
    assert sample_columns(samples) == sample_columns(RunStore(tmp_path / "calm").read("samples"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_new_weights_reach_every_engine(engines, toy_dir, ray_prompts_file, tmp_path):
    new_dir = perturbed_model(toy_dir, tmp_path / "new-model")
    new_model, old_model = load_fp32(new_dir), load_fp32(toy_dir / "model")
    from safetensors.torch import load_file

    try:
        for version, weights in [(3, new_dir), (4, {k: v.clone() for k, v in load_file(new_dir / "model.safetensors")
                                                    .items()})]:
            engines.update_weights(weights, policy_version=version)
            run = tmp_path / f"run-{version}"
            generate(run, ray_prompts_file, SAMPLING, generator=engines, chunk_prompts=32)
            samples = RunStore(run).read("samples")
            assert set(samples.column("policy_version").to_pylist()) == {version}
            for engine in (0, 1):  # every engine's rows, on their own
                mine = samples.filter(pa.array([engine_of(p, 2) == engine
                                                for p in samples.column("prompt_token_ids").to_pylist()]))
                assert mine.num_rows > 0
                got = mine.column("behavior_logprobs").to_pylist()
                assert mean_abs_diff(got, transformers_logprobs(new_model, mine)) < 1e-4
                assert mean_abs_diff(got, transformers_logprobs(old_model, mine)) > 1e-2
        # a fresh engine started after an update holds the new weights too
        engines.update_weights(new_dir, policy_version=5)
        ray.kill(engines.actor(0), no_restart=True)
        prompts = [engines.tokenize(p, None) for p in pq.read_table(ray_prompts_file).column("prompt").to_pylist()]
        assert len(engines.greedy(prompts, max_tokens=4)) == len(prompts)
        assert engines.restarts >= 1
        assert {i["weights_sha256"] for i in ray.get([engines.actor(e).describe.remote() for e in (0, 1)])} == {
            engines.weights_sha256}
    finally:
        engines.update_weights(toy_dir / "model", policy_version=0)


def test_without_ray_settings_nothing_changes(toy_dir):
    settings = GeneratorConfig()
    assert not settings.uses_ray and "engines" not in settings.generator_kwargs("vllm")
    assert GeneratorConfig(ray_address="auto").uses_ray
    with pytest.raises(Exception, match="engines must be >= 1|greater than or equal"):
        GeneratorConfig(engines=0)


def test_without_ray_installed_one_engine_runs_and_more_say_what_to_install(toy_dir, tmp_path):
    """A process where `import ray` fails (as without the extra): the loop's modules import,
    engines = 1 needs nothing of Ray, and engines = 2 fails in one line naming the extra."""
    code = f"""
import sys
sys.modules["ray"] = None  # import ray raises ImportError
import pipelines.loop.run, pipelines.loop.steps, curation.generate.stage as stage
from curation.generate.base import GeneratorConfig
from store.errors import JobError
assert not GeneratorConfig().uses_ray
try:
    stage.make_generator("hf", {str(toy_dir / "model")!r}, **GeneratorConfig(engines=2).generator_kwargs("hf"))
except JobError as exc:
    print(exc)
"""
    import subprocess
    import sys

    from tests.helpers import REPO

    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generator.engines = 2 runs the engines on Ray, which is not installed: pip install 'groupforge[ray]'" \
        in done.stdout
