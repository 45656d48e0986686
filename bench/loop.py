"""Benchmark: groupforge's round loop vs TRL's GRPOTrainer on toy families neither was tuned on.

    make bench-trl                                  # installs trl==1.16.0 (the `bench` extra), runs this
    .venv/bin/python bench/loop.py                  # the full comparison, ~2 h on 2 cores (below)
    .venv/bin/python bench/loop.py --quick          # a smoke run of every phase, ~12 min: not a result
    .venv/bin/python bench/loop.py --reuse-trl      # groupforge again, against the saved TRL runs
    .venv/bin/python bench/loop.py --reuse          # the report again from the saved runs
    .venv/bin/python bench/loop.py --append         # also append the section to BENCHMARKS.md

Leave-one-family-out, pre-registered: the selection families (--selection, default addition,
multiply) and the test families (--test, default reverse, sort, max) are fixed before any
result, and no family is in both. Cells are (family, train size): the test families at --sizes
(512, 4096), the selection families at --selection-sizes (512); each cell's toy is
`groupforge toy build --task FAMILY --n-train SIZE` (bench/_families.py toy_config: one warm
start per family whatever the size).

1. Selection, on the selection families only, seed --seeds[0], --selection-minutes (3) of
   training per run: TRL at each --trl-lrs lr, and groupforge with each --gf-candidates recipe
   (bench/_families.py DEFAULT_CANDIDATES says what each is for). Each side keeps the setting
   with the highest plateau averaged over the selection cells; the choice and its evidence go
   to runs/bench/loop/selection.json and the report.
2. Test, on the test families only, every size and seed: TRL at its chosen lr against groupforge
   with its chosen recipe, --minutes of training each, one run at a time (--jobs 1), TRL then
   groupforge per cell. Per (family, size, seed): each side's plateau over the same training
   minutes, TRL's best and each side's seconds to it, their ratio, and the two checks the issue
   asks for as PASS/FAIL (groupforge's plateau >= TRL's; its time to TRL's best <= 1/2 of TRL's).
   The report's result is these test cells; the selection cells are the evidence of the choice,
   in their own tables, never the headline.

Both sides start from the cell's toy model, train on its train.parquet with groupforge's
`exact_match` reward, sample G and max tokens as --spec (pipelines/specs/toy-family-grpo.toml)
says at temperature 1, and are evaluated greedily on its eval.parquet every 2,048 samples:

    TRL         bench/_trl_run.py: GRPOTrainer, 64 prompts x 8 per generation batch, 4 steps of 128
                (--trl-prompts, --trl-batch), constant lr, bf16 and gradient checkpointing off, its
                default loss_type, transformers generate (use_vllm=False)
    groupforge  bench/_gf_run.py: run_pipeline on --spec with the candidate's overrides, an eval
                every round (256 prompts x 8), the run cut at --minutes or at its last round

Clocks (bench/_gf_run.py, bench/_trl_run.py): training wall seconds, start-up and every eval
excluded for both. Plateau: the mean of the last --plateau-evals (5) evals; TRL's best and the
times to it are read off a trailing mean of --smooth (3) evals (bench/_curves.py). Every run
is its own process with OMP_NUM_THREADS=--threads (1: on the shared 2-core machine two threads
ran the toy's tiny ops 5-10x slower and unsteadily).

Budget of the default run on 2 cores, about two hours (a 3-minute run takes ~3 min 40 s of wall
with its start-up and evals): the 8 toys build once, 20-60 s each; selection: (2 lrs + 2
recipes) x 2 families x 1 size x 3 min = 24 min of training, ~30 min of wall; test: 3 families
x 2 sizes x 2 seeds x 2 sides x 3 min = 72 min of training, ~1 h 30 min of wall. The selection
runs as long as a test run: on the selection families the lr that leads after one minute is
not the one that leads after three. To fit, it runs only the small train size (the regime
where a recipe is most likely to fail). Every run is timed alone (--jobs 1, --selection-jobs
1): two at a time leave an odd last run alone, and faster, which favours it in the selection.

Output: each run's curve as JSON under runs/bench/loop/<family>-<size>/ (so --reuse-trl can
take TRL's), the choice in runs/bench/loop/selection.json, the report printed and written to
runs/bench/loop.md, and a figure per test cell (runs/bench/loop-<family>-<size>.png).
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

from _curves import Curve, best, mean, plateau  # noqa: E402
from _families import (  # noqa: E402
    DEFAULT_CANDIDATES,
    Candidate,
    cell_name,
    check_sizes,
    check_split,
    choose,
    family_list,
    parse_candidates,
    result_tables,
    selection_table,
    toy_config,
    verdict,
)
from _report import comparison_options, fill_defaults, machine, plot_variant, write_section  # noqa: E402

OUT = ROOT / "runs" / "bench"
LOOP = OUT / "loop"
SPEC = ROOT / "pipelines" / "specs" / "toy-family-grpo.toml"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1"}
QUICK = {"selection": "addition", "test": "reverse", "sizes": "512", "selection_sizes": "512", "seeds": "0",
         "minutes": 1.5, "selection_minutes": 1.0, "trl_lrs": "1e-4,3e-4"}
"""--quick's values for the options not given: every phase once, on 2 toys, in ~12 minutes."""
DEFAULTS = {"selection": "addition,multiply", "test": "reverse,sort,max", "sizes": "512,4096",
            "selection_sizes": "512", "seeds": "0,1", "minutes": 3.0, "selection_minutes": 3.0,
            "trl_lrs": "3e-5,1e-4"}


