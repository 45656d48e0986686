"""The toy's options and named variants (pipelines/toy/task.py): each option changes the build as it
says, the `groupforge toy build` flags are the ToyConfig fields, bad configs are one-line errors.

Builds here are tiny (a few warm-start steps, 50 eval prompts); the full variants are built and
measured by the slow test at the end (cached in runs/toy-<variant>).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from rich.markup import escape

from pipelines.cli.main import app
from pipelines.cli.options import flag_name
from pipelines.toy.build import META_FILE, build_toy, default_out
from pipelines.toy.task import (
    VARIANTS,
    VLLM_CPU_HEAD_SIZES,
    ToyConfig,
    make_problems,
    supervised_answers,
    variant_config,
)
from tests.helpers import REPO, build_lock, groupforge_in_process

TOY_BUILD = typer.main.get_command(app).commands["toy"].commands["build"]
# A few warm-start steps on 50 eval prompts: the whole build in seconds.
TINY = dict(max_steps=4, eval_every=2, n_eval=50)


def cli(*argv: str) -> subprocess.CompletedProcess:
    return groupforge_in_process("toy", "build", *argv)


# --- each option changes the build as it says ------------------------------------------------


def test_n_train_takes_the_first_train_prompts_and_leaves_eval_alone():
    full_train, full_eval = make_problems(ToyConfig(), seed=0)
    train, eval_ = make_problems(ToyConfig(n_train=512), seed=0)
    assert train.num_rows == 512 and train.equals(full_train.slice(0, 512))
    assert eval_.equals(full_eval) and eval_.num_rows == 400
    assert make_problems(ToyConfig(n_train=7700), seed=0)[0].equals(full_train)


def test_label_noise_makes_that_fraction_of_supervised_answers_wrong_by_the_seed():
    train, _ = make_problems(ToyConfig(), seed=0)
    references = train.column("reference").to_pylist()
    assert supervised_answers(train, ToyConfig(), seed=0) == references  # no noise: the references

    noisy = ToyConfig(label_noise=0.2)
    answers = supervised_answers(train, noisy, seed=0)
    wrong = [i for i, (a, r) in enumerate(zip(answers, references)) if a != r]
    assert len(wrong) == round(0.2 * 7700) == 1540
    assert all(1 <= abs(int(answers[i]) - int(references[i])) <= 10 for i in wrong)  # a slip, a number
    assert supervised_answers(train, noisy, seed=0) == answers  # deterministic given the seed
    other = supervised_answers(train, noisy, seed=1)
    assert {i for i, (a, r) in enumerate(zip(other, references)) if a != r} != set(wrong)


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_shape_train_size_and_noise_reach_the_built_files(tmp_path: Path):
    config = ToyConfig(**TINY, n_train=300, num_layers=1, hidden_size=64, num_heads=2, intermediate_size=128,
                       label_noise=0.2)
    out = build_toy(tmp_path / "toy", seed=0, progress=False, config=config)
    model_config = json.loads((out / "model" / "config.json").read_text())
    assert (model_config["num_hidden_layers"], model_config["hidden_size"], model_config["num_attention_heads"],
            model_config["intermediate_size"], model_config["head_dim"]) == (1, 64, 2, 128, 32)
    train = pq.read_table(out / "train.parquet")
    assert train.num_rows == 300 and pq.read_table(out / "eval.parquet").num_rows == 50
    for prompt, reference in zip(train.column("prompt").to_pylist(), train.column("reference").to_pylist()):
        a, b = prompt.removesuffix("=").split("+")
        assert reference == str(int(a) + int(b))  # the noise is in the warm start only, never in the rewards
    meta = json.loads((out / META_FILE).read_text())
    assert meta["config"] == config.model_dump() and meta["config"]["n_train"] == 300
    assert meta["rows"] == {"train": 300, "eval": 50} and meta["wrong_supervised_answers"] == 60
    assert meta["model"]["head_dim"] == 32
    assert meta["model"]["parameters"] == sum(
        n * m for n, m in [(18, 64), (64, 18), (64, 1)]) + 1 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64)


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_target_accuracy_is_where_the_warm_start_stops(tmp_path: Path):
    tiny = ToyConfig(**TINY, n_train=256, num_layers=1)
    stops_at_once = build_toy(tmp_path / "a", progress=False, config=tiny.model_copy(update={"target_accuracy": 0}))
    unreachable = build_toy(tmp_path / "b", progress=False, config=tiny.model_copy(update={"target_accuracy": 1.5}))
    assert json.loads((stops_at_once / META_FILE).read_text())["warm_start"]["steps"] == TINY["eval_every"]
    assert json.loads((unreachable / META_FILE).read_text())["warm_start"]["steps"] == TINY["max_steps"]


# --- configs: checked, keyed, variants -------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({"hidden_size": 96}, "head_dim = hidden_size / num_heads = 96 / 4 = 24 is not a head size vLLM's CPU attention"),
    ({"hidden_size": 128, "num_heads": 3}, "hidden_size 128 not divisible by num_heads 3"),
    ({"n_train": 7701}, "n_train=7701 is more than the 7700 prompts left after n_eval=400 (operands 10..99)"),
    ({"n_eval": 8100}, "n_eval=8100 must be between 1 and 8099"),
])
def test_a_config_vllm_cannot_load_or_split_is_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ToyConfig(**fields)


def test_the_default_key_is_unchanged_and_every_other_field_is_in_it(toy_dir: Path):
    """The fields added later leave the dump at their default: runs/toy built before them stays cached."""
    recorded = json.loads((toy_dir / META_FILE).read_text())["config"]
    assert recorded == ToyConfig().model_dump() and "n_train" not in recorded and "label_noise" not in recorded
    for name, value in [("n_train", 512), ("label_noise", 0.1)]:
        assert ToyConfig(**{name: value}).model_dump()[name] == value


def test_variants_are_valid_distinct_and_each_has_its_own_folder(toy_dir: Path):
    assert VARIANTS["default"] == ToyConfig() and len(VARIANTS) >= 4
    assert len({c.model_dump_json() for c in VARIANTS.values()}) == len(VARIANTS)
    for name, config in VARIANTS.items():
        assert ToyConfig.model_validate(config.model_dump()) == config  # passes every check
        assert 0.2 <= config.target_accuracy <= 0.4
        assert default_out(config) == Path("runs") / ("toy" if name == "default" else f"toy-{name}")
        assert variant_config(name) is config
    assert default_out(ToyConfig(num_layers=3)).name.startswith("toy-")
    assert default_out(ToyConfig(num_layers=3)) not in {default_out(c) for c in VARIANTS.values()}
    with pytest.raises(ValueError, match=r"^unknown toy variant 'huge': one of default, deep, noisy, small"):
        variant_config("huge")


def test_the_head_sizes_are_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(VLLM_CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


def test_importing_the_toy_loads_no_torch():
    code = "import sys, pipelines.toy.build; print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


# --- groupforge toy build ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,info", ToyConfig.model_fields.items(), ids=list(ToyConfig.model_fields))
def test_every_toy_field_is_a_build_flag_with_its_default_and_help(name, info):
    option = {opt: p for p in TOY_BUILD.params for opt in p.opts}.get(flag_name(name))
    assert option is not None, f"groupforge toy build has no {flag_name(name)}"
    assert option.help == escape(info.description) and option.default == info.default


def test_the_build_flags_list_the_variants_and_keep_out_seed_force():
    options = {opt: p for p in TOY_BUILD.params for opt in p.opts}
    assert {"--out", "--seed", "--force", "--variant"} <= options.keys()
    assert all(name in options["--variant"].help for name in VARIANTS)


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_cli_flags_override_the_variants_fields(tmp_path: Path):
    done = cli("--variant", "small", "--n-train", "200", "--max-steps", "2", "--eval-every", "2", "--n-eval", "50",
               "--out", str(tmp_path / "toy"), "--seed", "3")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "toy" / META_FILE).read_text())
    expected = VARIANTS["small"].model_copy(update={"n_train": 200, "max_steps": 2, "eval_every": 2, "n_eval": 50})
    assert meta["seed"] == 3 and ToyConfig.model_validate(meta["config"]) == expected
    assert meta["rows"] == {"train": 200, "eval": 50}


@pytest.mark.parametrize("argv,message", [
    (["--hidden-size", "96"], "error: head_dim = hidden_size / num_heads = 96 / 4 = 24 is not a head size"),
    (["--n-train", "9000"], "error: n_train=9000 is more than the 7700 prompts left after n_eval=400"),
    (["--n-train", "0"], "error: --n-train: Input should be greater than or equal to 1"),
    (["--variant", "huge"], "error: unknown toy variant 'huge': one of default, deep, noisy, small"),
])
def test_a_bad_build_flag_is_one_error_line(tmp_path: Path, argv, message):
    done = cli(*argv, "--out", str(tmp_path / "toy"))
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "toy").exists()


# --- the real variants (cached in runs/toy-<variant>) ---------------------------------------------


# Each build takes 1-2 minutes on 2 cores (the tiny builds above cover the build itself):
# `make test-exhaustive` builds them all
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "default"])
def test_each_variant_reaches_its_warm_start_and_leaves_room_for_group_rl(variant):
    config = VARIANTS[variant]
    with build_lock(REPO / default_out(config)):
        out = build_toy(REPO / default_out(config), progress=False, config=config)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["warm_start"]["steps"] < config.max_steps  # stopped on the target, not the cap
    assert config.target_accuracy <= meta["eval_greedy_accuracy"] <= config.target_accuracy + 0.1
    assert meta["eval_pass_at_8"] >= meta["eval_greedy_accuracy"] + 0.2
    assert meta["rows"] == {"train": config.n_train or 7700, "eval": 400}
    assert meta.get("wrong_supervised_answers", 0) == round(config.label_noise * meta["rows"]["train"])
