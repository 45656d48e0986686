"""Specs: TOML files validated by pydantic models, with errors that name the key and the file.

A pipeline spec (`PipelineSpec`) describes a whole run: [run] [model] [prompts] [generator]
[env] [score] [filter] [label] [pair] [train] [eval] [export]; every section maps 1:1 to a pydantic model
and an unknown or invalid key is an error naming the key and the file. The shipped specs
are in pipelines/specs/.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from curation.env.config import EnvConfig
from curation.generate.base import GeneratorConfig, SamplingConfig, SamplingSettings
from curation.generate.prompt_files import check_prompt_file, expand_prompt_files
from curation.stages.export import ExportConfig
from curation.stages.filter import FilterConfig
from curation.stages.label import LabelConfig
from curation.stages.pair import PairConfig
from curation.stages.score import ScoreConfig
from pipelines.loop.prompts import PromptChoice
from store.storage import is_object_url, open_storage
from training.config import TrainConfig

M = TypeVar("M", bound=BaseModel)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config {path}: file not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config {path}: not valid TOML ({exc})") from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["train.lr=1e-4", "prompts.choice.strategy=informative"] -> the nested dict they set
    ({"train": {"lr": 1e-4}, "prompts": {"choice": {"strategy": "informative"}}}); a value is
    read as TOML (a bare word that is not TOML is a string). A malformed item is a ValueError."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        path = [part.strip() for part in key.split(".")]
        if not sep or len(path) < 2 or not all(path):
            raise ValueError(f"--set {item!r}: expected section.key=value (e.g. run.rounds=60)")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part} is set to a value by another --set")
        node[path[-1]] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`data` (a spec as read from TOML) with `overrides` (parse_overrides) merged in, key by key."""
    merged = dict(data)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = apply_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def validate_model(model: type[M], data: dict[str, Any], path: str | Path | None = None,
                   section: str | None = None) -> M:
    """`model` from `data`; a ValidationError becomes one ValueError line naming every bad key
    (as section.key) and the file."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        prefix = (section,) if section else ()
        problems = "; ".join(f"{'.'.join(str(p) for p in prefix + tuple(err['loc'])) or 'config'}: {err['msg']}"
                             for err in exc.errors())
        raise ValueError(f"config {path}: {problems}" if path else problems) from None


def load_section(model: type[M], path: str | Path | None, section: str,
                 overrides: dict[str, Any] | None = None) -> M:
    """The [section] of a TOML file (defaults without a file) as `model`, with `overrides`
    (e.g. CLI flags; None values ignored) applied on top."""
    data = read_toml(path).get(section, {}) if path is not None else {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: [{section}] must be a table")
    data = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return validate_model(model, data, path, section)


def load_env_config(path: str | Path) -> EnvConfig:
    """The [env] section of a TOML file (a spec, or a file of its own) as an EnvConfig; a file
    without one is a ValueError naming it (`groupforge generate --env-config`)."""
    if "env" not in read_toml(path):
        raise ValueError(f"config {path}: no [env] section (e.g. [env] name = \"tools\", tools = [\"calculator\"])")
    return load_section(EnvConfig, path, "env")


# -- the pipeline spec: one TOML file describes a run ------------------------------------


class SpecSection(BaseModel):
    """A spec section: a pydantic model whose unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class RefillSettings(SpecSection):
    """DAPO's dynamic sampling: when filtering leaves too few informative groups, sample more
    prompts in the same round (every extra sample is kept in the tables)."""

    min_kept_groups: int = Field(..., ge=1, description="Refill while the round has fewer kept groups (rewards "
                                                        "not all equal) than this.")
    max_extra_prompts: int = Field(..., ge=1, description="At most this many extra prompts per round, over all "
                                                          "refill calls.")
    max_calls: int = Field(4, ge=1, description="At most this many extra generate calls per round. Each asks "
                                                "for the missing groups divided by the round's kept rate so far.")