# ---- toys and runs ------------------------------------------------------------------------------

def build_toys(families: list[str], sizes: list[int], build: bool = True) -> dict[tuple[str, int], Path]:
    """The toy folder of each (family, size) cell, built on first use (the toy's own build cache) unless
    `build` is off (the saved runs are summarised: only the paths are needed)."""
    import pipelines.toy.build as toy

    folders = {}
    for family in families:
        for size in sizes:
            config = toy_config(family, size)
            out = toy.default_out(config, ROOT / "runs")
            print(f"toy {cell_name(family, size)}: {out}", flush=True)
            folders[family, size] = toy.build_toy(out, config=config, progress=False) if build else out
    return folders


def run_job(kind: str, job: dict, reuse: str | None) -> Curve:
    """One run in its own process (its memory, threads and engine are its own); its curve. `reuse`
    "all" (or "trl" for a TRL run) takes the run's saved JSON instead, which must exist."""
    result = Path(job["result"])
    if reuse in ("all", kind):
        if not result.is_file():
            raise SystemExit(f"--reuse: no saved run {result.relative_to(ROOT)}: run it without --reuse first")
    else:
        result.parent.mkdir(parents=True, exist_ok=True)
        limit = job["minutes"] * 60 * 4 + 600  # evals and start-up come on top of the training budget
        threads = {"OMP_NUM_THREADS": str(job["threads"])} if job.get("threads") else {}
        subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(job)], check=True, timeout=limit,
                       cwd=ROOT, env={**ENV, **os.environ, **threads})
    curve = Curve.from_dict(json.loads(result.read_text()))
    if kind == "groupforge":
        if curve.extra.get("set") != job["set"]:
            raise SystemExit(f"{result.relative_to(ROOT)} ran other overrides than candidate {job['candidate']}'s: "
                             "run without --reuse")
        curve.extra["candidate"] = job["candidate"]
    return curve


def worker(kind: str, job: dict) -> None:
    """One run; vLLM's, transformers' and torch's own output goes to <result>.log, not the bench's console."""
    from curation.library_logs import log_libraries_to

    log_libraries_to(Path(job["result"]).with_suffix(".log"), f"bench/loop.py --worker {kind}")
    warnings.filterwarnings("ignore", message=".*TRL currently supports vLLM.*")
    if kind == "trl":
        from _trl_run import run_trl as run
    else:
        from _gf_run import run_groupforge as run
    Path(job["result"]).write_text(json.dumps(run(job)))


def run_jobs(jobs: list[tuple[str, dict]], reuse: str | None, at_once: int) -> list[Curve]:
    """Each (kind, job) in its own process, `at_once` of them running at a time; curves in job order."""
    if at_once <= 1:
        return [run_job(kind, job, reuse) for kind, job in jobs]
    with ThreadPoolExecutor(at_once) as pool:  # threads only wait on the child processes
        return list(pool.map(lambda item: run_job(*item, reuse), jobs))


def sampling(spec: str | Path) -> dict:
    """G, max tokens and temperature as the spec samples them: TRL samples the same."""
    from pipelines.spec import read_toml

    generator = read_toml(spec)["generator"]
    return {"group_size": generator["group_size"], "max_tokens": generator["max_tokens"],
            "temperature": generator.get("temperature", 1.0)}


