"""A comparison study: a sweep per objective on a validation split, then each objective's best
setting over several seeds at equal samples (`groupforge compare FILE` with a [compare] that
has `seeds` and `sweep`; the compare file's models are pipelines/studies/compare_spec.py's CompareSection).

    OUT/data/train.parquet        the spec's train prompts without the validation split
    OUT/data/validation.parquet   `validation_size` train prompts, held out by a hash of the prompt
    OUT/data/split.json           what the split was made from (a rerun with other inputs is refused)
    OUT/sweep/<name>/<setting>/   a groupforge run per grid setting: `sweep_rounds` rounds, seed
                                  `sweep_seed`, trained on data/train.parquet, evaluated on
                                  data/validation.parquet every round
    OUT/study.json                every setting's validation score and each objective's choice
    OUT/final/<name>/seed-<s>/    the chosen setting, once per seed: trained on data/train.parquet,
                                  evaluated on the spec's own eval set
    OUT/report/                   compare.md, compare.png, measurements.png (pipelines/studies/study_report.py)

No run ever trains on a validation prompt, and no choice ever reads the eval set: the sweep's
score is the mean of a run's last `select_last` validation evals (rounds >= 1), the highest
wins, the first listed among ties. Every run is an ordinary resumable groupforge run: a
rerun skips finished runs and resumes the others; a run folder made from a different spec is
refused, not mixed in. `jobs` > 1 runs that many at a time in worker processes (each with
cpu_count / jobs torch threads); their wall seconds then include the contention.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from pipelines.reports.run_report import number
from pipelines.spec import PipelineSpec, load_spec, read_toml, resolved_toml
from pipelines.studies.compare_spec import CompareSection, budget_difference, check_comparable, compare_overrides
from store.run_files import SPEC_FILE, MetricsLog, read_json, write_json_atomic
from store.storage import write_atomic

DATA_DIR, SWEEP_DIR, FINAL_DIR, STUDY_FILE = "data", "sweep", "final", "study.json"
VALIDATION_SALT = "groupforge-validation:"
"""Salt of the split's hash, so the split is unrelated to other orders by prompt_id."""


# ---------------------------------------------------------------------------------------------
# The validation split
# ---------------------------------------------------------------------------------------------

def split_salt(seed: int | None) -> str:
    """The prefix hashed with each prompt_id: VALIDATION_SALT, plus "<seed>:" for a seeded split
    (`groupforge tune --seed`), so each seed holds out other prompts."""
    return VALIDATION_SALT if seed is None else f"{VALIDATION_SALT}{seed}:"


def validation_ids(prompt_ids: Iterable[str], size: int, exclude: Iterable[str] = (),
                   seed: int | None = None) -> set[str]:
    """The `size` prompt ids first by sha256(split_salt(seed) + id), leaving out `exclude` (the
    eval set's ids): deterministic, independent of file order, disjoint from the eval set.
    Refuses a size that would leave no train prompt."""
    salt = split_salt(seed)
    candidates = sorted(set(prompt_ids) - set(exclude), key=lambda i: hashlib.sha256((salt + i).encode()).hexdigest())
    if size >= len(candidates):
        raise ValueError(f"validation_size {size}: only {len(candidates)} train prompts (not in the eval set); "
                         "the split would leave none to train on")
    return set(candidates[:size])


@dataclass(frozen=True)
class Split:
    train: Path
    validation: Path
    record: dict


