"""Benchmark: engines over Ray, trainer ranks and the overlapped round loop on this machine.

    .venv/bin/python bench/scale.py            # ~6 min on 2 cores
    .venv/bin/python bench/scale.py --append   # also append the section to BENCHMARKS.md

Generation: the toy's vLLM engine in this process (torch on all cores), then 1 and 2 engines
as Ray actors (`[generator] engines`, one CPU each), each sampling the same --gen-prompts x 8
(seeded: the same samples whatever the number of engines); reported: samples/s and response
tokens/s (the median of 3 calls after a warm-up), and the 2-engine efficiency (2-engine rate /
2 x 1-engine rate), from which the projection to N engines is made.

The round loop: toy-grpo rounds on 2 Ray engines (half a CPU each in Ray's books) with
`[run] overlap` 0 and 1, and with 2 ddp trainer ranks; reported: the median round wall
seconds after the first two rounds and samples/s of the loop.

One curated toy run (64 prompts x 8, round 0, transformers generator), then `groupforge train`
for --steps optimizer steps of --batch-size rows, each in a fresh copy of the run: one
process with all cores, one process with one torch thread, and 2 ranks of one thread each
(`--strategy ddp --nproc 2`, and `--strategy fsdp2 --nproc 2`). Reported: trainer tokens/s
(real prompt + response tokens per second of optimizer step, the median over the steps after
the first) and the ratio to one process. Each rank is a process of its own with its own
model and optimizer; the gradients are summed by one all-reduce per step (ddp) or
reduce-scattered, with the weights all-gathered for every layer (fsdp2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

from _report import command, machine, publish  # noqa: E402

OUT = ROOT / "runs" / "bench" / "scale"


def curated_run(toy: Path, folder: Path) -> Path:
    import pyarrow.parquet as pq

    from curation.generate.base import SamplingConfig
    from curation.generate.stage import generate
    from curation.stages.runner import run_stage
    from pipelines.loop.curate import STAGES, CurationSpec

    run_dir = folder / "run"
    if (run_dir / "groups").is_dir():
        return run_dir
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.parquet"
    pq.write_table(pq.read_table(toy / "train.parquet").slice(0, 64), prompts)
    generate(run_dir, prompts, SamplingConfig(group_size=8, max_tokens=8, seed=0), model=toy / "model", backend="hf")
    for stage in STAGES:
        run_stage(stage, run_dir, 0, getattr(CurationSpec(filter={"drop_duplicates": False}), stage))
    return run_dir


def train_rate(source: Path, toy: Path, name: str, steps: int, batch: int, threads: int, nproc: int,
               strategy: str = "ddp") -> dict:
    run_dir = OUT / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(source, run_dir)
    cmd = [sys.executable, "-m", "pipelines.cli", "train", str(run_dir), "--steps", str(steps), "--model",
           str(toy / "model"), "--batch-size", str(batch), "--lr", "1e-4"]
    if nproc > 1:
        cmd += ["--strategy", strategy, "--nproc", str(nproc)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    tic = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - tic
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r.get("event") == "step"][1:]  # the first step warms up
    return {"tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in steps_),
            "step_s": statistics.median(r["seconds"] for r in steps_), "wall": wall}


def engine_rates(toy: Path, n_prompts: int) -> dict[str, dict]:
    """samples/s and tokens/s of the toy's vLLM engine in-process and of 1 and 2 Ray engines."""
    import ray

    from curation.generate.base import SamplingConfig, load_prompts, prompt_seed
    from curation.generate.stage import make_generator

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    prompts = load_prompts(toy / "train.parquet").slice(0, n_prompts)
    cfg = SamplingConfig(group_size=8, max_tokens=8, seed=0)
    seeds = [prompt_seed(0, 1, pid) for pid in prompts.column("prompt_id").to_pylist()]
    rows = {}
    for label, ray_settings in [("1 engine in this process", None),
                                ("1 engine on Ray (1 CPU)", {"engines": 1, "ray_address": "local"}),
                                ("2 engines on Ray (1 CPU each)", {"engines": 2})]:
        if ray_settings:  # a private 2-CPU instance; the generator uses it
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        generator = make_generator("vllm", toy / "model", dtype="float32", **(ray_settings or {}))
        ids = [generator.tokenize(p, None) for p in prompts.column("prompt").to_pylist()]
        generator.sample(ids, seeds, cfg)  # warm-up
        times, tokens = [], 0
        for _ in range(3):
            tic = time.perf_counter()
            groups = generator.sample(ids, seeds, cfg)
            times.append(time.perf_counter() - tic)
            tokens = sum(len(c.token_ids) for g in groups for c in g)
        generator.close()
        if ray.is_initialized():
            ray.shutdown()
        t = statistics.median(times)
        rows[label] = {"samples_per_s": n_prompts * cfg.group_size / t, "tokens_per_s": tokens / t, "seconds": t}
    return rows