def trl_job(args, cell: tuple[str, int], toy: Path, seed: int, lr: float, minutes: float) -> dict:
    name = f"trl-lr{lr:g}-{minutes:g}min-seed{seed}"
    folder = LOOP / cell_name(*cell)
    return dict(toy=str(toy), variant=cell_name(*cell), seed=seed, lr=lr, minutes=minutes, threads=args.threads,
                eval_every=args.trl_eval_every, prompts_per_generation=args.trl_prompts,
                batch_size=args.trl_batch, **sampling(args.spec), out_dir=str(folder / f"{name}-out"),
                result=str(folder / f"{name}.json"))


def gf_job(args, cell: tuple[str, int], toy: Path, seed: int, candidate: Candidate, minutes: float) -> dict:
    """An eval every round (`eval.every = 1`, before the candidate's overrides, which may change it): every
    2,048 samples like TRL's every 16 steps of 128; evals are off both clocks."""
    name = f"gf-{candidate.name}-{minutes:g}min-seed{seed}"
    folder = LOOP / cell_name(*cell)
    return dict(toy=str(toy), variant=cell_name(*cell), seed=seed, minutes=minutes, spec=str(args.spec),
                threads=args.threads, set=["eval.every=1", *candidate.overrides], candidate=candidate.name,
                out_dir=str(folder / name), result=str(folder / f"{name}.json"))


# ---- the two phases -----------------------------------------------------------------------------

def select(args, toys: dict) -> dict:
    """Selection on the selection cells (seed --seeds[0]): each side's runs per setting, its choice, scores."""
    cells = [(f, s) for f in args.selection for s in args.selection_sizes]
    seed, minutes = args.seeds[0], args.selection_minutes
    jobs = [("trl", trl_job(args, cell, toys[cell], seed, lr, minutes)) for lr in args.trl_lrs for cell in cells]
    jobs += [("groupforge", gf_job(args, cell, toys[cell], seed, c, minutes)) for c in args.gf_candidates
             for cell in cells]
    curves = iter(run_jobs(jobs, args.reuse, args.selection_jobs))
    trl = {f"{lr:g}": [next(curves) for _ in cells] for lr in args.trl_lrs}
    gf = {c.name: [next(curves) for _ in cells] for c in args.gf_candidates}
    lr, trl_scores = choose(trl, args.plateau_evals, args.smooth)
    recipe, gf_scores = choose(gf, args.plateau_evals, args.smooth)
    return {"trl": trl, "gf": gf, "lr": float(lr), "trl_scores": trl_scores,
            "candidate": next(c for c in args.gf_candidates if c.name == recipe), "gf_scores": gf_scores}


def held_out_jobs(args, toys: dict, lr: float, candidate: Candidate) -> list[tuple[str, dict]]:
    """The test runs: every test cell and seed, TRL at `lr` then groupforge with `candidate`, nothing else."""
    jobs = []
    for family in args.test:
        for size in args.sizes:
            for seed in args.seeds:
                cell = (family, size)
                jobs += [("trl", trl_job(args, cell, toys[cell], seed, lr, args.minutes)),
                         ("groupforge", gf_job(args, cell, toys[cell], seed, candidate, args.minutes))]
    return jobs


def write_selection(chosen: dict, args) -> Path:
    """The chosen settings and the evidence they were chosen on, as JSON."""
    def plateaus(runs: dict[str, list[Curve]]) -> dict[str, dict[str, float]]:
        return {name: {c.variant: plateau(c, args.plateau_evals) for c in curves} for name, curves in runs.items()}

    path = LOOP / "selection.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "selection_families": args.selection, "test_families": args.test, "selection_sizes": args.selection_sizes,
        "sizes": args.sizes,
        "seed": args.seeds[0], "minutes": args.selection_minutes, "plateau_evals": args.plateau_evals,
        "trl": {"lr": chosen["lr"], "mean_plateau": chosen["trl_scores"], "plateau": plateaus(chosen["trl"])},
        "groupforge": {"candidate": chosen["candidate"].name, "overrides": list(chosen["candidate"].overrides),
                       "mean_plateau": chosen["gf_scores"], "plateau": plateaus(chosen["gf"]),
                       "candidates": {c.name: list(c.overrides) for c in args.gf_candidates}},
    }, indent=1))
    return path


