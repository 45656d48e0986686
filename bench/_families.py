"""The leave-one-family-out protocol of bench/loop.py: which toy families it may use, the toy of a
(family, size) cell, groupforge's candidate recipes, choosing a setting on the selection
families, and the per-cell checks on the test families (no torch, no TRL, no runs).

A setting (TRL's lr, groupforge's recipe) is chosen on the selection families only, by its
plateau averaged over every (selection family, size) cell:

    score(setting) = mean over cells c of plateau(run of setting on c)   (plateau: the mean of the last evals)

and the test families are run with the chosen settings alone. Each test cell (family, size,
seed) is then checked against the issue's two "must show" bars:

    plateau      groupforge's plateau >= TRL's plateau, both over the same training minutes
    time         groupforge's seconds to TRL's best <= 1/2 of TRL's seconds to its own best
                 (TRL's best: the highest trailing mean of its evals; "never" fails)
"""

from __future__ import annotations

from dataclasses import dataclass

from _curves import Curve, best, first_reaching, mean, plateau, samples_per_s

from pipelines.toy.families import FAMILIES
from pipelines.toy.task import ToyConfig, problem_count

BENCH_FAMILIES = [name for name, family in FAMILIES.items() if family.response is None]
"""The short-answer families: the response is the reference, rewarded by exact match, as TRL's run
rewards it (the scratchpad's long responses and final-answer reward are another benchmark)."""

TIME_RATIO = 0.5
"""The time check: groupforge reaches TRL's best in at most this fraction of TRL's time."""

DEFAULT_CANDIDATES = ('lr6e-5=run.rounds=1000;train.lr_schedule="constant";train.lr=6e-5,'
                      'lr3e-5=run.rounds=1000;train.lr_schedule="constant";train.lr=3e-5')
"""groupforge's recipes to choose among, each toy-family-grpo.toml plus its overrides: a constant
lr after warmup for the whole budget (TRL's schedule), at 6e-5 or 3e-5. Both are smaller than
the spec's 2e-4 because, on the selection families, 2e-4 (constant or cosine) leads for the
first minute and then falls back as the run goes on (addition 0.46 against 0.57 at 6e-5 after
3 minutes; multiply 0.29 against 0.38), and 1e-4 ends between them: the lr that wins a short
run is not the one that wins the budget, so the selection runs as long as the test runs.
"""


