"""Benchmark: groupforge's round loop vs TRL's GRPOTrainer, time to accuracy on the same work, one run.

    make bench-trl                               # installs trl==1.16.0 (the `bench` extra) and runs this
    .venv/bin/python bench/loop.py               # 3 toy variants x 2 seeds x 2 frameworks + TRL lr sweep, ~75 min
    .venv/bin/python bench/loop.py --quick       # 1 variant, 1 seed, 2 min per framework, lr 1e-4: a smoke run
    .venv/bin/python bench/loop.py --append      # also append the section to BENCHMARKS.md

Both frameworks start from the same toy model folder and train on its train.parquet with the
same reward (exact match of response.strip() with the reference, groupforge's `exact_match`),
G = 8, temperature 1, max 8 response tokens, and are evaluated greedily on the same
eval.parquet. Each run is its own process, one after the other:

    TRL         bench/_trl_run.py: GRPOTrainer, 64 prompts x 8 per generation batch, 4 steps of 128
                (--trl-prompts, --trl-batch), constant lr, bf16/gradient checkpointing off,
                TRL's transformers generate (use_vllm=False); eval every --trl-eval-every steps
    groupforge  bench/_gf_run.py: run_pipeline on --spec (pipelines/specs/toy-grpo.toml) with the
                toy's paths, eval every round (2048 samples, as TRL's) and --gf-set overrides, as
                shipped otherwise

Clocks: training wall seconds and process CPU seconds, start-up (model load, engine start,
round 0 / step 0 eval) and every eval excluded for both (see the two helpers), and samples
generated. TRL's lr is
swept first (--trl-lrs, --sweep-minutes, on the first variant and seed) and the best (highest
plateau) is used for its real runs. Summaries (bench/_curves.py): time to each
--levels accuracy and to TRL's best accuracy within its budget, on a trailing mean of
--smooth evals; the plateau, the mean of the last --plateau-evals evals; samples/s.

Every run gets OMP_NUM_THREADS=--threads (1 by default: on a 2-core machine shared with other
jobs, two threads per process ran the toy's tiny ops 5-10x slower, and unsteadily), and
--jobs runs go at a time (2). Budget of the default run: sweep 3 x 1.5 min, TRL 3 x 2 x 10
min, groupforge up to 3 x 2 x 10 min of training seconds (its spec's 60 rounds end after
2.5-4.5 min on the toys), ~75 min of wall with start-ups and evals on 2 cores. Output: the markdown
section (printed, runs/bench/loop.md), runs/bench/loop-<variant>.png, each run's curve as
JSON under runs/bench/loop/<variant>/ (--reuse summarises those without running again).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))  # imported as a module (tests): its helpers still import

from _curves import Curve, best, first_reaching, mean, plateau, samples_per_s, time_to  # noqa: E402
from _report import machine, plot_variant, write_section  # noqa: E402

OUT = ROOT / "runs" / "bench"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1"}


# ---- toys and runs ------------------------------------------------------------------------------

def toy_variants(names: list[str] | None) -> dict[str, Path]:
    """The toy folder of each variant (built once, cached by the toy's own build cache)."""
    import pipelines.toy.build as toy

    known = getattr(toy, "VARIANTS", {"default": toy.ToyConfig()})
    names = names or list(known)[:3]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown toy variant(s) {', '.join(unknown)}: one of {', '.join(known)}")
    folders = {}
    for name in names:
        out = toy.default_out(known[name], ROOT / "runs") if hasattr(toy, "default_out") else \
            ROOT / "runs" / ("toy" if name == "default" else f"toy-{name}")
        print(f"toy {name}: {out}", flush=True)
        folders[name] = toy.build_toy(out, config=known[name], progress=False)
    return folders


def run_job(kind: str, job: dict, reuse: str | None) -> Curve:
    """One run in its own process (its memory, threads and engine are its own); its curve. `reuse`
    "all" (or the run's kind) takes a finished run's JSON instead of running again."""
    result = Path(job["result"])
    if not (reuse in ("all", kind) and result.is_file()):
        result.parent.mkdir(parents=True, exist_ok=True)
        limit = job["minutes"] * 60 * 4 + 600  # evals and start-up come on top of the training budget
        threads = {"OMP_NUM_THREADS": str(job["threads"])} if job.get("threads") else {}
        subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(job)], check=True, timeout=limit,
                       cwd=ROOT, env={**ENV, **os.environ, **threads})
    curve = Curve.from_dict(json.loads(result.read_text()))
    if job.get("arm"):
        curve.framework = f"groupforge+{job['arm']}"
    return curve


