"""Compare files: the [compare] section that `groupforge compare` reads, and the check that
the specs it compares hold the sample budget equal.

Without `seeds` and `sweep`, each listed spec runs once; with them, the comparison is a study
(pipelines/studies/study.py). The shipped compare files are pipelines/specs/compare*.toml.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from pipelines.spec import PipelineSpec, SpecSection, load_spec, read_toml, validate_model

BUDGET_FIELDS = ("model.path", "prompts.train", "prompts.eval", "prompts.per_round", "prompts.eval_limit",
                 "generator", "run.rounds", "run.seed", "eval")
"""What a fair comparison holds equal: the start model, the prompts, sampling (group size
included), the rounds (so the samples generated), the seed and the evaluation."""


def budget_difference(a: PipelineSpec, b: PipelineSpec) -> list[str]:
    """The BUDGET_FIELDS in which spec `a` differs from spec `b` ([] when comparable)."""
    def budget(s: PipelineSpec) -> tuple:
        return (s.model.path, tuple(s.prompts.train), s.prompts.eval, s.prompts.per_round, s.prompts.eval_limit,
                s.generator.model_dump(), s.run.rounds, s.run.seed, s.eval.model_dump())

    return [field for field, x, y in zip(BUDGET_FIELDS, budget(a), budget(b)) if x != y]


def check_comparable(specs: dict[str, PipelineSpec]) -> None:
    """A comparison is fair only from the same model, prompts, sampling, seeds and sample
    budget; anything else is a ValueError naming the spec and the field that differs."""
    names = list(specs)
    if len({s.run.name for s in specs.values()}) < len(specs):
        raise ValueError("compare: the specs must have different run.name (each gets its own run folder)")
    first = specs[names[0]]
    for name in names[1:]:
        diff = budget_difference(specs[name], first)
        if diff:
            raise ValueError(f"compare: {name} differs from {names[0]} in {', '.join(diff)}; "
                             "a comparison needs the same model, prompts, sampling, seeds and sample budget")


SweepGrid = dict[str, list[int | float | str | bool]]
"""One objective's sweep: {"train.lr": [1e-4, 2e-4]}; the grid is every combination."""


def _check_sweep(sweep: dict[str, SweepGrid]) -> dict[str, SweepGrid]:
    for name, grid in sweep.items():
        for key, values in grid.items():
            if "." not in key:
                raise ValueError(f"sweep.{name}: {key!r} is not a section.key (e.g. train.lr)")
            if not values:
                raise ValueError(f"sweep.{name}.{key}: needs at least one value")
            if len(set(map(repr, values))) < len(values):
                raise ValueError(f"sweep.{name}.{key}: a value is listed twice")
    return sweep


class CompareQuick(SpecSection):
    """[compare.quick]: what `groupforge compare FILE --quick` uses instead of [compare]'s keys
    (a key left out keeps [compare]'s value; the runs go to `out`, by default [compare] out + "-quick")."""

    out: str | None = Field(None, description="Folder of the quick study (default: [compare] out + '-quick').")
    rounds: int | None = Field(None, ge=1, description="Rounds of each final run.")
    seeds: list[int] | None = Field(None, min_length=3, description="Seeds of the final runs.")
    sweep: dict[str, SweepGrid] | None = Field(None, description="The sweep grids (replace [compare.sweep]).")
    sweep_rounds: int | None = Field(None, ge=1, description="Rounds of each sweep run.")
    validation_size: int | None = Field(None, ge=1, description="Train prompts held out for validation.")
    overrides: list[str] | None = Field(None, description="Spec overrides for every run (replace [compare] "
                                                          "overrides).")

    @model_validator(mode="after")
    def _check(self) -> "CompareQuick":
        _check_sweep(self.sweep or {})
        return self


