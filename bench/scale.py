"""Benchmark: the trainer on 1 process vs 2 gloo ranks (`--strategy ddp`) on this machine.

    .venv/bin/python bench/scale.py            # ~2 min on 2 cores
    .venv/bin/python bench/scale.py --append   # also append the section to BENCHMARKS.md

One curated toy run (64 prompts x 8, round 0, transformers generator), then `groupforge train`
for --steps optimizer steps of --batch-size rows, each in a fresh copy of the run: one
process with all cores, one process with one torch thread, and 2 ranks of one thread each
(`--strategy ddp --nproc 2`, and `--strategy fsdp2 --nproc 2`). Reported: trainer tokens/s
(real prompt + response tokens per second of optimizer step, the median over the steps after
the first) and the ratio to one process. Each rank is a process of its own with its own
model and optimizer; the gradients are summed by one all-reduce per step (ddp) or
reduce-scattered, with the weights all-gathered for every layer (fsdp2). Not here yet:
engines over Ray (generation).
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
    from pipelines.curate import STAGES, CurationSpec, run_stage

    run_dir = folder / "run"
    if (run_dir / "groups").is_dir():
        return run_dir
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.parquet"
    pq.write_table(pq.read_table(toy / "train.parquet").slice(0, 64), prompts)
    generate(run_dir, prompts, SamplingConfig(group_size=8, max_tokens=8, seed=0), model=toy / "model", backend="hf")
    for stage in STAGES:
        run_stage(stage, run_dir, 0, CurationSpec(filter={"drop_duplicates": False}))
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


def main() -> None:
    import pipelines.toy as toy_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args()
    toy = toy_module.build_toy(ROOT / "runs" / "toy", progress=False)
    OUT.mkdir(parents=True, exist_ok=True)
    source = curated_run(toy, OUT / "source")
    setups = [("1 process, all cores", 0, 1, "single"), ("1 process, 1 thread", 1, 1, "single"),
              ("2 ranks x 1 thread (ddp)", 1, 2, "ddp"), ("2 ranks x 1 thread (fsdp2)", 1, 2, "fsdp2")]
    rows = {label: train_rate(source, toy, f"r{k}", args.steps, args.batch_size, threads, nproc, strategy)
            for k, (label, threads, nproc, strategy) in enumerate(setups)}
    base = rows["1 process, all cores"]["tokens_per_s"]
    lines = [f"## scale: the trainer on 1 process vs 2 gloo ranks — {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"- machine: {machine()}", f"- command: `{command('scale.py')}`",
             f"- default toy, 64 prompts x 8 (round 0), grpo, {args.steps} steps of {args.batch_size} rows "
             "(median over the steps after the first); wall includes start-up (torchrun, imports, model load)", "",
             "| setup | tokens/s | vs 1 process, all cores | s per step | wall s |", "|---|--:|--:|--:|--:|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | {r['step_s']:.3f} | "
                     f"{r['wall']:.1f} |")
    publish("\n".join(lines) + "\n", "scale", ROOT / "runs" / "bench", args.append)


if __name__ == "__main__":
    main()
