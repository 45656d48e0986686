"""Curation from a config: the spec sections the stages read, and running them.

A curation config is a TOML file with any of the sections [score], [filter], [label],
[pair], [export]; each maps 1:1 to its stage's pydantic config, and an unknown key inside a
section is an error naming the key and the file. A full pipeline spec is a curation config
too: its other sections ([run], [model], [generator], [train], ...; the fields of
`pipelines.spec.PipelineSpec`) are left to their readers. Any other section (a typo such as
[filte]) is an error naming the section and the file. With no file, every stage uses its
defaults: exact_match against the prompts' reference, zero-variance and duplicate filters,
grpo advantages, max_min pairs with soft labels.

    import groupforge as gf
    gf.curate("runs/r")                                  # every round with samples
    gf.curate("runs/r", "my-curation.toml", rounds=[3])  # one round, a config file
"""

from __future__ import annotations

import difflib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from curation.stages.export import ExportConfig
from curation.stages.filter import FilterConfig
from curation.stages.label import LabelConfig
from curation.stages.pair import PairConfig
from curation.stages.runner import CURATION_STAGES, StageReport, run_stage
from curation.stages.score import ScoreConfig
from pipelines.spec import PipelineSpec, read_toml, validate_model
from store.run_store import RunStore

STAGES = CURATION_STAGES  # score, filter, label, pair: the order they run in


class CurationSpec(BaseModel):
    """The curation sections of a spec."""

    model_config = ConfigDict(extra="forbid")

    score: ScoreConfig = Field(default_factory=ScoreConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    label: LabelConfig = Field(default_factory=LabelConfig)
    pair: PairConfig = Field(default_factory=PairConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)


def load_curation_spec(path: str | Path | None) -> CurationSpec:
    """Read the curation sections of a TOML spec (defaults when `path` is None). A section
    that is neither a curation section nor one of a pipeline spec is an error."""
    if path is None:
        return CurationSpec()
    data = read_toml(path)
    known = set(CurationSpec.model_fields) | set(PipelineSpec.model_fields)
    for section in data:
        if section not in known:
            close = difflib.get_close_matches(section, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"config {path}: unknown section {section!r}; {hint}"
                             f"known sections: {', '.join(sorted(known))}")
    return validate_model(CurationSpec, {k: v for k, v in data.items() if k in CurationSpec.model_fields}, path)


def rounds_to_process(run_dir: str | Path, round: int | None) -> list[int]:
    """The given round, or every round that has samples."""
    store = RunStore(run_dir)
    if round is not None:
        if round not in store.rounds("samples"):
            raise ValueError(f"{store.location}: no samples in round {round} (rounds with samples: "
                             f"{store.rounds('samples') or 'none'})")
        return [round]
    rounds = store.rounds("samples")
    if not rounds:
        raise ValueError(f"{store.location}: no samples table yet; run `groupforge generate` first")
    return rounds


def curate(run_dir: str | Path, config: CurationSpec | str | Path | None = None,
           rounds: list[int] | int | None = None, force: bool = False) -> list[StageReport]:
    """score -> filter -> label -> pair on each round (default: every round with samples),
    under the run's writer lock (waits for another writer). `config`: a CurationSpec, a TOML
    file (a curation config or a whole pipeline spec), or None for the defaults. Rounds
    whose stages are up to date are skipped (their reports say so); `force` reruns them."""
    spec = config if isinstance(config, CurationSpec) else load_curation_spec(config)
    asked = [None] if rounds is None else [rounds] if isinstance(rounds, int) else rounds
    todo = [round for one in asked for round in rounds_to_process(run_dir, one)]  # checks each asked round
    reports = []
    with (store := RunStore(run_dir)).lock():  # one job: one writer in the run's log
        for round in todo:
            for stage in STAGES:
                reports.append(run_stage(stage, store, round, getattr(spec, stage), force=force))
    return reports
