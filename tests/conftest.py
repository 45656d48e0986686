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
