"""bench/gpu_check.py: the CPU dry run runs every section for real (vLLM engines in Ray actors,
bf16 training, the weight reload, 2 gloo ranks) and its figures hold; the time budget stops a
section and skips the rest; a machine that cannot run a section skips it without failing."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("bench_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.slow
def test_dry_run_runs_every_section_and_its_figures_hold(gpu_check, toy_dir, tmp_path):
    out = tmp_path / "dry.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--toy", str(toy_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    record = json.loads(out.read_text())
    assert record["mode"] == "dry-run" and record["device"].startswith("cpu") and record["gpus"] == 0
    sections = {s["name"]: s for s in record["sections"]}
    assert list(sections) == ["toy_engine", "llama_engine", "train_bf16", "weight_reload", "two_ranks"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok"), sections
    sizes = gpu_check.DRY_SIZES
    figures = {name: s["figures"] for name, s in sections.items()}

    for name, prompts in (("toy_engine", sizes.toy_prompts), ("llama_engine", sizes.llama_prompts)):
        engine = figures[name]
        assert engine["samples"] == prompts * sizes.group_size and engine["response_tokens"] > 0
        assert engine["samples_per_s"] > 0 and engine["response_tokens_per_s"] > 0
    assert 0.5e6 < figures["llama_engine"]["model_params"] < 2e6  # --llama-size 1M, shapes rounded

    train = figures["train_bf16"]
    assert train["dtype"] == "bfloat16" and train["device"] == "cpu" and train["steps"] == sizes.train_steps
    assert train["steps_per_s"] > 0 and train["tokens_per_s"] > 0 and math.isfinite(train["loss"])
    assert train["mean_weight_change"] > 0

    # Engine (fp32, vLLM's CPU kernels) and trainer (fp32, transformers) over the same tokens differ only
    # in rounding order: ~5e-7 at most here. 1e-3 leaves room for other kernels and still tells a stale
    # engine, whose gap against the base weights is ~0.4 here.
    reload = figures["weight_reload"]
    assert reload["policy_version"] == 1 + sizes.train_steps and reload["compare_dtype"] == "float32"
    assert reload["tokens"] > 0
    assert reload["max_abs_gap"] < 1e-3 and reload["mean_abs_gap"] < 1e-4
    assert reload["stale_mean_abs_gap"] > max(1e-2, 100 * reload["mean_abs_gap"])

    # 2 gloo ranks take the one-process steps: under bf16 the two splits of a step round differently,
    # so weights differ, but on average far less than the steps moved them (~0.3% of it here).
    ranks = figures["two_ranks"]
    assert ranks["backend"] == "gloo" and ranks["nproc"] == 2 and ranks["steps"] == sizes.train_steps
    assert ranks["steps_per_s"] > 0 and ranks["tokens_per_s"] > 0
    assert ranks["mean_weight_diff_vs_single"] < 0.05 * train["mean_weight_change"]
    assert math.isfinite(ranks["max_weight_diff_vs_single"])
    assert "dry-run on cpu" in done.stdout and "two_ranks" in done.stdout  # the printed table


def _ctx(gpu_check, tmp_path, **changes):
    sizes = replace(gpu_check.DRY_SIZES, min_section_s=0.5)
    return gpu_check.Context(sizes=sizes, work=tmp_path, toy=tmp_path, cuda=False, gpus=0, ray_address="", **changes)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_budget_stops_a_section_blocked_in_ray_and_skips_the_next(gpu_check, tmp_path):
    """A section waiting in ray.get (an engine starting, ranks training) stops when the budget ends."""
    import ray

    from tests.helpers import ray_temp_dir

    ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=ray_temp_dir(), logging_level="WARNING")
    try:
        sleep = ray.remote(_sleep)
        ray.get(sleep.remote(0))  # the worker is up: the budget goes to the wait below
        ctx, budget, done = _ctx(gpu_check, tmp_path), gpu_check.Budget(2.0), {}
        slow = gpu_check.Section("slow", lambda ctx: ray.get(sleep.remote(60)))
        tic = time.perf_counter()
        done["slow"] = gpu_check.run_section(slow, ctx, budget, done)
        assert time.perf_counter() - tic < 10
    finally:
        ray.shutdown()
    assert done["slow"].status == "timeout" and "budget ran out" in done["slow"].reason
    later = gpu_check.run_section(gpu_check.Section("later", lambda ctx: None), ctx, budget, done)
    assert (later.status, later.skipped_for) == ("skipped", "budget") and "budget left" in later.reason
    user = gpu_check.run_section(gpu_check.Section("user", lambda ctx: None, needs=("slow",)), ctx, budget, done)
    assert user.skipped_for == "needs"
    record = gpu_check.CheckRecord("dry-run", "cpu", 0, 2, 1.0, 0.0, 1.0, {}, {}, [done["slow"], later])
    assert not gpu_check.passed(record)


def test_a_failed_section_is_recorded_and_one_gpu_skips_the_nccl_ranks(gpu_check, tmp_path):
    ctx, budget = _ctx(gpu_check, tmp_path), gpu_check.Budget(60.0)

    def broken(ctx):
        raise RuntimeError("engine fell over\nmore")

    failed = gpu_check.run_section(gpu_check.Section("broken", broken), ctx, budget, {})
    assert (failed.status, failed.reason) == ("failed", "RuntimeError: engine fell over")
    one_gpu = _ctx(gpu_check, tmp_path)
    one_gpu.cuda, one_gpu.gpus = True, 1
    ranks = next(s for s in gpu_check.SECTIONS if s.name == "two_ranks")
    ok = gpu_check.SectionRecord("train_bf16", "ok", 1.0)
    skipped = gpu_check.run_section(ranks, one_gpu, budget, {"train_bf16": ok})
    assert skipped.skipped_for == "machine" and "2 GPUs" in skipped.reason
    record = gpu_check.CheckRecord("gpu", "cuda", 1, 16, 480.0, 0.0, 1.0, {}, {}, [ok, skipped])
    assert gpu_check.passed(record)


@pytest.mark.parametrize("size", ["1M", "100M", "0.3B"])
def test_llama_size(gpu_check, size):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = gpu_check.parse_size(size)
    assert target == {"1M": 10**6, "100M": 10**8, "0.3B": 3 * 10**8}[size]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=18, **gpu_check.llama_shape(target)))
    params = sum(p.numel() for p in model.parameters())
    assert 0.6 * target < params < 1.5 * target