def split_prompts(train_files: list[str], eval_file: str, size: int, out_dir: Path, seed: int | None = None) -> Split:
    """Write out_dir/data/{train,validation}.parquet from the train prompt files (see
    validation_ids, with `seed`) and data/split.json; an existing split made from the same files,
    size and seed is kept, one made from others is refused (its runs trained on other prompts)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from curation.generate.base import first_of_each_prompt, load_prompts
    from store.fingerprints import fingerprint_file

    folder = out_dir / DATA_DIR
    split = Split(folder / "train.parquet", folder / "validation.parquet", {
        "rule": f"the validation_size prompt_ids first by sha256('{split_salt(seed)}' + prompt_id), eval set excluded",
        "validation_size": size, "train_files": {f: fingerprint_file(f) for f in train_files},
        "eval_file": {eval_file: fingerprint_file(eval_file)}, **({} if seed is None else {"seed": seed})})
    existing = read_json(folder / "split.json")
    if existing is not None:
        if {k: existing.get(k) for k in split.record} != split.record:
            raise ValueError(f"{folder}: a validation split made from other prompts or another validation_size or seed "
                             f"(see {folder / 'split.json'}); its runs trained on other prompts: use another out "
                             "folder or delete this one")
        if split.train.is_file() and split.validation.is_file():
            return Split(split.train, split.validation, existing)
    table = first_of_each_prompt(pa.concat_tables([load_prompts(f) for f in train_files], promote_options="default"))
    held = validation_ids(table.column("prompt_id").to_pylist(), size,
                          load_prompts(eval_file).column("prompt_id").to_pylist(), seed)
    is_held = pc.is_in(table.column("prompt_id"), value_set=pa.array(sorted(held), pa.string()))
    train, validation = table.filter(pc.invert(is_held)), table.filter(is_held)
    for path, part in ((split.train, train), (split.validation, validation)):
        write_atomic(path, lambda f, part=part: pq.write_table(part, f))
    record = {**split.record, "train_rows": train.num_rows, "validation_rows": validation.num_rows}
    write_json_atomic(folder / "split.json", record)
    return Split(split.train, split.validation, record)


# ---------------------------------------------------------------------------------------------
# Settings and runs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One point of an objective's grid: {"train.lr": 1e-4, ...} ({} = the spec's own)."""

    values: dict[str, Any]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={_toml_value(v)}" for k, v in self.values.items()) or "the spec's own"

    @property
    def slug(self) -> str:
        """A folder name: train.lr-0.0001_train.beta-0.1 ("spec" for the spec's own)."""
        text = "_".join(f"{k}-{_toml_value(v)}" for k, v in self.values.items()) or "spec"
        return re.sub(r"[^A-Za-z0-9._-]", "-", text)

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={_toml_value(v)}" for k, v in self.values.items()]


def _toml_value(value: Any) -> str:
    return json.dumps(value)  # a JSON number, string or bool is TOML too


def grid(sweep: dict[str, list]) -> list[Setting]:
    """Every combination of the sweep's values, in the order listed (the first key slowest)."""
    keys = list(sweep)
    return [Setting(dict(zip(keys, combo))) for combo in itertools.product(*(sweep[k] for k in keys))]


@dataclass(frozen=True)
class RunPlan:
    label: str
    spec: PipelineSpec
    run_dir: Path


def plan_spec(spec_file: str, section: CompareSection | None, split: Split | None, setting: Setting, *,
              rounds: int | None, seed: int, name: str, validation: bool) -> PipelineSpec:
    """`spec_file` with the compare file's overrides (none without `section`: `groupforge tune`),
    `setting`, the split's train file (and, for a sweep run, the validation file as its eval set,
    evaluated every round), `rounds` (None: the compare file's or the spec's), `seed` and
    run.name `name`."""
    overrides = [*compare_overrides(section), *setting.overrides, f"run.seed={seed}", f'run.name="{name}"']
    if rounds is not None:
        overrides.append(f"run.rounds={rounds}")
    if split is not None:
        overrides.append(f"prompts.train=[{json.dumps(str(split.train))}]")
    if validation:
        overrides += [f"prompts.eval={json.dumps(str(split.validation))}", "eval.every=1"]
    spec = load_spec(spec_file, overrides=overrides)
    if validation:  # every validation prompt: eval_limit belongs to the eval set
        spec = spec.model_copy(update={"prompts": spec.prompts.model_copy(update={"eval_limit": None})})
    return spec


def finished(plan: RunPlan) -> bool:
    """Whether the run folder has its last round. A folder whose RUN/spec.toml is another spec
    (the compare file, a spec or the split changed) is refused: its numbers are not this run's."""
    spec_file = plan.run_dir / SPEC_FILE
    if spec_file.is_file() and spec_file.read_text() != resolved_toml(plan.spec):
        raise ValueError(f"{plan.run_dir}: made from another spec than this study's {plan.label} (compare its "
                         f"{SPEC_FILE} with the compare file); use another out folder or delete the run")
    return any(r["round"] >= plan.spec.run.rounds for r in MetricsLog(plan.run_dir).rounds())


