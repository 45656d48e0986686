"""The toy's short-answer task families (pipelines/toy/families.py: multiply, reverse, sort, max):
their problems, references and rewards, the build flags, and each family's warm start.

References are checked against an independent computation from the prompt text. Each family's
default toy is built once into runs/toy-<family> (cached there across test runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.rewards import get_reward
from pipelines.toy.build import EVAL_FILE, META_FILE, TRAIN_FILE, build_toy, default_out
from pipelines.toy.families import FAMILIES, example
from pipelines.toy.task import (
    TASK_DEFAULTS,
    TASKS,
    ToyConfig,
    longest_prompt,
    longest_response,
    make_problems,
    supervised_responses,
    variant_config,
)
from tests.helpers import REPO, build_lock

FAMILY_NAMES = ("multiply", "reverse", "sort", "max")
TRAIN_SIZES = (256, 1024, 8192)


def solve(task: str, prompt: str) -> str:
    """The reference of a prompt, computed from its text alone (not with the family's code)."""
    body = prompt.removesuffix("=")
    if task == "multiply":
        number, digit = body.split("*")
        return str(int(number) * int(digit))
    digits = body[body.index("(") + 1 : -1]
    if task == "reverse":
        return "".join(digits[i] for i in range(len(digits) - 1, -1, -1))
    if task == "sort":  # a counting sort
        return "".join(d * digits.count(d) for d in "0123456789")
    if task == "max":
        a, b = digits.split(",")
        return a if (len(a), a) >= (len(b), b) else b
    raise AssertionError(task)


def perturbed(response: str) -> str:
    """The response with its last digit changed: a near miss."""
    return response[:-1] + str((int(response[-1]) + 1) % 10)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request) -> str:
    return request.param


# --- problems, references, rewards (no build) ---------------------------------------------


def test_the_families_are_tasks_with_their_own_defaults_and_folders():
    assert set(FAMILY_NAMES) <= set(TASKS) and TASKS[0] == "addition"
    for name in FAMILY_NAMES:
        config = ToyConfig(task=name)
        assert config.n_train == 8192 and config.target_accuracy == 0.30
        assert (config.hidden_size, config.num_layers, config.num_heads) == (128, 2, 4)  # addition's model
        assert ToyConfig.model_validate(config.model_dump()) == config
        assert default_out(config) == Path(f"runs/toy-{name}")
        assert default_out(variant_config("small", name)) == Path(f"runs/toy-{name}-small")
        assert variant_config("deep", name).num_layers == 4
        prompt, response = example(name)
        assert solve(name, prompt) == response and f"{name}: {prompt!r} -> {response!r}" in (
            ToyConfig.model_fields["task"].description)
    assert set(TASK_DEFAULTS) == set(TASKS) - {"addition"}


def test_problems_are_a_function_of_the_seed(family: str):
    config = ToyConfig(task=family, n_train=1024)
    train, eval_ = make_problems(config, seed=0)
    again = make_problems(config, seed=0)
    assert train.equals(again[0]) and eval_.equals(again[1])
    other_train, other_eval = make_problems(config, seed=1)
    assert not eval_.equals(other_eval) and not train.equals(other_train)


def test_every_train_size_shares_one_eval_set_disjoint_from_train(family: str):
    tables = {n: make_problems(ToyConfig(task=family, n_train=n), seed=0) for n in TRAIN_SIZES}
    eval_ = tables[TRAIN_SIZES[0]][1]
    assert eval_.num_rows == 400
    largest = tables[TRAIN_SIZES[-1]][0]
    for n, (train, other_eval) in tables.items():
        assert train.num_rows == n and other_eval.equals(eval_)
        assert train.equals(largest.slice(0, n))  # a smaller train set is the start of a larger one
    prompts = largest.column("prompt").to_pylist()
    eval_prompts = eval_.column("prompt").to_pylist()
    assert len(set(prompts)) == len(prompts) and len(set(eval_prompts)) == len(eval_prompts)
    assert not set(prompts) & set(eval_prompts)


def test_references_are_right_and_sequences_fit_the_model(family: str):
    config = ToyConfig(task=family)
    train, eval_ = make_problems(config, seed=0)
    for table in (train, eval_):
        for prompt, reference in zip(table.column("prompt").to_pylist(), table.column("reference").to_pylist()):
            assert reference == solve(family, prompt), prompt
    responses = supervised_responses(train, config, seed=0)
    assert responses == train.column("reference").to_pylist()  # the warm start learns the references
    prompts = train.column("prompt").to_pylist() + eval_.column("prompt").to_pylist()
    assert max(len(p) for p in prompts) + 1 == longest_prompt(config)  # + BOS
    assert max(len(r) for r in responses) == longest_response(config)
    assert longest_prompt(config) + longest_response(config) + 1 <= config.max_position_embeddings
    used = set("".join(prompts + responses))
    assert used <= set(FAMILIES[family].characters)