def worker(kind: str, job: dict) -> None:
    warnings.filterwarnings("ignore", message=".*TRL currently supports vLLM.*")
    if kind == "trl":
        from _trl_run import run_trl as run
    else:
        from _gf_run import run_groupforge as run
    Path(job["result"]).write_text(json.dumps(run(job)))


def trl_job(args, variant: str, toy: Path, seed: int, lr: float, minutes: float, name: str) -> dict:
    folder = OUT / "loop" / variant
    return dict(toy=str(toy), variant=variant, seed=seed, lr=lr, minutes=minutes, eval_every=args.trl_eval_every,
                threads=args.threads,
                prompts_per_generation=args.trl_prompts, group_size=8, batch_size=args.trl_batch, max_tokens=8,
                temperature=1.0, out_dir=str(folder / f"{name}-out"), result=str(folder / f"{name}.json"))


def gf_job(args, variant: str, toy: Path, seed: int, arm: tuple[str, list[str]] | None = None) -> dict:
    """groupforge evaluates every round here (`eval.every = 1` before --gf-set, which may change it): an
    eval every 2048 samples like TRL's every 16 x 128, and evals are off both clocks. An `arm` (name,
    overrides) is the same run with more overrides, on top of --gf-set."""
    from pipelines.spec import EvalSection

    folder = OUT / "loop" / variant
    every = ["eval.every=1"] if "every" in EvalSection.model_fields else []
    name, extra = arm or ("", [])
    tag = f"-{name}" if name else ""
    return dict(toy=str(toy), variant=variant, seed=seed, minutes=args.gf_minutes, spec=str(args.spec),
                threads=args.threads, set=every + args.gf_set + extra, rounds=args.gf_rounds, arm=name,
                out_dir=str(folder / f"gf{tag}-seed{seed}"), result=str(folder / f"groupforge{tag}-seed{seed}.json"))


def parse_arm(text: str) -> tuple[str, list[str]]:
    """"passes1:train.passes=1;eval.every=2" -> ("passes1", ["train.passes=1", "eval.every=2"])."""
    name, sep, sets = text.partition(":")
    if not sep or not name.replace("-", "").replace("_", "").isalnum() or not sets.strip():
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME:section.key=value[;section.key=value]")
    return name, [item.strip() for item in sets.split(";") if item.strip()]


def run_jobs(jobs: list[tuple[str, dict]], reuse: str | None, at_once: int) -> list[Curve]:
    """Each (kind, job) in its own process, `at_once` of them running at a time; curves in job order."""
    if at_once <= 1:
        return [run_job(kind, job, reuse) for kind, job in jobs]
    with ThreadPoolExecutor(at_once) as pool:  # threads only wait on the child processes
        return list(pool.map(lambda item: run_job(*item, reuse), jobs))


def sweep_lr(args, variant: str, toy: Path) -> tuple[float, list[Curve]]:
    """TRL's best lr on the first variant and seed: the highest plateau (mean of the last evals, so an
    lr that climbs and then collapses within the run loses) of a short run, then the best smoothed accuracy."""
    jobs = [("trl", trl_job(args, variant, toy, args.seeds[0], lr, args.sweep_minutes, f"trl-sweep-lr{lr:g}"))
            for lr in args.trl_lrs]
    curves = run_jobs(jobs, args.reuse, args.jobs)
    chosen = max(curves, key=lambda c: (plateau(c, args.plateau_evals), best(c, args.smooth)))
    return float(chosen.extra["lr"]), curves


# ---- summary ------------------------------------------------------------------------------------

def summarize(curves: list[Curve], levels: list[float], window: int, last: int) -> list[dict]:
    """One row per curve: times to each level and to TRL's best (same variant and seed), best, plateau, samples/s."""
    trl_best = {(c.variant, c.seed): best(c, window) for c in curves if c.framework == "trl"}
    rows = []
    for c in curves:
        target = trl_best.get((c.variant, c.seed))
        i = first_reaching(c, target, window) if target is not None else None
        rows.append({"variant": c.variant, "framework": c.framework, "seed": c.seed, "start": c.accuracy[0],
                     "levels": {level: (time_to(c, level, window) or (None, None))[0] for level in levels},
                     "target": target, "target_seconds": None if i is None else c.seconds[i],
                     "target_cpu": None if i is None or not c.cpu_seconds else c.cpu_seconds[i],
                     "target_samples": None if i is None else c.samples[i], "best": best(c, window),
                     "plateau": plateau(c, last), "samples_per_s": samples_per_s(c), "evals": len(c.accuracy),
                     "seconds": c.seconds[-1], "samples": c.samples[-1], "load": mean(c.load)})
    return rows