def name_list(text: str, option: str, known: list[str], kind: str = "family") -> list[str]:
    """"reverse,sort" -> ["reverse", "sort"]; a ValueError naming the option for a name not in
    `known`, a repeated one or an empty list."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"{option}: no {kind} given (one or more of {', '.join(known)})")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{option}: unknown {kind} {unknown[0]!r}: one of {', '.join(known)}")
    if len(set(names)) < len(names):
        raise ValueError(f"{option}: a {kind} is listed twice in {text!r}")
    return names


def family_list(text: str, option: str) -> list[str]:
    """name_list over the short-answer families; a long-response family is named as such."""
    long = [name for name in text.split(",") if name.strip() in FAMILIES and name.strip() not in BENCH_FAMILIES]
    if long:
        raise ValueError(f"{option}: {long[0].strip()} has long responses and another reward, not a short-answer "
                         f"family: one of {', '.join(BENCH_FAMILIES)}")
    return name_list(text, option, BENCH_FAMILIES)


def check_split(selection: list[str], test: list[str], kind: str = "family") -> None:
    """A family (task) is either tuned on or held out: a ValueError naming those in both."""
    both = [name for name in selection if name in test]
    if both:
        raise ValueError(f"{', '.join(both)} in both --selection and --test: a {kind} the settings are chosen on "
                         "cannot test them")


def toy_config(family: str, size: int) -> ToyConfig:
    """The toy of a cell: the family's defaults with `size` train prompts. Its warm start learns the
    family's own warm-start prompts (8,192 for the short-answer families) or else all of its train
    prompts, whatever `size`: every size starts RL from the same model, and on a few hundred prompts
    alone a warm start memorises them."""
    base = ToyConfig(task=family)
    warm = base.warm_start_prompts or problem_count(base) - base.n_eval
    return ToyConfig(task=family, n_train=size, warm_start_prompts=warm)


def check_sizes(families: list[str], sizes: list[int], option: str = "--sizes") -> None:
    """A ValueError in one line for a size some family cannot split into train prompts."""
    from pydantic import ValidationError

    for family in families:
        for size in sizes:
            try:
                toy_config(family, size)
            except ValidationError as error:
                reason = error.errors()[0]["msg"].removeprefix("Value error, ")
                raise ValueError(f"{option} {size}: {family}: {reason}") from None


@dataclass(frozen=True)
class Candidate:
    """A groupforge recipe: the spec plus these `section.key=value` overrides."""

    name: str
    overrides: tuple[str, ...] = ()


def parse_candidates(text: str) -> list[Candidate]:
    """'shipped=,constant=run.rounds=1000;train.lr_schedule="constant"' -> [Candidate("shipped"),
    Candidate("constant", ("run.rounds=1000", 'train.lr_schedule="constant"'))]: candidates split on ",",
    a name before the first "=", overrides split on ";" (so a value cannot hold "," or ";")."""
    candidates = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, sets = item.partition("=")
        overrides = tuple(s.strip() for s in sets.split(";") if s.strip())
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--gf-candidates {item!r}: expected NAME=section.key=value[;section.key=value]")
        bad = [s for s in overrides if "=" not in s or "." not in s.partition("=")[0]]
        if bad:
            raise ValueError(f"--gf-candidates {name}: {bad[0]!r} is not section.key=value")
        candidates.append(Candidate(name, overrides))
    if not candidates:
        raise ValueError("--gf-candidates: no candidate given")
    if len({c.name for c in candidates}) < len(candidates):
        raise ValueError("--gf-candidates: two candidates share a name")
    return candidates


def cell_name(family: str, size: int) -> str:
    """The name of a (family, size) cell: its runs' folder under runs/bench/loop/ and Curve.variant."""
    return f"{family}-{size}"


def choose(runs: dict[str, list[Curve]], last: int, window: int) -> tuple[str, dict[str, float]]:
    """The setting whose runs (one per selection cell) have the highest mean plateau, ties to the higher
    mean best; with every setting's score. Every setting must have run on the same cells."""
    cells = {name: sorted(c.variant for c in curves) for name, curves in runs.items()}
    if len({tuple(v) for v in cells.values()}) != 1:
        raise ValueError(f"settings ran on different cells: {cells}")
    scores = {name: mean([plateau(c, last) for c in curves]) for name, curves in runs.items()}
    bests = {name: mean([best(c, window) for c in curves]) for name, curves in runs.items()}
    return max(runs, key=lambda name: (scores[name], bests[name])), scores


def verdict(trl: Curve, gf: Curve, last: int, window: int) -> dict:
    """One test cell (the same family, size and seed): each side's plateau, TRL's best and each side's
    seconds to it, their ratio and the two checks."""
    if (trl.variant, trl.seed) != (gf.variant, gf.seed):
        raise ValueError(f"{trl.variant} seed {trl.seed} vs {gf.variant} seed {gf.seed}: not the same cell")
    target = best(trl, window)
    at = [first_reaching(c, target, window) for c in (trl, gf)]
    trl_s, gf_s = (None if i is None else c.seconds[i] for c, i in zip((trl, gf), at))
    ratio = None if gf_s is None or not trl_s else gf_s / trl_s
    if gf_s is not None and trl_s == 0:  # TRL's best was its start model: both are there at once
        ratio = 0.0 if gf_s == 0 else None
    trl_plateau, gf_plateau = plateau(trl, last), plateau(gf, last)
    return {"cell": trl.variant, "seed": trl.seed, "trl_plateau": trl_plateau, "gf_plateau": gf_plateau,
            "target": target, "trl_seconds": trl_s, "gf_seconds": gf_s, "ratio": ratio,
            "plateau_pass": gf_plateau >= trl_plateau, "time_pass": ratio is not None and ratio <= TIME_RATIO,
            "train_seconds": (trl.seconds[-1], gf.seconds[-1]),
            "samples_per_s": (samples_per_s(trl), samples_per_s(gf))}


