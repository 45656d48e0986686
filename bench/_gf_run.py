"""One `groupforge run` (pipelines.loop.run.run_pipeline) on a toy for bench/loop.py.

The spec is a shipped one (pipelines/specs/toy-grpo.toml unless told) with the toy's paths,
the run name and seed, and any `--gf-set section.key=value` overrides applied, validated as a
PipelineSpec like a file would be. Clock: it starts when round 0 (engine start-up and the
start model's eval) has been recorded; each later round adds its wall seconds minus its eval
(RoundRecord.phase_seconds["eval"] when the loop records it, else the seconds inside the
engine's `greedy` calls) and minus engine start-up should it happen in a later round. So the
clock counts prompt choice, generation, curation, training, checkpoints, weight reloads and
bookkeeping: everything of a round but its eval, like TRL's clock; the CPU clock is the same in
process CPU seconds (eval: the CPU inside `greedy`). The run stops after the
first round past `minutes`, or at the spec's last round.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from _curves import Curve  # bench/ is on sys.path when a bench runs as a script

from pipelines.spec import PipelineSpec, apply_overrides, parse_overrides, read_toml, validate_model


class _BudgetSpent(Exception):
    """Raised from the round callback to end the run at the time budget."""


def loop_spec(spec_path: str | Path, toy: str | Path, name: str, seed: int, overrides: list[str],
              rounds: int | None = None) -> PipelineSpec:
    """The spec of one bench run: `spec_path` on the toy at `toy`, named `name`, seeded `seed`."""
    data = read_toml(spec_path)
    toy = Path(toy).resolve()
    changes = {"run": {"name": name, "seed": seed}, "model": {"path": str(toy / "model")},
               "prompts": {"train": [str(toy / "train.parquet")], "eval": str(toy / "eval.parquet")}}
    if rounds is not None:
        changes["run"]["rounds"] = rounds
    data = apply_overrides(apply_overrides(data, changes), parse_overrides(overrides))
    return validate_model(PipelineSpec, data, spec_path)


@contextmanager
def greedy_seconds() -> Iterator[list[float]]:
    """[wall, CPU] seconds spent inside every generator's `greedy` (eval decoding) while the block runs."""
    from curation.generate.hf import HFGenerator
    from curation.generate.vllm import VLLMGenerator

    spent = [0.0, 0.0]
    originals = {cls: cls.greedy for cls in (VLLMGenerator, HFGenerator)}

    def timed(original):
        def greedy(self, *args, **kwargs):
            tic, cpu = time.perf_counter(), time.process_time()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - tic
                spent[1] += time.process_time() - cpu
        return greedy

    for cls, original in originals.items():
        cls.greedy = timed(original)
    try:
        yield spent
    finally:
        for cls, original in originals.items():
            cls.greedy = original


def run_groupforge(job: dict) -> dict:
    """Run the round loop on job["toy"] for job["minutes"] training minutes; the run's Curve as a dict."""
    from pipelines.loop.run import run_pipeline

    started = time.perf_counter()
    run_dir = Path(job["out_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: resuming would skip the rounds to time
    spec = loop_spec(job["spec"], job["toy"], run_dir.name, job["seed"], job.get("set", []), job.get("rounds"))
    curve = Curve("groupforge", job["variant"], job["seed"],
                  extra={"spec": str(job["spec"]), "set": job.get("set", []), "rounds": []})
    budget = job["minutes"] * 60.0
    clock = {"seconds": 0.0, "greedy": 0.0, "last": 0.0, "cpu": 0.0, "greedy_cpu": 0.0, "last_cpu": 0.0}

    with greedy_seconds() as greedy:
        def on_round(record: dict) -> None:
            now = time.perf_counter()
            phases = record.get("phase_seconds") or {}
            eval_seconds = phases["eval"] if "eval" in phases else greedy[0] - clock["greedy"]
            cpu_now, eval_cpu = time.process_time(), greedy[1] - clock["greedy_cpu"]
            clock["greedy"], clock["greedy_cpu"] = greedy[0], greedy[1]
            if record["round"] == 0:
                curve.extra["startup_seconds"] = round(now - started, 2)
                curve.add(0.0, 0, record["eval_accuracy"], 0.0, os.getloadavg()[0])
            else:
                clock["seconds"] += (now - clock["last"]) - eval_seconds - phases.get("startup", 0.0)
                clock["cpu"] += (cpu_now - clock["last_cpu"]) - eval_cpu
                curve.extra["rounds"].append(record)
                if record.get("eval_accuracy") is not None:
                    curve.add(clock["seconds"], record["samples_total"], record["eval_accuracy"], clock["cpu"],
                              os.getloadavg()[0])
                    print(f"groupforge {job['variant']} seed {job['seed']}: round {record['round']} "
                          f"{clock['seconds']:.0f}s {record['samples_total']} samples "
                          f"accuracy {record['eval_accuracy']:.3f}", flush=True)
            curve.extra["eval_clock"] = "phase_seconds" if "eval" in phases else "greedy calls"
            clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()
            if clock["seconds"] >= budget:
                raise _BudgetSpent

        try:
            run_pipeline(spec, run_dir, log=lambda message: None, on_round=on_round)
        except _BudgetSpent:
            pass
    curve.extra["wall_seconds"] = round(time.perf_counter() - started, 2)
    return curve.to_dict()
