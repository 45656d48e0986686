"""Benchmark: groupforge's round loop vs TRL's GRPOTrainer on a real chat model, SmolLM2-135M-Instruct,
on chat-format arithmetic tasks neither was tuned on.

    make bench-trl-real                             # installs trl==1.16.0 (the `bench` extra), runs --quick
    .venv/bin/python bench/real_loop.py             # the full comparison, ~2 h 20 min on 2 cores
    .venv/bin/python bench/real_loop.py --quick     # a smoke run of every phase, ~20 min: not a result
    .venv/bin/python bench/real_loop.py --reuse-trl # groupforge again, against the saved TRL runs
    .venv/bin/python bench/real_loop.py --reuse     # the report again from the saved runs
    .venv/bin/python bench/real_loop.py --append    # also append the section to BENCHMARKS.md

The protocol is bench/loop.py's, with tasks in place of toy families. Leave-one-task-out,
pre-registered: settings are chosen on the selection tasks (--selection, default addition,
subtraction) and reported on the test tasks (--test, default multiply, max); no task is in
both. The tasks are `groupforge model tasks` (pipelines/models/chat_tasks.py): one user turn,
a number as the reference, 512 train prompts; both sides are evaluated greedily on the same
--eval-prompts (64) held-out prompts, with groupforge's `math` reward as the metric.

1. Selection, seed --seeds[0], --selection-minutes (6) of training a run: TRL at each --trl-lrs
   lr and groupforge at each --gf-candidates recipe (a constant lr after warmup, 1e-5 or 3e-5:
   the same lrs as TRL's). Each side keeps the setting with the highest plateau averaged over
   the selection tasks (bench/_families.py choose).
2. Test, every test task and seed: TRL at its lr against groupforge with its recipe, --minutes
   (8) of training each, one run at a time. Per (task, seed): each side's plateau, TRL's best
   and each side's seconds to it, and the checks (groupforge's plateau >= TRL's; its time to
   TRL's best <= 1/2 of TRL's).

Both sides start from runs/models/SmolLM2-135M-Instruct (`make real-model`) in fp32 and sample
the same round (--spec, pipelines/specs/smollm2-grpo.toml: per_round prompts x G, max_tokens,
temperature 1), train it in the spec's steps of batch_size samples, and evaluate once a round:

    TRL         bench/_trl_run.py: GRPOTrainer, generation batch = per_round x G, optimizer steps of
                batch_size completions in micro-batches of --trl-micro (gradient accumulation, for
                the activation memory), constant lr, bf16 and gradient checkpointing off, its
                default loss_type, transformers generate (TRL's vLLM modes need CUDA)
    groupforge  bench/_gf_run.py: run_pipeline on --spec with the candidate's overrides (vLLM on CPU,
                the trainer sized from the model), an eval every round

Clocks as bench/loop.py's: training wall seconds, start-up and evals excluded for both. Every
run is its own process using both cores (torch's default threads). Output: curves under
runs/bench/real_loop/<task>/, the choice in runs/bench/real_loop/selection.json, the report
in runs/bench/real_loop.md and a figure per test task (runs/bench/real_loop-<task>.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before bench/: bench/curation.py is not the package
sys.path.append(str(Path(__file__).resolve().parent))
from _curves import best, mean  # noqa: E402
from _families import (  # noqa: E402
    check_split,
    choose,
    name_list,
    parse_candidates,
    result_tables,
    selection_table,
    verdict,
)
from _report import comparison_options, fill_defaults, machine, plot_variant, write_section  # noqa: E402
from loop import ROOT, need_trl, run_jobs, sampling  # noqa: E402

from pipelines.models.chat_tasks import TASKS, write_task  # noqa: E402

OUT = ROOT / "runs" / "bench"
RUNS = OUT / "real_loop"
MODEL = ROOT / "runs" / "models" / "SmolLM2-135M-Instruct"
SPEC = ROOT / "pipelines" / "specs" / "smollm2-grpo.toml"
CANDIDATES = ('lr1e-5=run.rounds=1000;train.lr_schedule="constant";train.lr=1e-5,'
              'lr3e-5=run.rounds=1000;train.lr_schedule="constant";train.lr=3e-5')
"""groupforge's recipes: the spec with a constant lr after warmup for the whole budget (TRL's
schedule), at the lrs TRL chooses among."""
QUICK = {"selection": "addition", "test": "multiply", "seeds": "0", "minutes": 3.0, "selection_minutes": 2.0,
         "trl_lrs": "1e-5", "gf_candidates": CANDIDATES.split(",")[0]}
"""--quick's values for the options not given: every phase once, on one task each, in ~20 minutes."""
DEFAULTS = {"selection": "addition,subtraction", "test": "multiply,max", "seeds": "0,1", "minutes": 8.0,
            "selection_minutes": 6.0, "trl_lrs": "1e-5,3e-5", "gf_candidates": CANDIDATES}