def _f(value: float | None, spec: str = ".3f") -> str:
    return "never" if value is None else format(value, spec)


def _check(ok: bool) -> str:
    return "PASS" if ok else "**FAIL**"


def result_tables(verdicts: list[dict]) -> list[str]:
    """The result: one row per test cell and seed, then the mean per cell, then the count of passes."""
    lines = ["| family-size | seed | plateau TRL | plateau groupforge | plateau check | TRL best | s to it TRL | "
             "s to it groupforge | ratio | time check | train s TRL / groupforge | samples/s TRL / groupforge |",
             "|---|--:|--:|--:|---|--:|--:|--:|--:|---|--:|--:|"]
    for v in verdicts:
        lines.append(f"| {v['cell']} | {v['seed']} | {v['trl_plateau']:.3f} | {v['gf_plateau']:.3f} | "
                     f"{_check(v['plateau_pass'])} | {v['target']:.3f} | {_f(v['trl_seconds'], '.0f')} | "
                     f"{_f(v['gf_seconds'], '.0f')} | {_f(v['ratio'], '.2f')} | {_check(v['time_pass'])} | "
                     f"{v['train_seconds'][0]:.0f} / {v['train_seconds'][1]:.0f} | "
                     f"{v['samples_per_s'][0]:.3g} / {v['samples_per_s'][1]:.3g} |")
    lines += ["", "| family-size | seeds | plateau TRL | plateau groupforge | ratio (mean) | plateau checks | "
              "time checks |", "|---|--:|--:|--:|--:|--:|--:|"]
    for cell in dict.fromkeys(v["cell"] for v in verdicts):
        mine = [v for v in verdicts if v["cell"] == cell]
        lines.append(f"| {cell} | {len(mine)} | {mean([v['trl_plateau'] for v in mine]):.3f} | "
                     f"{mean([v['gf_plateau'] for v in mine]):.3f} | {_f(mean([v['ratio'] for v in mine]), '.2f')} | "
                     f"{sum(v['plateau_pass'] for v in mine)}/{len(mine)} | "
                     f"{sum(v['time_pass'] for v in mine)}/{len(mine)} |")
    both = sum(v["plateau_pass"] and v["time_pass"] for v in verdicts)
    lines += ["", f"**{both} of {len(verdicts)} test cells pass both checks** (plateau "
              f"{sum(v['plateau_pass'] for v in verdicts)}/{len(verdicts)}, time "
              f"{sum(v['time_pass'] for v in verdicts)}/{len(verdicts)})."]
    return lines


def selection_table(label: str, runs: dict[str, list[Curve]], chosen: str, scores: dict[str, float],
                    last: int, describe: dict[str, str]) -> list[str]:
    """One side's selection evidence: each setting's plateau on every selection cell and their mean."""
    cells = list(dict.fromkeys(c.variant for curves in runs.values() for c in curves))
    lines = [f"| {label} | " + " | ".join(cells) + " | mean plateau |", "|---|" + "--:|" * (len(cells) + 1)]
    for name, curves in runs.items():
        by_cell = {c.variant: plateau(c, last) for c in curves}
        mark = " (chosen)" if name == chosen else ""
        lines.append(f"| {describe.get(name, name)}{mark} | " + " | ".join(f"{by_cell[c]:.3f}" for c in cells)
                     + f" | {scores[name]:.3f} |")
    return lines
