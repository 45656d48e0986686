"""`groupforge tune SPEC`: the spec's lr chosen on a validation split held out from its train
prompts, within a time budget, and written into a copy of the spec with the evidence.

    WORK/data/train.parquet        the spec's train prompts without the validation split
    WORK/data/validation.parquet   `val_prompts` train prompts, held out by sha256 of (seed, prompt_id)
    WORK/data/split.json           what the split was made from (pipelines/studies/study.py split_prompts)
    WORK/probe-.../                one round of the first candidate: seconds per round and start-up,
                                   to fit the trials' rounds into the budget (skipped with --rounds)
    WORK/trials/lr-<lr>-r<R>-seed<S>/   a groupforge run per candidate lr: R rounds on data/train.parquet,
                                   data/validation.parquet as its eval set, evaluated every round
    OUT                            the spec's own text with [train] lr set to the choice, and a comment
                                   block above [train] (`# tune: ` lines) with the evidence in brief
    OUT with suffix .tune.json     the evidence: the split, every candidate's curve, score, rounds, seconds

A candidate's score is the mean of its last SCORE_LAST validation evals (rounds >= 1), so one
lucky eval does not win; the highest wins, the smaller lr among equal scores. The trials are
ordinary groupforge runs started by the study runner (`execute`): a rerun with the same work
folder, candidates and rounds skips the finished trials. No trial trains on a validation
prompt, and the spec's eval prompts are never evaluated: the tuned spec keeps them as they are.
Trials start while the budget lasts: one whose estimate would end past OVERRUN x the budget is
not started, and the evidence names it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from curation.generate.prompt_files import expand_prompt_files
from pipelines.spec import PipelineSpec, load_spec
from pipelines.studies.spec_text import format_float
from pipelines.studies.study import RunPlan, Setting, Split, execute, plan_spec, split_prompts, validation_score
from store.run_files import MetricsLog

SCORE_LAST = 3
"""A candidate's score: the mean of its last this many validation evals."""
GRID_FACTORS = (1.0, 1 / 3, 3.0)
"""The default candidates: the spec's lr times these (the spec's own first: it is the one kept
when the budget allows a single trial)."""
DEFAULT_VALIDATION, MIN_VALIDATION = 256, 16
"""Held-out prompts: by default 256 or a fifth of the train prompts, whichever is fewer; fewer
than MIN_VALIDATION cannot tell candidates apart."""
OVERRUN = 1.2
"""A trial is not started when its estimate would end past this multiple of the budget."""
PROBE_ROUNDS = 2


def parse_lrs(text: str) -> list[float]:
    """"3e-4,1e-3" -> [3e-4, 1e-3]: positive numbers, each once; anything else is a ValueError
    naming --lrs."""
    try:
        lrs = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--lrs {text!r}: expected comma-separated learning rates, e.g. 1e-4,3e-4,1e-3") from None
    if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise ValueError(f"--lrs {text!r}: every learning rate must be a positive number")
    if len(set(lrs)) < len(lrs):
        raise ValueError(f"--lrs {text!r}: a learning rate is listed twice")
    return lrs


def default_lrs(lr: float) -> list[float]:
    """The spec's lr and its neighbours on a log grid (GRID_FACTORS), 3 significant digits."""
    return [lr if factor == 1.0 else float(f"{lr * factor:.3g}") for factor in GRID_FACTORS]


# ---------------------------------------------------------------------------------------------
# Candidates, their scores and the ranking
# ---------------------------------------------------------------------------------------------

@dataclass
class Trial:
    """One candidate lr: its run and validation curve once tried (`tried` False: the budget ran out)."""

    lr: float
    run_dir: Path | None = None
    rounds: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)   # (round, validation accuracy), round 0 first
    seconds: float | None = None                                   # the run's own wall seconds (its rounds)
    tried: bool = False

    @property
    def score(self) -> float | None:
        """The mean validation accuracy of the last SCORE_LAST evals after round 0 (None: none)."""
        return validation_score([{"round": r, "eval_accuracy": a} for r, a in self.curve], SCORE_LAST)


def rank(trials: list[Trial]) -> list[Trial]:
    """The trials best first: the highest score, the smaller lr among scores equal to 1e-9 (a
    mean of the same accuracies summed in another order), the unscored last."""
    return sorted(trials, key=lambda t: (t.score is None, -round(t.score or 0.0, 9), t.lr))


