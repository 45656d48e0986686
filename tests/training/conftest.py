"""Fixtures of the trainer's tests: one curated toy run, shared, and fresh copies of it."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import make_toy_run


@pytest.fixture(scope="session")
def curated_run(toy_dir, tmp_path_factory):
    """Two rounds of 24 toy prompts x 8 (transformers backend, T=1), curated with the defaults
    (exact_match, zero-variance and duplicate filters, grpo advantages, max_min soft pairs).
    Read-only: tests that write take `run_copy`."""
    from curation.stages.runner import run_stage
    from pipelines.loop.curate import STAGES, CurationSpec

    run_dir = make_toy_run(toy_dir, tmp_path_factory.mktemp("train"), "train", n_prompts=24, group_size=8,
                           max_tokens=6)
    for round in (0, 1):
        for stage in STAGES:
            run_stage(stage, run_dir, round, getattr(CurationSpec(), stage))
    return run_dir


@pytest.fixture
def run_copy(curated_run, tmp_path):
    """A fresh copy of the curated run (training writes checkpoints and metrics into it)."""
    dst = tmp_path / "run"
    shutil.copytree(curated_run, dst)
    return dst