def execute(plans: list[RunPlan], jobs: int = 1, wait: bool = True, log: Callable[[str], None] = print) -> None:
    """Run the plans not yet finished (resuming the started ones): in this process one after the
    other, or `jobs` at a time in worker processes (each run's log next to its folder: <RUN>.log)."""
    todo = []
    for plan in plans:
        if finished(plan):
            log(f"{plan.label}: finished, skipped ({plan.run_dir})")
        else:
            todo.append(plan)
    if jobs <= 1 or not todo:
        if todo:
            warm_imports()
        for plan in todo:
            tic = time.perf_counter()
            log(f"{plan.label}: {plan.spec.train.objective}, {plan.spec.run.rounds} rounds -> {plan.run_dir}")
            run_plan(plan.spec, plan.run_dir, wait, log=lambda msg, p=plan: log(f"  {p.label}: {msg}"))
            log(f"{plan.label}: done in {time.perf_counter() - tic:.0f} s")
        return
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                             initargs=(threads,)) as pool:
        started = {pool.submit(run_plan, p.spec, p.run_dir, wait, _log_file(p)): (p, time.time()) for p in todo}
        log(f"{len(todo)} runs, {jobs} at a time, {threads} torch thread(s) each")
        for future in as_completed(started):
            plan, tic = started[future]
            future.result()  # a failed run stops the study (its log says why)
            log(f"{plan.label}: done, {time.time() - tic:.0f} s after it was queued "
                f"(log: {_log_file(plan)})")


def _log_file(plan: RunPlan) -> Path:
    return plan.run_dir.parent / f"{plan.run_dir.name}.log"