def _s(value: float | None, digits: int = 0) -> str:
    return "never" if value is None else f"{value:,.{digits}f}"


def verdicts(rows: list[dict]) -> list[str]:
    """Per variant: groupforge vs TRL at TRL's best, plateaus, samples/s (means over seeds)."""
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        by = {fw: [r for r in rows if r["variant"] == variant and r["framework"] == fw] for fw in ("groupforge", "trl")}
        if not by["groupforge"] or not by["trl"]:
            continue
        pairs = [(g, t) for g in by["groupforge"] for t in by["trl"] if g["seed"] == t["seed"]]
        ratios, cpu = ([None if g[key] is None or not t[key] else g[key] / t[key] for g, t in pairs]
                       for key in ("target_seconds", "target_cpu"))
        meets = all(r is not None and r <= 1 / 3 for r in ratios)
        gf_plateau, trl_plateau = (mean([r["plateau"] for r in by[fw]]) for fw in ("groupforge", "trl"))
        speed = mean([r["samples_per_s"] for r in by["groupforge"]]) / mean([r["samples_per_s"] for r in by["trl"]])
        listed = [", ".join("never" if r is None else f"{r:.2f}" for r in values) for values in (ratios, cpu)]
        lines.append(
            f"- **{variant}**: time to TRL's best (groupforge / TRL, per seed): {listed[0]} "
            f"({'meets' if meets else 'BELOW'} the <= 0.33 target; in CPU seconds {listed[1]}); plateau "
            f"groupforge {gf_plateau:.3f} vs TRL {trl_plateau:.3f} "
            f"({'higher' if gf_plateau > trl_plateau else 'NOT higher'}); samples/s "
            f"groupforge / TRL = {speed:.2f}x ({'meets' if speed >= 1 else 'BELOW'} >= 1)")
    return lines


def arm_table(rows: list[dict]) -> list[str]:
    """The --arm runs against the plain groupforge run of the same variant and seed: time to TRL's best
    (and its ratio to TRL's time), plateau, samples/s; empty without arms."""
    arms = [r for r in rows if r["framework"].startswith("groupforge+")]
    if not arms:
        return []
    by_key = {(r["variant"], r["framework"], r["seed"]): r for r in rows}
    lines = ["", "Options on/off (each arm is the plain groupforge run plus its overrides, same variant and seed):",
             "", "| variant | seed | run | s to TRL best | / TRL's time | / plain run's | plateau | plateau - plain "
             "| samples/s |", "|---|--:|---|--:|--:|--:|--:|--:|--:|"]
    for r in sorted([r for r in rows if r["framework"].startswith("groupforge")],
                    key=lambda r: (r["variant"], r["seed"], r["framework"] != "groupforge", r["framework"])):
        trl, plain = (by_key.get((r["variant"], fw, r["seed"])) for fw in ("trl", "groupforge"))
        t = r["target_seconds"]
        to_trl, to_plain = ("-" if t is None or not other or not other["target_seconds"]
                            else f"{t / other['target_seconds']:.2f}" for other in (trl, plain))
        delta = "-" if not plain else f"{r['plateau'] - plain['plateau']:+.3f}"
        name = "plain" if r is plain else r["framework"].replace("groupforge+", "+")
        lines.append(f"| {r['variant']} | {r['seed']} | {name} | {_s(t)} | {to_trl} | {to_plain} | "
                     f"{r['plateau']:.3f} | {delta} | {r['samples_per_s']:.0f} |")
    return lines


def breakdown(curves: list[Curve]) -> list[str]:
    """groupforge's round time by phase (RoundRecord.phase_seconds, when the loop records it)."""
    lines = []
    for variant in dict.fromkeys(c.variant for c in curves):
        rounds = [r for c in curves if c.variant == variant and c.framework == "groupforge"
                  for r in c.extra.get("rounds", [])]
        if not rounds or not rounds[0].get("phase_seconds"):
            continue
        wall = sum(r["wall_seconds"] for r in rounds)
        phases: dict[str, float] = {}
        for r in rounds:
            for name, seconds in r["phase_seconds"].items():
                phases[name] = phases.get(name, 0.0) + seconds
        model = sum(r.get("model_seconds", 0.0) for r in rounds)
        parts = ", ".join(f"{name} {seconds / len(rounds):.2f}" for name, seconds in phases.items())
        lines.append(f"- groupforge round, {variant} (mean of {len(rounds)} rounds, {wall / len(rounds):.2f} s): "
                     f"{parts} s; model work (engine calls + optimizer steps) {model / wall:.0%} of the wall, "
                     f"the rest {1 - model / wall:.0%}")
    return lines