def loop_rate(toy: Path, name: str, rounds: int, sets: list[str]) -> dict:
    """Median round wall seconds (rounds 3..) of toy-grpo on Ray engines with `sets`."""
    run_dir = OUT / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipelines.cli", "run", str(ROOT / "pipelines" / "specs" / "toy-grpo.toml"),
           "--run-dir", str(run_dir), "--set", f"run.rounds={rounds}", "--set", "eval.every=1000",
           "--set", "generator.backend=vllm", "--set", "generator.engines=2", "--set", "generator.engine_cpus=0.5"]
    for item in sets:
        cmd += ["--set", item]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    tic = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - tic
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds_ = [r for r in records if r.get("event") == "round" and 3 <= r["round"] < rounds]  # the last evaluates
    seconds = statistics.median(r["wall_seconds"] for r in rounds_)
    return {"round_s": seconds, "samples_per_s": statistics.median(r["samples"] for r in rounds_) / seconds,
            "wall": wall}


def main() -> None:
    import pipelines.toy.build as toy_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--gen-prompts", type=int, default=512)
    parser.add_argument("--loop-rounds", type=int, default=8)
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args()
    toy = toy_module.build_toy(ROOT / "runs" / "toy", progress=False)
    OUT.mkdir(parents=True, exist_ok=True)
    source = curated_run(toy, OUT / "source")
    setups = [("1 process, all cores", 0, 1, "single"), ("1 process, 1 thread", 1, 1, "single"),
              ("2 ranks x 1 thread (ddp)", 1, 2, "ddp"), ("2 ranks x 1 thread (fsdp2)", 1, 2, "fsdp2")]
    rows = {label: train_rate(source, toy, f"r{k}", args.steps, args.batch_size, threads, nproc, strategy)
            for k, (label, threads, nproc, strategy) in enumerate(setups)}
    engines = engine_rates(toy, args.gen_prompts)
    loops = {label: loop_rate(toy, f"loop{k}", args.loop_rounds, sets) for k, (label, sets) in enumerate([
        ("2 engines, trainer in the driver, overlap 0", ["run.overlap=0"]),
        ("2 engines, trainer in the driver, overlap 1", ["run.overlap=1"]),
        ("2 engines, 2 ddp trainer ranks, overlap 1", ["run.overlap=1", "train.strategy=ddp", "train.nproc=2",
                                                       "train.rank_cpus=0.5"])])}

    base = rows["1 process, all cores"]["tokens_per_s"]
    lines = [f"## scale: engines over Ray, trainer ranks, the overlapped loop — {time.strftime('%Y-%m-%d %H:%M')}",
             "", f"- machine: {machine()}", f"- command: `{command('scale.py')}`", "",
             f"### Generation: {args.gen_prompts} toy prompts x 8, max_tokens 8, vLLM fp32 (median of 3 calls)", "",
             "| engines | samples/s | response tokens/s | vs 1 engine in this process | s per call |",
             "|---|--:|--:|--:|--:|"]
    one = engines["1 engine in this process"]["samples_per_s"]
    for label, r in engines.items():
        lines.append(f"| {label} | {r['samples_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['samples_per_s'] / one:.2f}x | {r['seconds']:.3f} |")
    per_engine = engines["1 engine on Ray (1 CPU)"]["samples_per_s"]
    efficiency = engines["2 engines on Ray (1 CPU each)"]["samples_per_s"] / (2 * per_engine)
    lines += ["", f"- 2-engine efficiency here: {efficiency:.2f} (2-engine rate / 2 x the 1-engine rate on Ray).",
              f"- Projection: N engines, each on its own device, sample about N x {per_engine:,.0f} samples/s x "
              "the efficiency at that N; for GPUs put a per-engine rate measured on one GPU in place of this CPU "
              "rate (engines share nothing but the driver: each gets its shard and returns its groups).",
              "", f"### The round loop: toy-grpo, 256 prompts x 8 a round, {args.loop_rounds} rounds, median round "
              "after the first two (the last, which evaluates, left out)", "",
              "| setup | s per round | loop samples/s | wall s (start-up included) |", "|---|--:|--:|--:|"]
    for label, r in loops.items():
        lines.append(f"| {label} | {r['round_s']:.2f} | {r['samples_per_s']:,.0f} | {r['wall']:.1f} |")
    lines += ["", f"### The trainer: default toy, 64 prompts x 8 (round 0), grpo, {args.steps} steps of "
              f"{args.batch_size} rows (median over the steps after the first); wall includes start-up (torchrun, "
              "imports, model load)", "",
              "| setup | tokens/s | vs 1 process, all cores | s per step | wall s |", "|---|--:|--:|--:|--:|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | {r['step_s']:.3f} | "
                     f"{r['wall']:.1f} |")
    publish("\n".join(lines) + "\n", "scale", ROOT / "runs" / "bench", args.append)


if __name__ == "__main__":
    main()