def _worker_start(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    warm_imports()


WARM_MODULES = ("torch", "transformers", "pipelines.loop.run", "training.trainer", "training.checkpoint",
                "curation.generate.hf")


def warm_imports() -> None:
    """Import what a run would otherwise import inside its round 0 (torch, transformers, the
    trainer), so no run's wall seconds pay for it: each run pays its own engine start only."""
    import importlib

    for module in WARM_MODULES:
        importlib.import_module(module)


def run_plan(spec: PipelineSpec, run_dir: Path, wait: bool, log_file: Path | None = None,
             log: Callable[[str], None] = print) -> None:
    """One run to its last round (resuming); with `log_file` (a worker process), its lines go there
    and the libraries' output to RUN/logs/run.log."""
    from pipelines.loop.run import run_pipeline

    def on_round(record: dict) -> None:
        accuracy = number(record, "eval_accuracy")
        log(f"round {record['round']}: eval {'-' if accuracy is None else f'{100 * accuracy:.1f}%'}  "
            f"{record.get('wall_seconds', 0):.1f} s")

    if log_file is None:
        run_pipeline(spec, run_dir=run_dir, wait=wait, log=log, on_round=on_round)
        return
    from curation.library_logs import log_libraries_to
    from store.run_files import LOGS_DIR

    log_libraries_to(run_dir / LOGS_DIR / "run.log", "groupforge run (a study's worker)")  # as `groupforge run`'s
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as stream:
        def log(message: str) -> None:
            print(message, file=stream, flush=True)

        run_pipeline(spec, run_dir=run_dir, wait=wait, log=log, on_round=on_round)


# ---------------------------------------------------------------------------------------------
# Choosing by validation
# ---------------------------------------------------------------------------------------------

def validation_score(rounds: list[dict], last: int) -> float | None:
    """The mean eval accuracy of the last `last` evaluated rounds >= 1 (round 0 is the start model,
    the same for every setting); None when no such round evaluated."""
    values = [acc for r in rounds if r.get("round", 0) >= 1 and (acc := number(r, "eval_accuracy")) is not None]
    return sum(values[-last:]) / len(values[-last:]) if values else None


def pick_setting(runs: dict[str, Path], validation_file: Path, last: int) -> tuple[str, dict[str, float | None]]:
    """(the chosen key, every key's score) of sweep runs {key: run folder}: the highest
    validation_score, the first listed among ties. Each run must have evaluated on
    `validation_file` (its RUN/spec.toml says so), never on an eval set."""
    scores: dict[str, float | None] = {}
    for key, run in runs.items():
        evaluated = read_toml(Path(run) / SPEC_FILE)["prompts"]["eval"]
        if Path(evaluated).resolve() != Path(validation_file).resolve():
            raise ValueError(f"{run}: evaluated on {evaluated}, not on the validation split {validation_file}; "
                             "a setting is chosen by validation only")
        scores[key] = validation_score(MetricsLog(run).rounds(), last)
    scored = {key: score for key, score in scores.items() if score is not None}
    if not scored:
        raise ValueError(f"no sweep run has a validation eval after round 0: {', '.join(map(str, runs.values()))}")
    return max(scored, key=scored.__getitem__), scores  # max keeps the first of equal scores


# ---------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------

@dataclass
class SweepResult:
    name: str
    settings: list[Setting]
    runs: dict[str, Path]                    # slug -> run folder ({} when the objective has no grid)
    scores: dict[str, float | None]
    chosen: Setting


@dataclass
class StudyResult:
    section: CompareSection
    out: Path
    split: Split | None
    sweeps: dict[str, SweepResult]           # by run.name, in the compare file's order
    finals: dict[str, dict[int, Path]]       # run.name -> seed -> run folder
    objectives: dict[str, str] = field(default_factory=dict)   # run.name -> train.objective
    jobs: int = 1
    device: str = "CPU"


def run_study(section: CompareSection, out: Path, jobs: int = 1, wait: bool = True,
              log: Callable[[str], None] = print) -> StudyResult:
    """Split, sweep, choose, run the seeds; returns what study_report needs (the report is
    written by `report_study`)."""
    base = {spec.run.name: (file, spec) for file in section.specs
            for spec in [load_spec(file, overrides=compare_overrides(section))]}
    if len(base) < len(section.specs):
        raise ValueError("compare: the specs must have different run.name (each gets its own run folder)")
    unknown = sorted(set(section.sweep) - set(base))
    if unknown:
        raise ValueError(f"compare.sweep: {', '.join(unknown)} is no spec's run.name ({', '.join(base)})")
    check_comparable({file: spec for file, spec in base.values()})
    seeds = section.seeds or [next(iter(base.values()))[1].run.seed]
    first = next(iter(base.values()))[1]
    split = (split_prompts(first.prompts.train, first.prompts.eval, section.validation_size, out)
             if section.sweep else None)

    def final_spec(name: str, setting: Setting, seed: int) -> PipelineSpec:
        return plan_spec(base[name][0], section, split, setting, rounds=None, seed=seed, name=f"{name}-seed-{seed}",
                         validation=False)

    # every candidate's final run must be comparable to every other's: refused before any run
    reference = final_spec(next(iter(base)), Setting({}), seeds[0])
    settings = {name: grid(section.sweep.get(name, {})) or [Setting({})] for name in base}
    for name, candidates in settings.items():
        for setting in candidates:
            diff = budget_difference(final_spec(name, setting, seeds[0]), reference)
            if diff:
                raise ValueError(f"compare: {name} with {setting.label} differs from {next(iter(base))} in "
                                 f"{', '.join(diff)}; a comparison needs the same model, prompts, sampling, seeds "
                                 "and sample budget (a sweep may change training, not the samples)")

    # -- sweep on the validation split ---------------------------------------------------------
    sweep_plans = {name: {s.slug: RunPlan(f"sweep {name} {s.label}", plan_spec(
        base[name][0], section, split, s, rounds=section.sweep_rounds, seed=section.sweep_seed,
        name=f"{name}-{s.slug}", validation=True), out / SWEEP_DIR / name / s.slug) for s in settings[name]}
        for name in base if name in section.sweep}
    execute([p for plans in sweep_plans.values() for p in plans.values()], jobs, wait, log)
    sweeps = {}
    for name in base:
        by_slug = {s.slug: s for s in settings[name]}
        if name in sweep_plans:
            runs = {slug: plan.run_dir for slug, plan in sweep_plans[name].items()}
            chosen, scores = pick_setting(runs, split.validation, section.select_last)
        else:
            runs, chosen, scores = {}, settings[name][0].slug, {}
        sweeps[name] = SweepResult(name, settings[name], runs, scores, by_slug[chosen])
    write_json_atomic(out / STUDY_FILE, study_record(section, split, sweeps))

    # -- final runs: the chosen settings, every seed, on the eval set -----------------------------
    final_plans = [RunPlan(f"final {name} seed {seed}", final_spec(name, sweeps[name].chosen, seed),
                           out / FINAL_DIR / name / f"seed-{seed}")
                   for seed in seeds for name in base]  # interleaved: with jobs > 1 they share the CPU alike
    execute(final_plans, jobs, wait, log)
    finals = {name: {seed: out / FINAL_DIR / name / f"seed-{seed}" for seed in seeds} for name in base}
    import torch

    device = f"GPU ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "CPU"
    return StudyResult(section, out, split, sweeps, finals,
                       {name: spec.train.objective for name, (_, spec) in base.items()}, jobs, device)


def study_record(section: CompareSection, split: Split | None, sweeps: dict[str, SweepResult]) -> dict:
    """OUT/study.json: the split, the score rule, each setting's validation score, the choices."""
    return {
        "score": f"mean validation eval accuracy of the last {section.select_last} evaluated rounds >= 1 of a "
                 f"sweep run ({section.sweep_rounds} rounds, seed {section.sweep_seed}); highest wins, the first "
                 "listed among ties",
        "split": split.record if split is not None else None,
        "objectives": {name: {"chosen": s.chosen.values, "chosen_label": s.chosen.label,
                              "settings": [{"setting": x.values, "label": x.label, "run": s.runs.get(x.slug),
                                            "validation_score": s.scores.get(x.slug)} for x in s.settings]}
                       for name, s in sweeps.items()},
    }