class CompareSection(SpecSection):
    """[compare] of a compare file. With neither `seeds` nor `sweep`, each spec runs once (its own
    run.seed); with them, `groupforge compare` runs a study (pipelines/studies/study.py): a sweep per
    objective on a validation split of the train prompts, then each objective's best setting
    over `seeds`, reported with 95% confidence intervals."""

    specs: list[str] = Field(..., min_length=2, description="Pipeline specs to run and compare.")
    out: str = Field("runs/compare", description="Folder for the runs (out/<run.name>) and out/report.")
    rounds: int | None = Field(None, ge=1, description="Run every spec for this many rounds instead of its own.")
    overrides: list[str] = Field([], description="Spec overrides (section.key=value, as `groupforge run --set`) "
                                                 "applied to every spec alike, e.g. prompts.per_round=64.")
    seeds: list[int] | None = Field(None, min_length=3, description="Study: run each objective's chosen setting "
                                    "once per seed (run.seed); the report gives mean and 95% CI over them.")
    sweep: dict[str, SweepGrid] = Field({}, description="Study: per spec (by run.name), a grid of spec keys to "
                                        "sweep, e.g. [compare.sweep.\"toy-grpo\"] \"train.lr\" = [1e-4, 2e-4]; every "
                                        "combination runs on the validation split and the best validation score wins. "
                                        "A spec without a grid keeps its own setting.")
    sweep_rounds: int | None = Field(None, ge=1, description="Rounds of each sweep run (fewer than the final runs).")
    sweep_seed: int = Field(100, description="run.seed of the sweep runs (apart from the final seeds, so the "
                                             "choice is not tuned to a final run's noise).")
    validation_size: int = Field(256, ge=1, description="Train prompts held out (by a hash of the prompt) as the "
                                                        "validation split; no run trains on them.")
    select_last: int = Field(3, ge=1, description="A sweep run's validation score: the mean of its last this "
                                                  "many validation evals (rounds >= 1).")
    quick: CompareQuick | None = Field(None, description="[compare.quick]: the small study of --quick.")

    @model_validator(mode="after")
    def _check(self) -> "CompareSection":
        _check_sweep(self.sweep)
        if self.sweep and self.seeds is None:
            raise ValueError("sweep needs seeds: the final runs of the chosen settings")
        if self.sweep and self.sweep_rounds is None:
            raise ValueError("sweep needs sweep_rounds (rounds of each sweep run)")
        if self.seeds is not None and len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"seeds: a seed is listed twice ({self.seeds})")
        return self

    @property
    def study(self) -> bool:
        """Whether this is a study (sweep and seeds) rather than one run per spec."""
        return bool(self.sweep) or self.seeds is not None

    def quick_study(self) -> "CompareSection":
        """This section with [compare.quick]'s keys in place of its own (out: out + '-quick' by default)."""
        if self.quick is None:
            raise ValueError("--quick needs a [compare.quick] section in the compare file")
        update = self.quick.model_dump(exclude_none=True)
        update.setdefault("out", self.out.rstrip("/") + "-quick")
        return self.model_validate({**self.model_dump(), **update, "quick": None})


def load_compare_section(path: str | Path, quick: bool = False) -> CompareSection | None:
    """The [compare] section of a compare file (with --quick's keys applied), or None when the
    file has none (a plain spec)."""
    raw = read_toml(path)
    if "compare" not in raw:
        if quick:
            raise ValueError(f"config {path}: --quick needs a compare file with [compare] and [compare.quick]")
        return None
    section = validate_model(CompareSection, raw["compare"], path, "compare")
    if quick:
        try:
            section = section.quick_study()
        except ValueError as exc:
            raise ValueError(f"config {path}: {exc}") from None
    return section


def compare_overrides(section: CompareSection | None) -> list[str]:
    """The overrides every spec of a comparison gets: [compare] overrides, then its rounds."""
    if section is None:
        return []
    return [*section.overrides, *([f"run.rounds={section.rounds}"] if section.rounds is not None else [])]


def load_compare(paths: list[str | Path], quick: bool = False,
                 check_files: bool = True) -> tuple[dict[str, PipelineSpec], Path | None]:
    """The specs of a comparison (by file name): the given spec files, or those a compare file
    (a TOML with a [compare] section) lists, with its `overrides` and `rounds` applied; and its
    output folder. `check_files` as in `load_spec`."""
    section = load_compare_section(paths[0], quick) if len(paths) == 1 else None
    if section is not None:
        paths = section.specs
    specs = {str(p): load_spec(p, check_files=check_files, overrides=compare_overrides(section)) for p in paths}
    check_comparable(specs)
    return specs, Path(section.out) if section is not None else None
