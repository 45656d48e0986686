"""CLI flags built from the models: every field has its flag, with the field's default and help,
and the flags a user gives (only those) reach the model."""

from __future__ import annotations

import re
import shlex

import pytest
import typer
from rich.markup import escape

from curation.generate.base import GeneratorConfig, SamplingConfig
from pipelines.cli.main import app
from pipelines.cli.options import build, flag_name, given, parse_int_list, pick
from pipelines.spec import GeneratorSection, load_section
from tests.helpers import REPO
from training.config import TrainConfig

COMMANDS = typer.main.get_command(app).commands


def options(command: str) -> dict[str, object]:
    """{flag: click option} of a command, every spelling of each flag."""
    return {opt: param for param in COMMANDS[command].params for opt in (*param.opts, *param.secondary_opts)}


def overrides(command: str, argv: list[str]) -> dict:
    """What the command would receive as `overrides` for `argv` (parsed, not run)."""
    ctx = COMMANDS[command].make_context(command, argv)
    return given(ctx, {name: value for name, value in ctx.params.items() if name in
                       {**TrainConfig.model_fields, **SamplingConfig.model_fields, **GeneratorConfig.model_fields}})


# `train` sets every TrainConfig field; `generate` every [generator] field and the seed (in a
# spec the seed is run.seed, so GeneratorSection has none). No field is left out.
FIELDS = [("train", name, info) for name, info in TrainConfig.model_fields.items()] + [
    ("generate", name, info) for name, info in
    {**GeneratorSection.model_fields, "seed": SamplingConfig.model_fields["seed"]}.items()]


NESTED = {"lora"}  # a nested table ([train] lora = {...}): set in a config file, no flag


@pytest.mark.parametrize("command,name,info", FIELDS, ids=[f"{c}.{n}" for c, n, _ in FIELDS])
def test_every_field_has_its_flag_with_the_same_default_and_help(command, name, info):
    if name in NESTED:
        assert options(command).get(flag_name(name)) is None
        assert "no flag" in info.description
        return
    option = options(command).get(flag_name(name))
    assert option is not None, f"groupforge {command} has no {flag_name(name)}"
    assert option.help == escape(info.description)  # escaped: rich would eat a "[train]"
    assert option.default == info.default
    assert option.show_default == (info.default is not None)
    if info.annotation in (bool, bool | None):
        assert f"--no-{flag_name(name)[2:]}" in option.secondary_opts


def test_the_models_share_no_field_and_generator_section_is_both():
    """GeneratorSection is the sampling settings (without the seed) and the generator settings."""
    sampling = set(SamplingConfig.model_fields) - {"seed"}
    assert set(GeneratorSection.model_fields) == sampling | set(GeneratorConfig.model_fields)
    assert not sampling & set(GeneratorConfig.model_fields)
    for name, info in GeneratorSection.model_fields.items():
        source = SamplingConfig.model_fields.get(name) or GeneratorConfig.model_fields[name]
        assert (info.default, info.description) == (source.default, source.description), name


def test_flags_not_given_override_nothing():
    assert overrides("train", ["RUN", "--steps", "3"]) == {}
    assert overrides("generate", ["--model", "m", "--prompts", "p", "--out", "o"]) == {}


def test_given_flags_are_parsed_as_their_field_types():
    got = overrides("train", ["RUN", "--steps", "3", "--objective", "gspo", "--rounds", "0-2,5", "--lr", "3e-4",
                              "--adam-betas", "0.8", "0.95", "--reference", "--no-length-normalize",
                              "--max-staleness", "2", "--ref-model", "ref"])
    assert got == {"objective": "gspo", "rounds": [0, 1, 2, 5], "lr": 3e-4, "adam_betas": (0.8, 0.95),
                   "reference": True, "length_normalize": False, "max_staleness": 2, "ref_model": "ref"}
    cfg = TrainConfig(**got)
    assert cfg.adam_betas == (0.8, 0.95) and cfg.rounds == [0, 1, 2, 5]
    got = overrides("generate", ["--model", "m", "--prompts", "p", "--out", "o", "-G", "4", "--backend", "hf",
                                 "--seed", "3", "--max-model-len", "128", "--gpu-memory-utilization", "0.3"])
    assert got == {"group_size": 4, "backend": "hf", "seed": 3, "max_model_len": 128, "gpu_memory_utilization": 0.3}
    assert build(SamplingConfig, got) == SamplingConfig(group_size=4, seed=3)
    assert build(GeneratorConfig, got).generator_kwargs() == {"dtype": "float32", "max_model_len": 128}


def test_a_flag_given_at_its_default_still_overrides_the_config_file(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text("[train]\nlr = 5e-4\nbatch_size = 64\nlength_normalize = true\n")
    cfg = load_section(TrainConfig, config, "train", overrides=overrides("train", ["RUN", "--steps", "1"]))
    assert (cfg.lr, cfg.batch_size, cfg.length_normalize) == (5e-4, 64, True)  # file keys kept
    flags = overrides("train", ["RUN", "--steps", "1", "--lr", "1e-05", "--no-length-normalize"])
    cfg = load_section(TrainConfig, config, "train", overrides=flags)
    assert (cfg.lr, cfg.batch_size, cfg.length_normalize) == (1e-5, 64, False)


@pytest.mark.parametrize("argv,phrase", [
    (["--objective", "ppo"], "'ppo' is not one of"),
    (["--rounds", "1-x"], "expected numbers like 0,1,3 or 2-5"),
    (["--adam-betas", "0.9"], "requires 2 arguments"),
])
def test_bad_flag_values_are_usage_errors(argv, phrase):
    with pytest.raises(Exception) as err:  # click's UsageError / BadParameter: exit code 2
        COMMANDS["train"].make_context("train", ["RUN", "--steps", "1", *argv])
    assert err.value.exit_code == 2 and phrase in err.value.format_message()


def test_build_names_the_flag_of_a_bad_value():
    with pytest.raises(ValueError, match=r"^--group-size: group_size must be >= 1, got 0$"):
        build(SamplingConfig, {"group_size": 0})
    with pytest.raises(ValueError, match=r"^--chunk-prompts: Input should be greater than or equal to 1$"):
        build(GeneratorConfig, {"chunk_prompts": 0, "group_size": 3})
    assert pick(GeneratorConfig, {"chunk_prompts": 3, "group_size": 3}) == {"chunk_prompts": 3}


def test_parse_int_list():
    assert parse_int_list("0,1,3") == [0, 1, 3]
    assert parse_int_list("2-5") == [2, 3, 4, 5]
    assert parse_int_list("0, 2-4") == [0, 2, 3, 4]
    with pytest.raises(typer.BadParameter):
        parse_int_list("a-b")


def _readme_commands(name: str) -> list[list[str]]:
    """The `groupforge <name> ...` command lines of the README and docs/ (continuation lines joined)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages).replace("\\\n", " ")
    lines = re.findall(rf"^(?:\.venv/bin/)?groupforge {name} (.*)$", text, flags=re.MULTILINE)
    return [shlex.split(line.split("#")[0]) for line in lines]


@pytest.mark.parametrize("command", ["generate", "train", "tune"])
def test_the_readme_command_lines_parse(command):
    argvs = _readme_commands(command)
    assert argvs, f"no page shows `groupforge {command}`"
    for argv in argvs:
        COMMANDS[command].make_context(command, argv)  # raises on an unknown or malformed flag
