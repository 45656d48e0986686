"""Curation from the command line: the spec sections the stages read, and running them.

A curation config is a TOML file with any of the sections [score], [filter], [label],
[pair], [export]; each maps 1:1 to its stage's pydantic config, and an unknown key inside a
section is an error naming the key and the file. Other top-level sections (a full pipeline
spec's [model], [generator], ...) are left to their readers. With no file, every stage
uses its defaults: exact_match against the prompts' reference, zero-variance and duplicate
filters, grpo advantages, max_min pairs with soft labels.
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from curation.stages import filter as filter_stage
from curation.stages import label as label_stage
from curation.stages import pair as pair_stage
from curation.stages import score as score_stage
from curation.stages.common import StageReport
from curation.stages.export import ExportConfig
from curation.store import RunStore
from pipelines.spec import read_toml, validate_model

STAGES = ("score", "filter", "label", "pair")
_MODULES = {"score": score_stage, "filter": filter_stage, "label": label_stage, "pair": pair_stage}


class CurationSpec(BaseModel):
    """The curation sections of a spec."""

    model_config = ConfigDict(extra="ignore")

    score: score_stage.ScoreConfig = Field(default_factory=score_stage.ScoreConfig)
    filter: filter_stage.FilterConfig = Field(default_factory=filter_stage.FilterConfig)
    label: label_stage.LabelConfig = Field(default_factory=label_stage.LabelConfig)
    pair: pair_stage.PairConfig = Field(default_factory=pair_stage.PairConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)


def load_curation_spec(path: str | Path | None) -> CurationSpec:
    """Read the curation sections of a TOML spec (defaults when `path` is None)."""
    if path is None:
        return CurationSpec()
    return validate_model(CurationSpec, read_toml(path), path)


def rounds_to_process(run_dir: str | Path, round: int | None) -> list[int]:
    """The given round, or every round that has samples."""
    store = RunStore(run_dir)
    if round is not None:
        if round not in store.rounds("samples"):
            raise ValueError(f"{store.root}: no samples in round {round} (rounds with samples: "
                             f"{store.rounds('samples') or 'none'})")
        return [round]
    rounds = store.rounds("samples")
    if not rounds:
        raise ValueError(f"{store.root}: no samples table yet; run `groupforge generate` first")
    return rounds


def run_stage(stage: str, run_dir: str | Path, round: int, spec: CurationSpec, force: bool = False) -> StageReport:
    started = time.perf_counter()
    report = _MODULES[stage].run(run_dir, round, getattr(spec, stage), force=force)
    report.seconds = time.perf_counter() - started
    return report
