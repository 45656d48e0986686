"""Benchmark: where a round of the loop goes at 512 samples, and how much of it is not model work.

    .venv/bin/python bench/round_overhead.py            # 3 runs of 28 rounds: ~2 min on 2 cores
    .venv/bin/python bench/round_overhead.py --runs 5   # more runs: a steadier median
    .venv/bin/python bench/round_overhead.py --append   # also append the section to BENCHMARKS.md
    .venv/bin/python bench/round_overhead.py --long 500  # one run of 500 rounds: early vs late rounds

Each run is `run_pipeline` on the default toy with the shipped recipe (pipelines/specs/toy-grpo.toml)
at 64 prompts x 8 = 512 samples a round, 2 optimizer steps of 256, eval every 10 rounds and one
checkpoint at the end (`--gf-set` changes more), in a fresh run folder under runs/bench. Rounds 1
and 2 are left out (the engine and the trainer warm up there).

Model work is what RoundRecord.model_seconds counts: the engine's sampling and greedy calls and
the trainer's optimizer steps (forward, backward, clip, AdamW). Everything else of the round's
wall seconds is overhead, split as the round records split it: generate minus sampling (prompt
tokenizing, the samples table, its commit), the curation stages, train minus its steps (the
rows query, micro-batching, step records), the engine's weight reload, checkpoints and other
(prompt choice, bookkeeping). Per run the medians over its rounds; the table shows every run and
the median of the runs' shares (the machine is shared: runs differ by ~1 point).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

from _report import command, machine, publish, toy_loop_options, use_threads  # noqa: E402

OUT = ROOT / "runs" / "bench"
SETTINGS = ["prompts.per_round=64", "run.steps_per_round=2", "eval.every=10", "run.checkpoint_every=1000"]
PARTS = ["generate", "score", "filter", "label", "pair", "train", "reload", "checkpoint", "eval", "other"]


def round_parts(run_dir: Path, skip: int = 2) -> list[dict[str, float]]:
    """Per round after the first `skip`: wall, model and overhead seconds, and each phase's
    overhead (generate, train and eval without their model work)."""
    from store.run_store import RunStore

    store = RunStore(run_dir)  # the stages' manifests, from the run's commit log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_seconds = {r["step"]: r["seconds"] for r in records if r.get("event") == "step"}
    out = []
    for r in records:
        if r.get("event") != "round" or r["round"] <= skip:
            continue
        phases = r["phase_seconds"]
        manifest = store.load_manifest("generate", r["round"])
        sampling = float(manifest.get("sample_seconds") or 0)
        steps = sum(step_seconds[s] for s in range(r["policy_version"] - r["steps"] + 1, r["policy_version"] + 1))
        greedy = r["model_seconds"] - sampling - steps
        parts = {**{p: phases.get(p, 0.0) for p in PARTS},
                 "generate": phases["generate"] - sampling, "train": phases["train"] - steps,
                 "eval": phases["eval"] - greedy}
        wall = sum(phases.values())  # = wall_seconds, to 0.1 ms (the record rounds wall_seconds to 10 ms)
        out.append({"wall": wall, "model": r["model_seconds"], "overhead": wall - r["model_seconds"], **parts})
    return out


def one_run(spec, run_dir: Path) -> dict[str, float]:
    from pipelines.loop.run import run_pipeline

    shutil.rmtree(run_dir, ignore_errors=True)
    run_pipeline(spec, run_dir, log=lambda message: None)
    rounds = round_parts(run_dir)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    medians["share"] = statistics.median(r["overhead"] / r["wall"] for r in rounds)
    medians["rounds"] = len(rounds)
    return medians


def markdown(runs: list[dict[str, float]], settings: str, command: str) -> str:
    header = ["run", "round ms", "model ms", "overhead ms", "overhead share", *[f"{p} ms" for p in PARTS]]
    lines = [f"## round overhead: the loop at 512 samples a round — {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"- machine: {machine()}", f"- command: `{command}`", f"- {settings}",
             "- every number is the median over a run's rounds (rounds 1-2 left out); generate, train and eval "
             "are shown without their model work (sampling, optimizer steps, greedy calls)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" + "--:|" * (len(header) - 1)]
    for k, run in enumerate(runs, 1):
        cells = [str(k), *(f"{1000 * run[key]:.1f}" for key in ("wall", "model", "overhead")),
                 f"{100 * run['share']:.1f}%", *(f"{1000 * run[p]:.1f}" for p in PARTS)]
        lines.append("| " + " | ".join(cells) + " |")
    shares = [run["share"] for run in runs]
    lines += ["", f"- overhead share: median {100 * statistics.median(shares):.1f}% of the round over {len(runs)} "
                  f"runs (min {100 * min(shares):.1f}%, max {100 * max(shares):.1f}%)", ""]
    return "\n".join(lines)


def long_run(spec, run_dir: Path, rounds: int, command_line: str, settings: str) -> str:
    """One run of `rounds` rounds: the overhead of rounds 6-15 against the last 10 (medians),
    so a cost that grows with the number of rounds shows."""
    from pipelines.loop.run import run_pipeline

    shutil.rmtree(run_dir, ignore_errors=True)
    run_pipeline(spec, run_dir, log=lambda message: None)
    parts = round_parts(run_dir, skip=0)
    windows = {"rounds 6-15": parts[5:15], f"rounds {rounds - 9}-{rounds}": parts[-10:]}
    header = ["rounds", "round ms", "model ms", "overhead ms", *[f"{p} ms" for p in PARTS]]
    lines = [f"## round overhead: early vs late rounds of one {rounds}-round run — {time.strftime('%Y-%m-%d %H:%M')}",
             "", f"- machine: {machine()}", f"- command: `{command_line}`", f"- {settings}",
             "- medians over the rounds of each window (rounds that evaluate included: eval every 10)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" + "--:|" * (len(header) - 1)]
    for name, window in windows.items():
        med = {key: statistics.median(r[key] for r in window) for key in window[0]}
        lines.append("| " + " | ".join([name, *(f"{1000 * med[key]:.1f}" for key in ("wall", "model", "overhead")),
                                         *(f"{1000 * med[p]:.1f}" for p in PARTS)]) + " |")
    return "\n".join(lines + [""])


def main() -> None:
    from _gf_run import loop_spec

    import pipelines.toy.build as toy_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the loop (default 3)")
    parser.add_argument("--rounds", type=int, default=28, help="rounds per run (default 28)")
    parser.add_argument("--long", type=int, default=0, help="instead: one run of this many rounds, early vs late")
    toy_loop_options(parser, "torch / OMP threads (default 1, as bench/loop.py runs groupforge; 0: torch's default)")
    args = parser.parse_args()
    use_threads(args.threads)
    toy = toy_module.build_toy(ROOT / "runs" / "toy", progress=False)
    if args.long:
        spec = loop_spec(args.spec, toy, "round-overhead-long", 0, SETTINGS + args.gf_set, rounds=args.long)
        settings = (f"default toy, {Path(args.spec).name} with {', '.join(SETTINGS + args.gf_set)}; torch threads: "
                    f"{args.threads or 'all cores'}")
        section = long_run(spec, OUT / "round-overhead-long", args.long, command("round_overhead.py"), settings)
        publish(section, "round_overhead_long", OUT, args.append)
        return
    spec = loop_spec(args.spec, toy, "round-overhead", 0, SETTINGS + args.gf_set, rounds=args.rounds)
    runs = []
    for k in range(args.runs):
        runs.append(one_run(spec, OUT / "round-overhead"))
        print(f"run {k + 1}: overhead {100 * runs[-1]['share']:.1f}% of {1000 * runs[-1]['wall']:.0f} ms a round",
              flush=True)
    settings = (f"default toy, {Path(args.spec).name} with {', '.join(SETTINGS + args.gf_set)}, {args.rounds} "
                f"rounds a run; torch threads: {args.threads or 'all cores'}")
    publish(markdown(runs, settings, command("round_overhead.py")), "round_overhead", OUT, args.append)


if __name__ == "__main__":
    main()