def prepare_task(task: str, eval_prompts: int) -> Path:
    """The task's folder as the runs read it: `model` (a link to the imported model), train.parquet
    and the first `eval_prompts` rows of its eval.parquet (both sides evaluate on the same rows);
    the task's files are written by chat_tasks on first use."""
    source = ROOT / "runs" / "chat" / task
    if not (source / "train.parquet").is_file():
        write_task(task, source)
    folder = RUNS / task / "data"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "model").exists():
        (folder / "model").symlink_to(MODEL)
    pq.write_table(pq.read_table(source / "train.parquet"), folder / "train.parquet")
    pq.write_table(pq.read_table(source / "eval.parquet").slice(0, eval_prompts), folder / "eval.parquet")
    return folder


def round_shape(spec: Path) -> dict:
    """The spec's round: prompts per round, samples per optimizer step, steps per round."""
    from pipelines.spec import read_toml

    data = read_toml(spec)
    return {"per_round": data["prompts"]["per_round"], "batch_size": data["train"]["batch_size"],
            "steps": data["run"]["steps_per_round"]}


def trl_job(args, task: str, data: Path, seed: int, lr: float, minutes: float) -> dict:
    """TRL's run: a generation batch of per_round x G, the spec's steps, an eval per round's steps."""
    shape = round_shape(args.spec)
    name = f"trl-lr{lr:g}-{minutes:g}min-seed{seed}"
    return dict(toy=str(data), variant=task, seed=seed, lr=lr, minutes=minutes, threads=0, eval_every=shape["steps"],
                prompts_per_generation=shape["per_round"], batch_size=shape["batch_size"],
                micro_batch=args.trl_micro, column="messages", metric="math", **sampling(args.spec),
                out_dir=str(RUNS / task / f"{name}-out"), result=str(RUNS / task / f"{name}.json"))


def gf_job(args, task: str, data: Path, seed: int, candidate, minutes: float) -> dict:
    name = f"gf-{candidate.name}-{minutes:g}min-seed{seed}"
    return dict(toy=str(data), variant=task, seed=seed, minutes=minutes, spec=str(args.spec), threads=0,
                set=["eval.every=1", f"prompts.eval_limit={args.eval_prompts}", *candidate.overrides],
                candidate=candidate.name, out_dir=str(RUNS / task / name), result=str(RUNS / task / f"{name}.json"))


def select(args, data: dict[str, Path]) -> dict:
    """Selection on the selection tasks (seed --seeds[0]): each side's runs per setting, its choice, scores."""
    seed, minutes = args.seeds[0], args.selection_minutes
    jobs = [("trl", trl_job(args, t, data[t], seed, lr, minutes)) for lr in args.trl_lrs for t in args.selection]
    jobs += [("groupforge", gf_job(args, t, data[t], seed, c, minutes)) for c in args.gf_candidates
             for t in args.selection]
    curves = iter(run_jobs(jobs, args.reuse, 1))
    trl = {f"{lr:g}": [next(curves) for _ in args.selection] for lr in args.trl_lrs}
    gf = {c.name: [next(curves) for _ in args.selection] for c in args.gf_candidates}
    lr, trl_scores = choose(trl, args.plateau_evals, args.smooth)
    recipe, gf_scores = choose(gf, args.plateau_evals, args.smooth)
    chosen = {"trl": trl, "gf": gf, "lr": float(lr), "trl_scores": trl_scores,
              "candidate": next(c for c in args.gf_candidates if c.name == recipe), "gf_scores": gf_scores}
    path = RUNS / "selection.json"
    path.write_text(json.dumps({
        "selection_tasks": args.selection, "test_tasks": args.test, "seed": seed, "minutes": minutes,
        "trl": {"lr": chosen["lr"], "mean_plateau": trl_scores},
        "groupforge": {"candidate": recipe, "overrides": list(chosen["candidate"].overrides),
                       "mean_plateau": gf_scores}}, indent=1))
    print(f"selection: TRL lr {lr}, groupforge {recipe} (written to {os.path.relpath(path, ROOT)})", flush=True)
    return chosen


