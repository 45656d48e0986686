"""Benchmark: rollout correction off vs on, where the samples are off-policy on the toy.

    .venv/bin/python bench/correction.py             # 6 settings x 2 seeds, 2 at a time: ~10 min on 2 cores
    .venv/bin/python bench/correction.py --rounds 20 --seeds 0 --append

Each run is `groupforge run pipelines/specs/toy-grpo.toml` on the default toy, 64 prompts x 8
a round, 2 optimizer steps of 256, eval every 5 rounds, with one of these settings:

    fresh              the recipe: samples of this round only, old = behavior (bypass)
    stale bypass       + replay_rounds = 2 (every step also trains on the two rounds before,
                       sampled by older weights), old = behavior: the PPO ratio current/behavior
    stale decoupled    + old_logprobs = recompute: the ratio current/old, no correction weight
    stale corrected    + rollout_correction = token_truncate (cap 2): the weight old/behavior
    bf16 bypass        the generator in bfloat16, the trainer in float32, old = behavior
    bf16 corrected     + old_logprobs = recompute, rollout_correction = token_truncate

The table has the start, final and best eval accuracy, and the step records' mismatch
metrics (decoupled runs): KL(behavior || old) (k3), |old - behavior| by rounds of staleness,
the mean correction weight and the share truncated; `ratio max` is the PPO ratio's largest
value over the run, a sign of what the clip had to catch. One seed each: the machine is
shared and 2 cores are few, so read differences of a few points as noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

from _report import command, machine, publish  # noqa: E402

OUT = ROOT / "runs" / "bench" / "correction"
BASE = ["prompts.per_round=64", "run.steps_per_round=2", "eval.every=5", "run.checkpoint_every=1000"]
STALE = ["run.replay_rounds=2"]
DECOUPLED = ["train.old_logprobs=recompute"]
CORRECTED = DECOUPLED + ["train.rollout_correction=token_truncate", "train.correction_cap=2.0"]
BF16 = ["generator.dtype=bfloat16"]
RUNS = {
    "fresh": [],
    "stale bypass": STALE,
    "stale decoupled": STALE + DECOUPLED,
    "stale corrected": STALE + CORRECTED,
    "bf16 bypass": BF16,
    "bf16 corrected": BF16 + CORRECTED,
}
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def worker(job: dict) -> None:
    from _gf_run import loop_spec

    from pipelines.loop.run import run_pipeline

    spec = loop_spec(ROOT / "pipelines" / "specs" / "toy-grpo.toml", job["toy"], job["slug"], job["seed"],
                     BASE + job["set"], rounds=job["rounds"])
    run_pipeline(spec, job["out_dir"], log=lambda message: None)


def summarise(run_dir: Path) -> dict:
    from store.run_files import MetricsLog

    rounds, steps, _ = MetricsLog(run_dir).read()
    accuracy = [r["eval_accuracy"] for r in rounds if r.get("eval_accuracy") is not None]

    def mean(key: str) -> float | None:
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        return statistics.fmean(values) if values else None

    return {"start": accuracy[0], "final": accuracy[-1], "best": max(accuracy),
            "ratio_max": max((s.get("ratio_max") or 0) for s in steps),
            "clip": mean("clip_frac_low") + mean("clip_frac_high") if mean("clip_frac_low") is not None else None,
            **{key: mean(key) for key in ("mismatch_kl_k3", "old_behavior_gap_lag0", "old_behavior_gap_lag1",
                                         "old_behavior_gap_lag2+", "behavior_logp_gap", "is_weight_mean",
                                         "is_truncated_frac")},
            "seconds": sum(r.get("wall_seconds") or 0 for r in rounds)}


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and (abs(value) < 1e-3 and value != 0):
        return f"{value:.1e}"
    return f"{value:.{digits}f}"


def markdown(results: dict[tuple[str, int], dict], args, command: str) -> str:
    header = ["run", "seed", "settings", "start", "final", "best", "ratio max", "clip frac", "KL(beh||old) k3",
              "|old-beh| lag 0", "lag 1", "lag 2+", "|cur-beh| same version", "weight mean", "truncated", "s"]
    lines = [f"## rollout correction: off vs on, with stale replay and a bf16 generator — "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "", f"- machine: {machine()}", f"- command: `{command}`",
             f"- default toy, toy-grpo.toml with {', '.join(BASE)}, {args.rounds} rounds, seeds {args.seeds}, "
             "one torch thread per run, two runs at a time; accuracy: greedy exact match on eval.parquet", "",
             "| " + " | ".join(header) + " |", "|---|--:|---|" + "--:|" * (len(header) - 3)]
    for (name, seed), r in sorted(results.items(), key=lambda item: (list(RUNS).index(item[0][0]), item[0][1])):
        cells = [name, str(seed), ", ".join(s.split(".", 1)[1] for s in RUNS[name]) or "the recipe",
                 fmt(r["start"]), fmt(r["final"]), fmt(r["best"]), fmt(r["ratio_max"], 2), fmt(r["clip"]),
                 fmt(r["mismatch_kl_k3"]), fmt(r["old_behavior_gap_lag0"]), fmt(r["old_behavior_gap_lag1"]),
                 fmt(r["old_behavior_gap_lag2+"]), fmt(r["behavior_logp_gap"]), fmt(r["is_weight_mean"]),
                 fmt(r["is_truncated_frac"]), f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Mean over seeds (final / best accuracy):", ""]
    for name in dict.fromkeys(name for name, _ in results):
        runs = [r for (n, _), r in results.items() if n == name]
        lines.append(f"- {name}: final {statistics.fmean(r['final'] for r in runs):.3f}, best "
                     f"{statistics.fmean(r['best'] for r in runs):.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    import pipelines.toy.build as toy_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", default="0,1", help="comma-separated (default 0,1)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--only", action="append", help="run only these (names as in the docstring)")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    toy = toy_module.build_toy(ROOT / "runs" / "toy", progress=False)
    names = args.only or list(RUNS)
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(RUNS)}")

    seeds = [int(s) for s in args.seeds.split(",")]

    def run(item: tuple[str, int]) -> dict:
        name, seed = item
        slug = f"{name.replace(' ', '-')}-seed{seed}"
        out_dir = OUT / slug
        if not (args.reuse and (out_dir / "metrics.jsonl").is_file()):
            job = dict(toy=str(toy), slug=slug, seed=seed, set=RUNS[name], rounds=args.rounds,
                       out_dir=str(out_dir))
            subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], check=True, cwd=ROOT,
                           env={**os.environ, **ENV}, timeout=3600)
        print(f"{name}, seed {seed}: done", flush=True)
        return summarise(out_dir)

    items = [(name, seed) for seed in seeds for name in names]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # threads only wait on the child processes
        results = dict(zip(items, pool.map(run, items)))
    publish(markdown(results, args, command("correction.py")), "correction", ROOT / "runs" / "bench", args.append)


if __name__ == "__main__":
    main()