class RunSection(SpecSection):
    """The round loop."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Run name; the default run folder is runs/<name>.")
    rounds: int = Field(8, ge=0, description="Training rounds after round 0 (the evaluation of the start model).")
    steps_per_round: int = Field(4, ge=1, description="Optimizer steps per round.")
    decay_rounds: int | None = Field(
        None, ge=1, description="[train] lr_schedule = 'cosine': the lr reaches min_lr_ratio x lr at the end of this "
                                "round and stays there (a shorter run decays over all of its rounds); default: "
                                "the last round. train.decay_steps, when set, wins.")
    replay_rounds: int = Field(
        0, ge=0, description="Also train on up to this many earlier rounds (subject to train.max_staleness).")
    seed: int = Field(0, description="Seeds prompt choice, sampling and row order.")
    checkpoint_every: int = Field(
        1, ge=1, description="Write a checkpoint every K rounds and in the last one; in between the trainer keeps "
                             "its weights in memory and hands them to the engine, and a killed run replays the "
                             "rounds trained since its newest checkpoint.")
    keep_best: bool = Field(
        False, description="Keep the checkpoint of the best eval accuracy (rounds >= 1; the earliest among ties): "
                           "every evaluated round writes a checkpoint, RUN/checkpoints/best.json names the best "
                           "(round, policy_version, eval_accuracy, folder) and train.keep_last never removes it.")
    refill: RefillSettings | None = Field(None, description="Sample more prompts when filtering leaves too few "
                                                            "kept groups (off when unset).")
    pairs: Literal["auto", "every_round"] = Field(
        "auto", description="The pair stage in the loop: 'auto' runs it each round when the objective trains on "
                            "pairs (pairwise), 'every_round' always. Pairs of every round can be made later from "
                            "the groups tables: `groupforge pair RUN`.")
    trackers: list[Literal["tensorboard", "mlflow", "trackio", "wandb"]] = Field(
        [], description="Experiment trackers that get the round and step metrics, the spec and the report's plots "
                        "(offline, under RUN/trackers/; pipelines/loop/trackers.py). Each needs "
                        "pip install 'groupforge[trackers]'; a failing tracker is turned off, the run goes on.")
    overlap: int = Field(0, ge=0, le=1, description="1: the engines sample round n+1 while round n trains (with "
                                                    "the weights round n started from: one round off-policy; "
                                                    "samples keep their policy_version). Needs the engines on Ray "
                                                    "(generator.engines > 1 or generator.ray_address).")


class ModelSection(SpecSection):
    path: str = Field(..., description="Starting model: a Hugging Face folder with safetensors weights, local or "
                                       "on an object store (s3://, gs://, az://: each machine keeps its own copy).")
    trust_remote_code: bool = Field(False, description="Run the model folder's own Python code (config.json "
                                    "auto_map) in the engines and the trainer. Off: such a folder is refused.")


class PromptsSection(SpecSection):
    train: list[str] = Field(..., min_length=1, description="Prompt files (Parquet/JSONL): paths, folders, globs "
                             "(data/prompts/date=*/*.parquet) or object-store URLs (s3://bucket/prompts/date=*/), "
                             "listed again by each `groupforge run`; prompts of files new to the run come first.")
    eval: str = Field(..., description="Held-out prompts with a `reference` column (a file or an object URL).")
    per_round: int = Field(128, ge=1, description="Prompts sampled per round.")
    eval_limit: int | None = Field(None, ge=1, description="Evaluate on the first N eval prompts (default: all).")
    choice: PromptChoice = Field(default_factory=PromptChoice, description="How a round's prompts are chosen "
                                 "([prompts.choice]: strategy least_used or informative; pipelines/loop/prompts.py).")
    curriculum: bool = Field(
        False, description="A pass-rate curriculum over each prompt's history in the run (kept as the run's "
                           "prompt_stats table): solved prompts rest for a while, never-solved ones are taken less "
                           "often, none is dropped for good ([prompts.choice] solved, rest_rounds, unsolved_visits, "
                           "unsolved_weight, pass_reward; pipelines/loop/curriculum.py).")


class GeneratorSection(GeneratorConfig, SamplingSettings):
    """How groups are sampled: `curation.generate.base`'s sampling settings and generator
    settings in one section (the seed is run.seed)."""

    model_config = ConfigDict(extra="forbid")

    def sampling(self, seed: int) -> SamplingConfig:
        """The sampling settings of this section with `seed` (the spec's run.seed)."""
        return SamplingConfig(**self.model_dump(include=set(SamplingSettings.model_fields)), seed=seed)


class EvalSection(SpecSection):
    metric: str = Field("exact_match", description="A registered reward or 'module:function', applied to greedy "
                                                   "responses; eval_accuracy is its mean.")
    max_tokens: int | None = Field(None, ge=1, description="Greedy response length (default: generator.max_tokens).")
    every: int = Field(1, ge=1, description="Evaluate every K rounds (round 0 and the last round always); the "
                                            "other rounds record eval_accuracy as null.")


class PipelineSpec(SpecSection):
    """A whole run: [run] [model] [prompts] [generator] [env] [score] [filter] [label] [pair] [train]
    [eval] [export]."""

    run: RunSection
    model: ModelSection
    prompts: PromptsSection
    generator: GeneratorSection = Field(default_factory=GeneratorSection)
    env: EnvConfig | None = Field(None, description="Multi-turn rollouts: each sample a trajectory against this "
                                  "environment (curation/env/), written with the samples table's trajectory "
                                  "columns. Absent: one response per sample.")
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    label: LabelConfig = Field(default_factory=LabelConfig)
    pair: PairConfig = Field(default_factory=PairConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalSection = Field(default_factory=EvalSection)
    export: ExportConfig = Field(default_factory=ExportConfig, description="[export] append_to: the Delta table "
                                 "that `groupforge run` appends its finished rounds' export to at its end.")

    @model_validator(mode="after")
    def _check(self) -> "PipelineSpec":
        if self.train.rounds is not None:
            raise ValueError("train.rounds is set by the round loop (this round plus run.replay_rounds); remove it")
        if "trust_remote_code" in self.train.model_fields_set:
            raise ValueError("train.trust_remote_code is set by the round loop from model.trust_remote_code (one "
                             "switch for the engines and the trainer); remove it and set [model] trust_remote_code")
        if "seed" in self.train.model_fields_set:
            raise ValueError("train.seed is set by the round loop from run.seed (one seed for prompt choice, "
                             "sampling and row order); remove it and set run.seed")
        if self.train.temperature not in (None, self.generator.temperature):
            raise ValueError(f"train.temperature {self.train.temperature} differs from generator.temperature "
                             f"{self.generator.temperature}: log-probs must use the sampling temperature")
        if self.run.overlap and not self.generator.uses_ray:
            raise ValueError("run.overlap = 1 samples while the trainer trains, so the engines must run in other "
                             "processes: set generator.engines >= 2 or generator.ray_address")
        if self.train.nproc > 1 and self.train.strategy == "single":
            raise ValueError(f"train.nproc = {self.train.nproc} needs train.strategy = 'ddp' or 'fsdp2'")
        return self


def todo_keys(raw: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every string in a parsed TOML document that starts with TODO."""
    found = []
    items = raw.items() if isinstance(raw, dict) else enumerate(raw)
    for key, value in items:
        dotted = f"{prefix}[{key}]" if isinstance(raw, list) else (f"{prefix}.{key}" if prefix else str(key))
        if isinstance(value, str) and value.startswith("TODO"):
            found.append((dotted, value))
        elif isinstance(value, (dict, list)):
            found.extend(todo_keys(value, dotted))
    return found


def load_spec(path: str | Path, check_files: bool = True, overrides: list[str] = ()) -> PipelineSpec:
    """A pipeline spec from TOML, with `overrides` ("section.key=value", `parse_overrides`)
    applied; errors name the key and the file. Relative paths in the spec are relative to the
    current directory. With `check_files`, the model folder and the eval file must exist and each
    train entry must name at least one prompt file (`curation.generate.prompt_files`)."""
    raw = apply_overrides(read_toml(path), parse_overrides(list(overrides)))
    todo = todo_keys(raw)
    if todo:  # a starter spec's placeholders (`groupforge init`), named before anything else
        key, value = todo[0]
        more = f" (and {len(todo) - 1} more: {', '.join(k for k, _ in todo[1:])})" if len(todo) > 1 else ""
        raise ValueError(f"config {path}: {key} is still a TODO: {value.removeprefix('TODO:').strip()}{more}")
    spec = validate_model(PipelineSpec, raw, path)
    if check_files:
        model = spec.model.path
        if not _has_model_config(model):
            raise ValueError(f"config {path}: model.path {model}: not a Hugging Face model folder (no config.json)")
        try:
            expand_prompt_files(spec.prompts.train)  # globs and folders name at least one file each
            check_prompt_file(spec.prompts.eval, "prompts.eval")
        except ValueError as exc:
            raise ValueError(f"config {path}: {exc}") from None
    return spec


def _has_model_config(model: str) -> bool:
    """Whether the model folder (a local path, or an object-store URL) holds a config.json."""
    if not is_object_url(model):
        return (Path(model) / "config.json").is_file()
    try:
        return open_storage(model).size("config.json") is not None
    except ValueError as exc:  # a malformed URL
        raise ValueError(f"model.path {model}: {exc}") from None


def resolved_toml(spec: PipelineSpec) -> str:
    """The spec with every default filled in, as TOML (RUN/spec.toml); it loads back as the
    same spec (the keys the round loop sets, train.seed, train.rounds and train.trust_remote_code,
    are left out)."""
    return dump_toml(spec.model_dump(mode="json", exclude={"train": {"seed", "rounds", "trust_remote_code"}}))


def dump_toml(data: dict[str, Any]) -> str:
    """A spec dict (JSON types) as TOML: top-level dicts become [sections], lists of dicts
    inline tables, None values are left out (they mean "default")."""
    import json

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float, str)):
            return json.dumps(v)  # JSON strings and numbers are valid TOML
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v if x is not None) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items() if x is not None) + "}"
        raise TypeError(f"cannot write {type(v).__name__} as TOML")

    lines: list[str] = []
    for key, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{key}]"] + [f"{k} = {value(x)}" for k, x in v.items() if x is not None]
        elif v is not None:
            lines.insert(0, f"{key} = {value(v)}")
    return "\n".join(lines).lstrip("\n") + "\n"
