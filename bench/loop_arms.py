"""Benchmark: which loss variants and loop options help groupforge on the held-out toy families.

    .venv/bin/python bench/loop_arms.py               # every arm on reverse, sort, max at 512 prompts, ~70 min
    .venv/bin/python bench/loop_arms.py --arms base,curriculum --sizes 512,4096
    .venv/bin/python bench/loop_arms.py --reuse --append

Each arm is the recipe bench/loop.py chose on the selection families (runs/bench/loop/selection.json,
written by `bench/loop.py`; its overrides on pipelines/specs/toy-family-grpo.toml) plus the arm's own
overrides, run on the held-out families only, so no arm is chosen or reported on the families the
recipe was chosen on. `base` (no extra overrides) is rerun in the same sitting: an arm is compared
with it, not with an earlier run. Every run is timed alone, one torch thread, --minutes of training,
an eval every round (bench/_gf_run.py; start-up and evals off the clock). The reading is each arm's
plateau (the mean of its last 5 evals) minus base's, per cell, and TRL's plateau at its chosen lr from
bench/loop.py's saved runs of the same cell and seed, where they exist.

The arms (docs/objectives.md has each formula):

    base        the chosen recipe: grpo advantages (group std), seq-mean-token-mean, eps 0.2
    dr_grpo     Dr. GRPO: no std division (scale_rewards = none), a constant length normaliser
                (agg = seq-mean-token-sum-norm)
    dapo        DAPO: token-level mean over the step (agg = token-mean), clip-higher (eps_high 0.28);
                dynamic sampling (dropping all-equal groups) is on in every arm
    cispo       CISPO: a clipped, detached IS weight on a REINFORCE term (objective = cispo)
    batch       scale_rewards = batch: r - mean over the std of the round's kept groups
    curriculum  the pass-rate curriculum (prompts.curriculum = true)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import loop  # noqa: E402
from _curves import Curve, plateau  # noqa: E402
from _families import Candidate, cell_name, family_list  # noqa: E402
from _report import machine, write_section  # noqa: E402

ARMS = {
    "base": (),
    "dr_grpo": ('label.scale_rewards="none"', 'train.agg="seq-mean-token-sum-norm"'),
    "dapo": ('train.agg="token-mean"', "train.eps_high=0.28"),
    "cispo": ('train.objective="cispo"',),
    "batch": ('label.scale_rewards="batch"',),
    "curriculum": ("prompts.curriculum=true",),
}


def read_selection() -> dict:
    """What bench/loop.py chose on the selection families; an exit that says how to get it."""
    path = loop.LOOP / "selection.json"
    if not path.is_file():
        raise SystemExit(f"{os.path.relpath(path, ROOT)} is missing: run `bench/loop.py` first (its selection "
                         "phase chooses the recipe the arms start from)")
    return json.loads(path.read_text())


def saved_trl(lr: float, family: str, size: int, seed: int, minutes: float) -> Curve | None:
    """bench/loop.py's TRL run of this cell and seed at `lr`, if saved."""
    path = loop.LOOP / cell_name(family, size) / f"trl-lr{lr:g}-{minutes:g}min-seed{seed}.json"
    return Curve.from_dict(json.loads(path.read_text())) if path.is_file() else None


def markdown(args, recipe: Candidate, trl_lr: float, runs: dict[tuple[str, str], Curve]) -> str:
    cells = [cell_name(f, s) for f in args.families for s in args.sizes]
    header = "| arm | overrides | " + " | ".join(cells) + " | mean change |"
    lines = [f"## loop arms: loss variants and options on the held-out families — {datetime.now():%Y-%m-%d %H:%M}",
             "", f"- machine: {machine()}; torch threads per run: {args.threads}",
             f"- command: `{' '.join(['.venv/bin/python', 'bench/loop_arms.py', *args.argv])}`",
             f"- every arm: `pipelines/specs/toy-family-grpo.toml` + the recipe chosen on the selection families "
             f"({recipe.name}: `{'; '.join(recipe.overrides)}`) + the arm's overrides; seed {args.seed}, "
             f"{args.minutes:g} min of training a run, one run at a time, an eval every round",
             f"- cells: each arm's plateau (mean of the last {args.plateau_evals} evals) and its change from `base` "
             "in this sitting; TRL: bench/loop.py's saved run of the cell and seed at its chosen lr", "",
             header, "|" + "---|" * 2 + "--:|" * (len(cells) + 1)]
    for arm in args.arms:
        values, changes = [], []
        for cell in cells:
            mine = plateau(runs[arm, cell], args.plateau_evals)
            base = plateau(runs["base", cell], args.plateau_evals)
            changes.append(mine - base)
            values.append(f"{mine:.3f}" if arm == "base" else f"{mine:.3f} ({mine - base:+.3f})")
        mean_change = "" if arm == "base" else f"{sum(changes) / len(changes):+.3f}"
        lines.append(f"| {arm} | `{'; '.join(ARMS[arm]) or '-'}` | " + " | ".join(values) + f" | {mean_change} |")
    trl = [saved_trl(trl_lr, f, s, args.seed, args.minutes) for f in args.families for s in args.sizes]
    lines.append("| TRL (saved) | chosen lr | " + " | ".join(
        f"{plateau(c, args.plateau_evals):.3f}" if c else "-" for c in trl) + " | |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"arms to run, comma-separated (of {', '.join(ARMS)})")
    parser.add_argument("--families", default="reverse,sort,max", help="held-out families (default reverse,sort,max)")
    parser.add_argument("--sizes", default="512", help="train prompts per toy, comma-separated (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=3.0, help="training minutes a run (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    parser.add_argument("--plateau-evals", type=int, default=5)
    parser.add_argument("--reuse", action="store_const", const="all", help="summarise the saved runs, run nothing")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm(s) {', '.join(unknown)}: of {', '.join(ARMS)}")
    if "base" not in args.arms:
        args.arms.insert(0, "base")  # every arm is read against base of the same sitting
    try:
        args.families = family_list(args.families, "--families")
    except ValueError as error:
        parser.error(str(error))
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    selection = read_selection()
    recipe = Candidate(selection["groupforge"]["candidate"], tuple(selection["groupforge"]["overrides"]))
    toys = loop.build_toys(args.families, args.sizes, build=args.reuse != "all")
    spec = argparse.Namespace(spec=str(loop.SPEC), threads=args.threads)  # what loop.gf_job reads of its options
    jobs, keys = [], []
    for arm in args.arms:
        candidate = Candidate(f"arm-{arm}", (*recipe.overrides, *ARMS[arm]))
        for family in args.families:
            for size in args.sizes:
                jobs.append(("groupforge", loop.gf_job(spec, (family, size), toys[family, size], args.seed,
                                                       candidate, args.minutes)))
                keys.append((arm, cell_name(family, size)))
    print(f"planned: {len(jobs)} runs x {args.minutes:g} min, one at a time", flush=True)
    runs = dict(zip(keys, loop.run_jobs(jobs, args.reuse, 1)))
    section = markdown(args, recipe, selection["trl"]["lr"], runs)
    print("\n" + section)
    print(f"written to {os.path.relpath(write_section(section, 'loop-arms', loop.OUT, args.append), ROOT)}")


if __name__ == "__main__":
    main()
