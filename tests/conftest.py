"""Shared fixtures. The toy is built once into runs/toy (cached there across test runs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# In-process vLLM engine (fast start) with a small KV cache; no hub access.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def toy_dir() -> Path:
    from pipelines.toy import build_toy

    return build_toy(REPO / "runs" / "toy", progress=False)


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