# ---- report -------------------------------------------------------------------------------------

def breakdown(curves: list[Curve]) -> list[str]:
    """groupforge's round time by phase per cell (RoundRecord.phase_seconds), over its runs' rounds."""
    lines = []
    for cell in dict.fromkeys(c.variant for c in curves):
        rounds = [r for c in curves if c.variant == cell and c.framework == "groupforge"
                  for r in c.extra.get("rounds", []) if r.get("phase_seconds")]
        if not rounds:
            continue
        wall = sum(r["wall_seconds"] for r in rounds)
        phases: dict[str, float] = {}
        for r in rounds:
            for name, seconds in r["phase_seconds"].items():
                phases[name] = phases.get(name, 0.0) + seconds
        parts = ", ".join(f"{name} {seconds / len(rounds):.2f}" for name, seconds in phases.items())
        lines.append(f"- groupforge round, {cell} (mean of {len(rounds)} rounds, {wall / len(rounds):.2f} s): "
                     f"{parts} s")
    return lines


def markdown(args, chosen: dict, verdicts: list[dict], figures: list[Path], rounds: list[str]) -> str:
    """The section: protocol, the test families' result, then the selection families' evidence."""
    spec = os.path.relpath(args.spec, ROOT)
    recipes = {c.name: f"{c.name}: `{'; '.join(c.overrides) or 'as shipped'}`" for c in args.gf_candidates}
    lines = [f"## loop: groupforge vs TRL GRPOTrainer on held-out toy families — {datetime.now():%Y-%m-%d %H:%M}",
             "", f"- machine: {machine()}; torch threads per run: {args.threads or 'all cores'}",
             f"- command: `{shlex.join(['.venv/bin/python', 'bench/loop.py', *args.argv])}`",
             f"- pre-registered: settings chosen on {', '.join(args.selection)} at train sizes "
             f"{', '.join(map(str, args.selection_sizes))} (seed {args.seeds[0]}, "
             f"{args.selection_minutes:g} min a run); tested on {', '.join(args.test)} at train sizes "
             f"{', '.join(map(str, args.sizes))}, seeds {', '.join(map(str, args.seeds))}, {args.minutes:g} min of "
             f"training a run and side, {args.jobs} run(s) at a time",
             f"- TRL: GRPOTrainer, lr {chosen['lr']:g} (chosen), constant, {args.trl_prompts} prompts x G per "
             f"generation batch, steps of {args.trl_batch}, bf16 and gradient checkpointing off, default loss_type",
             f"- groupforge: `{spec}`, recipe {recipes[chosen['candidate'].name]} (chosen), eval every round",
             "- clock: training wall seconds, start-up and evals excluded for both; plateau: mean of the last "
             f"{args.plateau_evals} evals; TRL's best and the times to it on a trailing mean of {args.smooth} evals",
             *(["- --quick: a smoke run of every phase; its figures are not results"] if args.quick else []),
             "", f"### Test families ({', '.join(args.test)}): the result", "",
             *result_tables(verdicts), "", *rounds, *(f"- figure: `{os.path.relpath(f, ROOT)}`" for f in figures), "",
             f"### Selection families ({', '.join(args.selection)}): where the settings were chosen, not a result", "",
             *selection_table("TRL lr", chosen["trl"], f"{chosen['lr']:g}", chosen["trl_scores"],
                              args.plateau_evals, {}), "",
             *selection_table("groupforge recipe", chosen["gf"], chosen["candidate"].name, chosen["gf_scores"],
                              args.plateau_evals, recipes)]
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, --quick's values filled in for those not given, the families checked (one-line error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.add_argument("--selection", help=f"families the settings are chosen on (default {DEFAULTS['selection']})")
    parser.add_argument("--test", help=f"held-out families the result is on (default {DEFAULTS['test']})")
    parser.add_argument("--sizes", help=f"train prompts per test toy, comma-separated (default {DEFAULTS['sizes']})")
    parser.add_argument("--selection-sizes",
                        help=f"train prompts per selection toy (default {DEFAULTS['selection_sizes']})")
    parser.add_argument("--seeds", help="seeds of the test runs; the first seeds the selection runs (default 0,1)")
    parser.add_argument("--minutes", type=float, help="training minutes per test run and side (default 3)")
    parser.add_argument("--selection-minutes", type=float, help="training minutes per selection run (default 3)")
    parser.add_argument("--trl-lrs", help=f"TRL lrs to choose among (default {DEFAULTS['trl_lrs']})")
    parser.add_argument("--gf-candidates", default=DEFAULT_CANDIDATES,
                        metavar="NAME=KEY=VALUE[;KEY=VALUE],...",
                        help="groupforge recipes to choose among, each --spec plus its overrides (default: "
                             f"{DEFAULT_CANDIDATES})")
    parser.add_argument("--spec", default=str(SPEC),
                        help="groupforge's spec; its G, max_tokens and temperature are TRL's too")
    parser.add_argument("--trl-prompts", type=int, default=64, help="TRL prompts per generation batch (x G)")
    parser.add_argument("--trl-batch", type=int, default=128, help="TRL completions per optimizer step")
    parser.add_argument("--trl-eval-every", type=int, default=16,
                        help="TRL optimizer steps between evals (16 x 128 = 2048 samples, a groupforge round)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run (0: all cores)")
    parser.add_argument("--jobs", type=int, default=1, help="test runs at a time (1: timed alone)")
    parser.add_argument("--selection-jobs", type=int, default=1,
                        help="selection runs at a time (more: runs share the machine unevenly, an odd last one "
                             "runs alone and faster)")
    comparison_options(parser, plateau_evals=5)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return args
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    try:
        args.selection = family_list(args.selection, "--selection")
        args.test = family_list(args.test, "--test")
        check_split(args.selection, args.test)
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        args.selection_sizes = [int(s) for s in args.selection_sizes.split(",") if s.strip()]
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.trl_lrs = [float(x) for x in args.trl_lrs.split(",") if x.strip()]
        args.gf_candidates = parse_candidates(args.gf_candidates)
        check_sizes(args.test, args.sizes)  # now, not after the selection phase
        check_sizes(args.selection, args.selection_sizes, "--selection-sizes")
    except ValueError as error:
        parser.error(str(error).splitlines()[0])
    if not (args.sizes and args.selection_sizes and args.seeds and args.trl_lrs):
        parser.error("--sizes, --selection-sizes, --seeds and --trl-lrs each need a value")
    return args