def markdown(rows: list[dict], curves: list[Curve], sweep: list[Curve], lr: float, args, figures: list[Path]) -> str:
    levels = args.levels
    lines = [f"## loop: groupforge vs TRL GRPOTrainer, time to accuracy — {datetime.now():%Y-%m-%d %H:%M}", "",
             f"- machine: {machine()}; torch threads per run: {getattr(args, 'threads', 0) or 'all cores'}; "
             f"runs at a time: {getattr(args, 'jobs', 1)}",
             f"- command: `{shlex.join(['.venv/bin/python', 'bench/loop.py', *sys.argv[1:]])}`",
             f"- TRL: GRPOTrainer, {args.trl_prompts} prompts x 8 per generation batch, steps of {args.trl_batch}, "
             f"lr {lr:g} constant, beta 0, num_iterations 1, bf16 and gradient checkpointing off, transformers "
             f"generate (use_vllm=False), {args.trl_minutes:g} min of training seconds per run",
             f"- groupforge: `groupforge run {os.path.relpath(args.spec, ROOT)}` with eval every round"
             f"{', ' + ', '.join(args.gf_set) if args.gf_set else ''}, up to {args.gf_minutes:g} min of training "
             "seconds per run",
             "- clock: training wall seconds; start-up (model load, engine start, the start model's eval) and every "
             "greedy eval excluded for both; CPU s: the same in process CPU seconds (all threads); samples = "
             "responses generated; load: the mean 1-minute load average at the run's evals (other jobs included)",
             f"- accuracy: greedy exact match on the toy's eval.parquet; times are read off a trailing mean of "
             f"{args.smooth} evals; plateau = mean of the last {args.plateau_evals} evals", ""]
    if sweep:
        lines += [f"TRL lr sweep ({sweep[0].variant}, seed {sweep[0].seed}, {args.sweep_minutes:g} min each):", "",
                  "| lr | best | plateau | samples/s |", "|--:|--:|--:|--:|"]
        lines += [f"| {c.extra['lr']:g}{' (chosen)' if c.extra['lr'] == lr else ''} | {best(c, args.smooth):.3f} | "
                  f"{plateau(c, args.plateau_evals):.3f} | {samples_per_s(c):.0f} |" for c in sweep]
        lines.append("")
    head = " | ".join(f"s to {level:.0%}" for level in levels)
    lines += [f"| variant | framework | seed | start | {head} | s to TRL best | CPU s to TRL best | samples to TRL "
              "best | TRL best | best | plateau | samples/s | evals | train s | load |",
              "|---|---|--:|--:|" + "--:|" * len(levels) + "--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        times = " | ".join(_s(r["levels"][level]) for level in levels)
        lines.append(f"| {r['variant']} | {r['framework']} | {r['seed']} | {r['start']:.3f} | {times} | "
                     f"{_s(r['target_seconds'])} | {_s(r['target_cpu'])} | {_s(r['target_samples'])} | "
                     f"{'-' if r['target'] is None else format(r['target'], '.3f')} | {r['best']:.3f} | "
                     f"{r['plateau']:.3f} | {r['samples_per_s']:.0f} | {r['evals']} | {r['seconds']:.0f} | "
                     f"{_s(r['load'], 1)} |")
    lines += ["", *verdicts(rows), *breakdown(curves)]
    arms = arm_table(rows)
    if arms:
        lines += [*arms, "", *(f"- arm {name}: `{'; '.join(sets)}`" for name, sets in args.arm)]
    lines += [f"- figure: `{f.relative_to(ROOT)}`" for f in figures]
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------

def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="1 variant, 1 seed, 2 min per framework, no sweep")
    parser.add_argument("--variants", help="toy variants, comma-separated (default: the first 3 of pipelines.toy.build."
                                           "VARIANTS; quick: default)")
    parser.add_argument("--seeds", help="run seeds, comma-separated (default 0,1; quick 0)")
    parser.add_argument("--trl-minutes", type=float, help="TRL training minutes per run (default 10, quick 2)")
    parser.add_argument("--gf-minutes", type=float,
                        help="groupforge training minutes per run, at most (default 10, quick 2; the spec's last "
                             "round usually comes first)")
    parser.add_argument("--trl-lrs", type=floats, default=[3e-5, 1e-4, 3e-4], help="TRL lrs to sweep")
    parser.add_argument("--trl-lr", type=float, help="use this TRL lr, no sweep (quick: 1e-4)")
    parser.add_argument("--sweep-minutes", type=float, default=1.5, help="training minutes per sweep run")
    parser.add_argument("--trl-prompts", type=int, default=64, help="TRL prompts per generation batch (x 8)")
    parser.add_argument("--trl-batch", type=int, default=128, help="TRL completions per optimizer step")
    parser.add_argument("--trl-eval-every", type=int, default=16,
                        help="TRL optimizer steps between evals (16 x 128 = 2048 samples, a toy-grpo round)")
    parser.add_argument("--spec", default=str(ROOT / "pipelines" / "specs" / "toy-grpo.toml"), help="groupforge spec")
    parser.add_argument("--gf-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a spec key (TOML value), repeatable")
    parser.add_argument("--gf-rounds", type=int, help="groupforge rounds (default: the spec's, cut by --gf-minutes)")
    parser.add_argument("--only", choices=["trl", "groupforge"], help="run one framework only")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every run, both frameworks (0: torch's default, all cores); on the "
                             "shared 2-core machine 2 threads ran the toy 5-10x slower and unsteadily")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at a time (each its own process with --threads threads): 2 on 2 cores halves the "
                             "bench's wall time; both frameworks then share the machine alike")
    parser.add_argument("--levels", type=floats, default=[0.5, 0.6, 0.7], help="accuracy levels to time")
    parser.add_argument("--smooth", type=int, default=3, help="trailing mean over this many evals")
    parser.add_argument("--plateau-evals", type=int, default=5, help="the plateau is the mean of the last N evals")
    parser.add_argument("--arm", action="append", type=parse_arm, default=[], metavar="NAME:KEY=VALUE[;KEY=VALUE]",
                        help="also run groupforge with these overrides (an option on/off), repeatable; reported "
                             "against the plain run")
    parser.add_argument("--reuse", nargs="?", const="all", choices=["all", "trl", "groupforge"],
                        help="reuse finished runs' JSON under runs/bench/loop/ (all, or one framework's)")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], json.loads(args.worker[1]))

    args.seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    args.trl_minutes = args.trl_minutes or (2.0 if args.quick else 10.0)
    args.gf_minutes = args.gf_minutes or (2.0 if args.quick else 10.0)
    if args.quick and args.trl_lr is None:
        args.trl_lr = 1e-4
    frameworks = [args.only] if args.only else ["trl", "groupforge"]
    if "trl" in frameworks and importlib.util.find_spec("trl") is None:
        raise SystemExit("trl is not installed: run `make bench-trl` (pip install -e '.[bench]')")
    toys = toy_variants(args.variants.split(",") if args.variants else (["default"] if args.quick else None))
    sweep_min = 0 if args.trl_lr is not None or "trl" not in frameworks else len(args.trl_lrs) * args.sweep_minutes
    planned = sweep_min + len(toys) * len(args.seeds) * sum(
        {"trl": args.trl_minutes, "groupforge": args.gf_minutes}[fw] for fw in frameworks)
    print(f"planned: {planned:.0f} min of training seconds (+ start-ups and evals, ~20% more wall)", flush=True)

    lr, sweep = args.trl_lr, []
    if lr is None and "trl" in frameworks:
        lr, sweep = sweep_lr(args, *next(iter(toys.items())))
        print(f"TRL lr: {lr:g} (best of {', '.join(f'{x:g}' for x in args.trl_lrs)})", flush=True)
    jobs = []
    for variant, toy in toys.items():
        for seed in args.seeds:
            if "trl" in frameworks:
                jobs.append(("trl", trl_job(args, variant, toy, seed, lr, args.trl_minutes, f"trl-seed{seed}")))
            if "groupforge" in frameworks:
                jobs.append(("groupforge", gf_job(args, variant, toy, seed)))
                jobs += [("groupforge", gf_job(args, variant, toy, seed, arm)) for arm in args.arm]
    curves = run_jobs(jobs, args.reuse, args.jobs)
    figures = []
    for variant in toys:
        mine = [c for c in curves if c.variant == variant]
        target = mean([best(c, args.smooth) for c in mine if c.framework == "trl"])
        figures.append(plot_variant(mine, target, OUT / f"loop-{variant}.png"))
    rows = summarize(curves, args.levels, args.smooth, args.plateau_evals)
    section = markdown(rows, curves, sweep, lr or 0.0, args, figures)
    print("\n" + section)
    print(f"written to {write_section(section, 'loop', OUT, args.append)}")


if __name__ == "__main__":
    main()