@dataclass
class Budget:
    """Wall seconds for the whole tune (split, probe and trials), counted from its creation."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def spent(self) -> float:
        return self.clock() - self.start

    def allows(self, estimate: float | None) -> bool:
        """Whether a trial expected to take `estimate` seconds (None: unknown) may start: the
        budget is not spent and the trial would end within OVERRUN x the budget."""
        spent = self.spent()
        return spent < self.seconds and (estimate is None or spent + estimate <= OVERRUN * self.seconds)


def fit_rounds(seconds_left: float, trials: int, jobs: int, per_round: float, start_up: float, cap: int) -> int:
    """Rounds per trial so that `trials` trials, `jobs` at a time (each then ~jobs x slower on
    shared cores), fit `seconds_left`: each trial pays `start_up` and `per_round` a round. At
    least 1, at most `cap` (the spec's rounds)."""
    batches = math.ceil(trials / jobs)
    per_trial = seconds_left / batches / jobs
    return max(1, min(cap, int((per_trial - start_up) / max(per_round, 1e-9))))


# ---------------------------------------------------------------------------------------------
# The split and the trial runs
# ---------------------------------------------------------------------------------------------

def train_prompt_count(spec: PipelineSpec) -> int:
    """Distinct train prompts of the spec that are not in its eval set (the ones a split may hold out)."""
    import pyarrow as pa

    from curation.generate.base import first_of_each_prompt, load_prompts

    tables = [load_prompts(f) for f in expand_prompt_files(spec.prompts.train)]
    ids = set(first_of_each_prompt(pa.concat_tables(tables, promote_options="default")).column("prompt_id")
              .to_pylist())
    return len(ids - set(load_prompts(spec.prompts.eval).column("prompt_id").to_pylist()))


def validation_size(spec_file: Path, available: int, asked: int | None) -> int:
    """The held-out count: `asked` (--val-prompts) or min(DEFAULT_VALIDATION, available // 5);
    refused (ValueError) below MIN_VALIDATION or when it would leave fewer train prompts than it
    holds out."""
    size = asked if asked is not None else min(DEFAULT_VALIDATION, available // 5)
    what = f"--val-prompts {asked}" if asked is not None else f"{spec_file}: {available} train prompts"
    if available == 0:
        raise ValueError(f"{spec_file}: prompts.train has no prompts outside the eval set to hold out for validation")
    if size < MIN_VALIDATION:
        raise ValueError(f"{what}: too few to hold out a validation split of at least {MIN_VALIDATION} prompts"
                         + ("" if asked is not None else f" (a fifth of them; {5 * MIN_VALIDATION} needed)"))
    if available - size < size:
        raise ValueError(f"{what}: holding out {size} of {available} train prompts leaves fewer to train on than "
                         "are held out; give a smaller --val-prompts")
    return size


def trial_plan(spec_file: Path, split: Split, lr: float, rounds: int, seed: int, name: str, folder: Path) -> RunPlan:
    """The run of one candidate: the spec with train.lr = lr, `rounds` rounds and run.seed
    `seed`, trained on the split's train part and evaluated on its validation part every round
    (study.plan_spec), with no tracker and no [export] append_to: a trial leaves nothing
    outside its folder."""
    spec = plan_spec(str(spec_file), None, split, Setting({"train.lr": lr}), rounds=rounds, seed=seed,
                     name=name, validation=True)
    spec = spec.model_copy(update={"run": spec.run.model_copy(update={"trackers": []}),
                                   "export": spec.export.model_copy(update={"append_to": None})})
    return RunPlan(f"lr {format_float(lr)}", spec, folder)


def read_trial(trial: Trial) -> None:
    """Fill `trial`'s curve and seconds from its run's metrics.jsonl."""
    rounds = MetricsLog(trial.run_dir).rounds()
    trial.curve = [(r["round"], r["eval_accuracy"]) for r in rounds if r.get("eval_accuracy") is not None]
    trial.seconds = rounds[-1].get("elapsed_seconds") if rounds else None
    trial.tried = True


def probe(spec_file: Path, split: Split, lr: float, seed: int, name: str, work: Path, jobs: int,
          log: Callable[[str], None]) -> tuple[float, float]:
    """(seconds per round, start-up seconds) of a trial, from a PROBE_ROUNDS-round run of `lr`
    named `name`-tune-probe: a round is its last round's seconds (the first pays the process's
    one-time costs: the first training step, thread pools); the start-up is its round 0 (the
    engine start and the start model's eval), plus that first-round excess when trials run in
    worker processes of their own (`jobs` > 1)."""
    plan = trial_plan(spec_file, split, lr, PROBE_ROUNDS, seed, f"{name}-tune-probe",
                      work / f"probe-lr-{format_float(lr)}-seed{seed}")
    execute([RunPlan(f"probe {plan.label}", plan.spec, plan.run_dir)], 1, True, log)
    seconds = [r.get("wall_seconds", 0.0) for r in MetricsLog(plan.run_dir).rounds()]
    per_round = seconds[-1]
    return per_round, seconds[0] + (max(0.0, seconds[1] - per_round) if jobs > 1 else 0.0)


# ---------------------------------------------------------------------------------------------
# The tune
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TuneRequest:
    """What `groupforge tune` was asked: None values take the defaults in the module docstring."""

    spec_file: Path
    out: Path
    work: Path
    budget_seconds: float
    lrs: list[float] | None = None
    rounds: int | None = None
    val_prompts: int | None = None
    jobs: int = 1
    seed: int | None = None


@dataclass
class TuneResult:
    request: TuneRequest
    spec: PipelineSpec
    seed: int
    split: Split
    rounds: int
    per_round: float | None            # the probe's seconds per round (None with --rounds)
    trials: list[Trial]                # ranked: the tried ones best first, then the ones not tried
    spent: float = 0.0

    @property
    def chosen(self) -> Trial:
        return self.trials[0]


def run_tune(request: TuneRequest, log: Callable[[str], None] = print) -> TuneResult:
    """Split, probe, run the candidates while the budget lasts, rank them. Writes nothing outside
    request.work (write_tuned writes the spec)."""
    budget = Budget(request.budget_seconds)
    spec = load_spec(request.spec_file)
    seed = spec.run.seed if request.seed is None else request.seed
    lrs = request.lrs or default_lrs(spec.train.lr)
    size = validation_size(request.spec_file, train_prompt_count(spec), request.val_prompts)
    split = split_prompts(expand_prompt_files(spec.prompts.train), spec.prompts.eval, size, request.work, seed)
    log(f"split: {split.record['train_rows']} train prompts, {split.record['validation_rows']} held out for "
        f"validation (seed {seed}) -> {request.work}")
    per_round = estimate = None
    rounds = request.rounds
    if rounds is None:
        per_round, start_up = probe(request.spec_file, split, lrs[0], seed, spec.run.name, request.work,
                                    request.jobs, log)
        rounds = fit_rounds(request.budget_seconds - budget.spent(), len(lrs), request.jobs, per_round, start_up,
                            spec.run.rounds)
        estimate = start_up + rounds * per_round
        log(f"probe: {per_round:.1f} s a round, {start_up:.0f} s to start: {rounds} round(s) a trial fit the "
            f"{request.budget_seconds / 60:g}-minute budget")
    if rounds < SCORE_LAST:
        log(f"warning: {rounds} round(s) a trial: each score rests on fewer than {SCORE_LAST} evals; give more "
            "--budget-minutes or --rounds for a steadier choice")
    trials = [Trial(lr) for lr in lrs]
    for first in range(0, len(trials), request.jobs):
        batch = trials[first:first + request.jobs]
        if not budget.allows(None if estimate is None else estimate * len(batch)):
            log(f"budget: {budget.spent() / 60:.1f} of {request.budget_seconds / 60:g} minutes spent; not tried: "
                f"{', '.join(format_float(t.lr) for t in trials[first:])}")
            break
        plans = [trial_plan(request.spec_file, split, t.lr, rounds, seed, f"{spec.run.name}-tune-lr-{lr}",
                            request.work / "trials" / f"lr-{lr}-r{rounds}-seed{seed}")
                 for t in batch for lr in [format_float(t.lr)]]
        tic = time.monotonic()
        execute(plans, request.jobs, True, log)
        for index, (trial, plan) in enumerate(zip(batch, plans), start=first + 1):
            trial.run_dir, trial.rounds = plan.run_dir, rounds
            read_trial(trial)
            score = "-" if trial.score is None else f"{100 * trial.score:.1f}%"
            log(f"trial {index}/{len(trials)} lr {format_float(trial.lr)}: validation {score} (mean of the last "
                f"{SCORE_LAST} evals), {rounds} round(s), {trial.seconds or 0:.0f} s; "
                f"{budget.spent() / 60:.1f} of {request.budget_seconds / 60:g} budget minutes spent")
        estimate = (time.monotonic() - tic) / len(batch)
    tried = [t for t in trials if t.tried]
    if not tried:
        raise ValueError(f"--budget-minutes {request.budget_seconds / 60:g}: spent before the first trial could start "
                         f"({budget.spent():.0f} s for the split and the probe); give more minutes, or --rounds")
    return TuneResult(request, spec, seed, split, rounds, per_round,
                      rank(tried) + [t for t in trials if not t.tried], budget.spent())


# ---------------------------------------------------------------------------------------------
# The tuned spec and its evidence
# ---------------------------------------------------------------------------------------------

COMMENT_PREFIX = "# tune: "
"""Every line of the comment block above [train]; a spec tuned again gets its block replaced."""


def evidence_path(out: Path) -> Path:
    """OUT.toml -> OUT.tune.json, beside the tuned spec."""
    return out.with_suffix(".tune.json")


def evidence_record(result: TuneResult) -> dict:
    """The .tune.json document: the choice, the rule, the split and every candidate."""
    request = result.request
    return {
        "spec": str(request.spec_file), "tuned_spec": str(request.out),
        "chosen_lr": result.chosen.lr, "spec_lr": result.spec.train.lr,
        "score": f"mean validation accuracy of the last {SCORE_LAST} evals after round 0 of a {result.rounds}-round "
                 "trial; the highest wins, the smaller lr among equal scores",
        "rounds": result.rounds, "rounds_from": "--rounds" if request.rounds is not None else "the budget (probe)",
        "seconds_per_round": result.per_round, "seed": result.seed,
        "budget_seconds": request.budget_seconds, "spent_seconds": round(result.spent, 1), "jobs": request.jobs,
        "split": result.split.record, "work": str(request.work),
        "candidates": [{"lr": t.lr, "tried": t.tried, "validation_score": t.score, "rounds": t.rounds,
                        "seconds": t.seconds, "run": None if t.run_dir is None else str(t.run_dir),
                        "curve": [[r, a] for r, a in t.curve]} for t in result.trials],
        "not_tried": [t.lr for t in result.trials if not t.tried],
    }


def comment_lines(result: TuneResult) -> list[str]:
    """The block above [train]: the choice, how it was made, each candidate's score."""
    record = result.split.record
    spec_lr = result.spec.train.lr
    listed = ", ".join(format_float(t.lr) + (" (the spec's)" if t.lr == spec_lr else "")
                       for t in sorted(result.trials, key=lambda t: t.lr))
    lines = [f"lr = {format_float(result.chosen.lr)}, chosen by `groupforge tune` of {listed}:",
             f"the highest validation accuracy (mean of the last {SCORE_LAST} evals) after {result.rounds} rounds, "
             f"seed {result.seed},",
             f"trained on {record['train_rows']:,} train prompts and scored on {record['validation_rows']:,} others "
             "held out; the eval prompts chose nothing.",
             f"Evidence (curves, seconds): {evidence_path(result.request.out).name}"]
    width = max(len(format_float(t.lr)) for t in result.trials)
    for trial in result.trials:
        if not trial.tried:
            lines.append(f"  lr {format_float(trial.lr):<{width}}  not tried: the budget was spent")
        else:
            score = "-" if trial.score is None else f"{100 * trial.score:.1f}%"
            lines.append(f"  lr {format_float(trial.lr):<{width}}  {score:>6}  ({trial.seconds or 0:.0f} s)")
    return lines


def write_tuned(result: TuneResult) -> tuple[Path, Path]:
    """OUT: the spec's own text with [train] lr = the choice and the comment block above
    [train]; OUT.tune.json. Both written atomically; the tuned spec must load."""
    from pipelines.studies.spec_text import put_comment_block, set_key
    from store.run_files import write_json_atomic
    from store.storage import write_atomic

    request = result.request
    text = set_key(request.spec_file.read_text(), "train", "lr", result.chosen.lr, str(request.spec_file))
    text = put_comment_block(text, "train", comment_lines(result), COMMENT_PREFIX)
    request.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(request.out, text)
    load_spec(request.out)
    evidence = evidence_path(request.out)
    write_json_atomic(evidence, evidence_record(result))
    return request.out, evidence