def markdown(args, chosen: dict, verdicts: list[dict], figures: list[Path]) -> str:
    """The section: protocol, the test tasks' result, then the selection tasks' evidence."""
    shape = round_shape(args.spec)
    recipes = {c.name: f"{c.name}: `{'; '.join(c.overrides)}`" for c in args.gf_candidates}
    lines = [f"## real_loop: groupforge vs TRL GRPOTrainer on SmolLM2-135M-Instruct, held-out tasks — "
             f"{datetime.now():%Y-%m-%d %H:%M}", "",
             f"- machine: {machine()}; both cores per run, one run at a time",
             f"- command: `{shlex.join(['.venv/bin/python', 'bench/real_loop.py', *args.argv])}`",
             f"- pre-registered: settings chosen on {', '.join(args.selection)} (seed {args.seeds[0]}, "
             f"{args.selection_minutes:g} min a run); tested on {', '.join(args.test)}, seeds "
             f"{', '.join(map(str, args.seeds))}, {args.minutes:g} min of training a run and side",
             f"- the round, both sides: {shape['per_round']} prompts x G {sampling(args.spec)['group_size']}, "
             f"{shape['steps']} optimizer steps of {shape['batch_size']}, fp32, reward and metric `math`, "
             f"greedy eval on {args.eval_prompts} held-out prompts every round",
             f"- TRL: GRPOTrainer, lr {chosen['lr']:g} (chosen), constant, micro-batches of {args.trl_micro}, "
             "bf16 and gradient checkpointing off, default loss_type, transformers generate",
             f"- groupforge: `{os.path.relpath(args.spec, ROOT)}`, recipe {recipes[chosen['candidate'].name]} "
             "(chosen), vLLM on CPU",
             "- clock: training wall seconds, start-up and evals excluded for both; plateau: mean of the last "
             f"{args.plateau_evals} evals; TRL's best and the times to it on a trailing mean of {args.smooth} evals",
             *(["- --quick: a smoke run of every phase; its figures are not results"] if args.quick else []),
             "", f"### Test tasks ({', '.join(args.test)}): the result", "", *result_tables(verdicts), "",
             *(f"- figure: `{os.path.relpath(f, ROOT)}`" for f in figures), "",
             f"### Selection tasks ({', '.join(args.selection)}): where the settings were chosen, not a result", "",
             *selection_table("TRL lr", chosen["trl"], f"{chosen['lr']:g}", chosen["trl_scores"],
                              args.plateau_evals, {}), "",
             *selection_table("groupforge recipe", chosen["gf"], chosen["candidate"].name, chosen["gf_scores"],
                              args.plateau_evals, recipes)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, --quick's values filled in for those not given, the tasks checked (one-line error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.add_argument("--selection", help=f"tasks the settings are chosen on (default {DEFAULTS['selection']})")
    parser.add_argument("--test", help=f"held-out tasks the result is on (default {DEFAULTS['test']})")
    parser.add_argument("--seeds", help="seeds of the test runs; the first seeds the selection runs (default 0,1)")
    parser.add_argument("--minutes", type=float, help="training minutes per test run and side (default 8)")
    parser.add_argument("--selection-minutes", type=float, help="training minutes per selection run (default 6)")
    parser.add_argument("--trl-lrs", help=f"TRL lrs to choose among (default {DEFAULTS['trl_lrs']})")
    parser.add_argument("--gf-candidates", metavar="NAME=KEY=VALUE[;KEY=VALUE],...",
                        help=f"groupforge recipes to choose among (default {DEFAULTS['gf_candidates']})")
    parser.add_argument("--spec", default=str(SPEC), help="groupforge's spec; its round and sampling are TRL's too")
    parser.add_argument("--trl-micro", type=int, default=8, help="TRL completions per forward/backward")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts both sides evaluate on")
    comparison_options(parser, plateau_evals=3)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    try:
        args.selection = name_list(args.selection, "--selection", list(TASKS), "task")
        args.test = name_list(args.test, "--test", list(TASKS), "task")
        check_split(args.selection, args.test, "task")
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.trl_lrs = [float(x) for x in args.trl_lrs.split(",") if x.strip()]
        args.gf_candidates = parse_candidates(args.gf_candidates)
    except ValueError as error:
        parser.error(str(error).splitlines()[0])
    if not (args.seeds and args.trl_lrs):
        parser.error("--seeds and --trl-lrs each need a value")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.reuse != "all":
        need_trl()
        if not (MODEL / "config.json").is_file():
            raise SystemExit(f"no model at {os.path.relpath(MODEL, ROOT)}: run `make real-model` first")
    n_sel = len(args.selection) * (len(args.trl_lrs) + len(args.gf_candidates))
    n_test = len(args.test) * len(args.seeds) * 2
    print(f"planned: {n_sel} selection runs x {args.selection_minutes:g} min, {n_test} test runs x "
          f"{args.minutes:g} min, one at a time, + start-ups and evals", flush=True)
    data = {t: prepare_task(t, args.eval_prompts) for t in [*args.selection, *args.test]}
    chosen = select(args, data)
    jobs = []
    for task in args.test:
        for seed in args.seeds:
            jobs += [("trl", trl_job(args, task, data[task], seed, chosen["lr"], args.minutes)),
                     ("groupforge", gf_job(args, task, data[task], seed, chosen["candidate"], args.minutes))]
    curves = run_jobs(jobs, args.reuse, 1)
    pairs = list(zip(curves[::2], curves[1::2]))  # (TRL, groupforge) per test task and seed
    verdicts = [verdict(trl, gf, args.plateau_evals, args.smooth) for trl, gf in pairs]
    figures = []
    for task in args.test:
        mine = [c for pair in pairs for c in pair if c.variant == task]
        target = mean([best(c, args.smooth) for c in mine if c.framework == "trl"])
        figures.append(plot_variant(mine, target, OUT / f"real_loop-{task}.png"))
    section = markdown(args, chosen, verdicts, figures)
    print("\n" + section)
    print(f"written to {write_section(section, 'real_loop', OUT, args.append)}")


if __name__ == "__main__":
    main()