def test_the_tokenizer_has_every_character_of_the_family(family: str):
    from pipelines.toy.model import make_tokenizer

    config = ToyConfig(task=family)
    tokenizer = make_tokenizer(config.max_position_embeddings, FAMILIES[family].characters)
    train, _ = make_problems(config.model_copy(update={"n_train": 256}), seed=0)
    for prompt, reference in zip(train.column("prompt").to_pylist(), train.column("reference").to_pylist()):
        ids = tokenizer(prompt + reference).input_ids
        assert tokenizer.unk_token_id not in ids and len(ids) == 1 + len(prompt + reference)
        assert tokenizer.decode(ids, skip_special_tokens=True) == prompt + reference


def test_exact_match_is_one_on_the_supervised_response_and_zero_on_a_near_miss(family: str):
    config = ToyConfig(task=family, n_train=256)
    train, _ = make_problems(config, seed=0)
    prompts, references = train.column("prompt").to_pylist(), train.column("reference").to_pylist()
    responses = supervised_responses(train, config, seed=0)
    near_misses = [perturbed(r) for r in responses]
    reward = get_reward("exact_match")
    assert reward(prompts, responses, reference=references) == [1.0] * 256
    assert reward(prompts, near_misses, reference=references) == [0.0] * 256
    assert reward(prompts, [r + "0" for r in responses], reference=references) == [0.0] * 256
    got = reward.vectorized(pa.chunked_array([near_misses + responses]), pa.chunked_array([references * 2]))
    assert got.to_pylist() == [0.0] * 256 + [1.0] * 256


@pytest.mark.parametrize("fields,message", [
    ({"task": "multiply", "n_train": 8511}, "n_train=8511 is more than the 8510 prompts left after n_eval=400 "
                                            "(operands 10..999)"),
    ({"task": "max", "operand_min": 50, "operand_max": 40}, "operands 50..40: need 0 <= operand_min <= operand_max"),
    ({"task": "reverse", "label_noise": 0.1}, "label_noise is for the addition task only, not reverse"),
])
def test_a_family_config_that_cannot_be_built_is_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ToyConfig(**fields)


def test_unknown_task_is_one_error_line():
    with pytest.raises(ValueError, match=r"^unknown toy task 'divide': one of addition, scratchpad, multiply, "):
        variant_config("default", "divide")


# --- groupforge toy build ------------------------------------------------------------------


def cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", "toy", "build", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_the_build_flags_pick_the_family_and_its_train_size(tmp_path: Path):
    done = cli("--task", "sort", "--n-train", "256", "--max-steps", "2", "--eval-every", "2", "--n-eval", "20",
               "--out", str(tmp_path / "toy"))
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "toy" / META_FILE).read_text())
    assert ToyConfig.model_validate(meta["config"]) == ToyConfig(task="sort", n_train=256, max_steps=2,
                                                                 eval_every=2, n_eval=20)
    assert meta["rows"] == {"train": 256, "eval": 20} and meta["task"] == FAMILIES["sort"].description
    assert meta["model"]["vocab_size"] == 4 + len(FAMILIES["sort"].characters)
    train = pq.read_table(tmp_path / "toy" / TRAIN_FILE)
    assert all(p.startswith("sort(") for p in train.column("prompt").to_pylist())

    refused = cli("--task", "sort", "--n-train", "100000000", "--out", str(tmp_path / "big"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: n_train=100000000 is more than the 1048176 prompts left after n_eval=400")
    assert not (tmp_path / "big").exists()


# --- the warm start of each family (slow: ~15-40 s a family once, then cached in runs/toy-<family>) ----


@pytest.mark.slow
@pytest.mark.parametrize("task", FAMILY_NAMES)
def test_the_warm_start_leaves_room_to_learn(task: str):
    config = ToyConfig(task=task)
    out = REPO / default_out(config)
    with build_lock(out):
        build_toy(out, progress=False, config=config)
    # a cached build of an older family definition would pass unseen: its tables must be today's
    train, eval_ = make_problems(config, seed=0)
    assert pq.read_table(out / TRAIN_FILE).equals(train) and pq.read_table(out / EVAL_FILE).equals(eval_), (
        f"{out} was built from another {task} family: bump TOY_VERSION")
    meta = json.loads((out / META_FILE).read_text())
    assert meta["warm_start"]["steps"] < config.max_steps  # stopped on the target, not the cap
    assert config.target_accuracy <= meta["eval_greedy_accuracy"] <= config.target_accuracy + 0.2
    assert 0 < meta["eval_greedy_accuracy"] < 1
    # room for group RL: at temperature 1, 8 samples hold a right answer for a quarter of the
    # prompts or more (errors compound over 4-8 answer tokens: pass@8 is 0.3-0.5 here, 0.69 on addition)
    assert 0.25 <= meta["eval_pass_at_8"] < 1
    assert meta["rows"] == {"train": 8192, "eval": 400}