def need_trl() -> None:
    """TRL runs need the `bench` extra: a one-line exit without it."""
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("trl is not installed: run `make bench-trl` (pip install -e '.[bench]')")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker[0], json.loads(args.worker[1]))
    if args.reuse != "all":
        need_trl()
    n_sel = len(args.selection) * len(args.selection_sizes) * (len(args.trl_lrs) + len(args.gf_candidates))
    n_test = len(args.test) * len(args.sizes) * len(args.seeds) * 2
    print(f"planned: {n_sel} selection runs x {args.selection_minutes:g} min ({args.selection_jobs} at a time), "
          f"{n_test} test runs x {args.minutes:g} min ({args.jobs} at a time), + toy builds, start-ups and evals",
          flush=True)
    toys = {**build_toys(args.selection, args.selection_sizes, build=args.reuse != "all"),
            **build_toys(args.test, args.sizes, build=args.reuse != "all")}

    chosen = select(args, toys)
    print(f"selection: TRL lr {chosen['lr']:g}, groupforge recipe {chosen['candidate'].name} "
          f"(written to {os.path.relpath(write_selection(chosen, args), ROOT)})", flush=True)

    curves = run_jobs(held_out_jobs(args, toys, chosen["lr"], chosen["candidate"]), args.reuse, args.jobs)
    pairs = list(zip(curves[::2], curves[1::2]))  # (TRL, groupforge) per test cell and seed
    verdicts = [verdict(trl, gf, args.plateau_evals, args.smooth) for trl, gf in pairs]
    figures = []
    for cell in dict.fromkeys(trl.variant for trl, _ in pairs):
        mine = [c for pair in pairs for c in pair if c.variant == cell]
        target = mean([best(c, args.smooth) for c in mine if c.framework == "trl"])
        figures.append(plot_variant(mine, target, OUT / f"loop-{cell}.png"))
    section = markdown(args, chosen, verdicts, figures, breakdown(curves))
    print("\n" + section)
    print(f"written to {write_section(section, 'loop', OUT, args.append)}")


if __name__ == "__main__":
    main()
