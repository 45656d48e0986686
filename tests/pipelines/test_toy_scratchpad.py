"""The toy's long-response task (pipelines/toy/build.py, `--task scratchpad`) and its rewards
(curation/rewards/scratchpad.py): real builds, real transformers, the real CLI.

The shipped task is built once into runs/toy-scratchpad (cached there across test runs, and
the folder pipelines/specs/toy-scratchpad-grpo.toml reads) by `make test-exhaustive`; `make test`
checks builds of a few warm-start steps.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.rewards import get_reward
from curation.rewards.scratchpad import WELL_FORMED, final_answer, scratchpad_solution
from pipelines.toy.build import META_FILE, build_toy, default_out
from pipelines.toy.families import FAMILIES
from pipelines.toy.model import greedy_responses, make_tokenizer
from pipelines.toy.task import TASK_DEFAULTS, ToyConfig, make_problems, supervised_responses, variant_config
from tests.helpers import REPO, build_lock, check_same_seed_same_bytes, groupforge_in_process

SCRATCHPAD = ToyConfig(task="scratchpad")
# A few warm-start steps on 20 eval prompts and 512 train prompts: the whole build in seconds.
TINY = ToyConfig(task="scratchpad", max_steps=3, eval_every=3, n_eval=20, n_train=512)
SPEC = REPO / "pipelines" / "specs" / "toy-scratchpad-grpo.toml"


@pytest.fixture(scope="module")
def scratchpad_dir() -> Path:
    out = REPO / default_out(SCRATCHPAD)
    with build_lock(out):
        return build_toy(out, progress=False, config=SCRATCHPAD)


# --- the task and its rewards (no build) ----------------------------------------------------


def test_the_task_is_its_own_config_and_leaves_addition_as_it_was():
    assert "task" not in ToyConfig().model_dump()  # the addition toy's cache key is what it was
    dumped = SCRATCHPAD.model_dump()
    assert dumped["task"] == "scratchpad" and {k: dumped[k] for k in TASK_DEFAULTS["scratchpad"]} == {
        "operand_min": 100, "operand_max": 999, "n_train": 20000, "hidden_size": 64, "num_heads": 2,
        "intermediate_size": 256, "target_accuracy": 0.25, "num_threads": 1}
    assert ToyConfig.model_validate(dumped) == SCRATCHPAD  # toy.json's config reads back as the same config
    assert ToyConfig(task="scratchpad", operand_max=500).operand_min == 100  # a given field beats the task's
    assert default_out(SCRATCHPAD) == Path("runs/toy-scratchpad") and default_out(ToyConfig()) == Path("runs/toy")
    deep = variant_config("deep", "scratchpad")
    assert deep.num_layers == 4 and deep.operand_min == 100 and default_out(deep) == Path("runs/toy-scratchpad-deep")
    with pytest.raises(ValueError, match="^toy variant 'noisy' of the scratchpad task: label_noise is for the "
                                         "addition task only, not scratchpad$"):
        variant_config("noisy", "scratchpad")
    with pytest.raises(ValueError, match="max_position_embeddings=40 is shorter than the longest scratchpad "
                                         r"sequence \(46 tokens with operands up to 999\)"):
        ToyConfig(task="scratchpad", max_position_embeddings=40)


def test_reference_solutions_are_20_to_60_tokens_and_end_in_the_reference():
    train, eval_ = make_problems(SCRATCHPAD, seed=0)
    assert (train.num_rows, eval_.num_rows) == (20000, 400)
    tokenizer = make_tokenizer(SCRATCHPAD.max_position_embeddings, FAMILIES["scratchpad"].characters)
    responses = supervised_responses(train, SCRATCHPAD, seed=0)
    references = train.column("reference").to_pylist()
    lengths = [len(ids) + 1 for ids in tokenizer(responses, add_special_tokens=False).input_ids]  # + EOS
    assert (min(lengths), max(lengths)) == (36, 37)  # 3 steps of 8 + 3 spaces + "#### " + 3-4 digits + EOS
    assert 20 <= min(lengths) and max(lengths) <= 60
    for prompt, response, reference in zip(train.column("prompt").to_pylist(), responses, references):
        a, b = map(int, prompt.removesuffix("=").split("+"))
        assert reference == str(a + b) and final_answer(response) == reference and WELL_FORMED.match(response)
    assert tokenizer.decode(tokenizer(responses[0]).input_ids, skip_special_tokens=True) == responses[0]
    assert scratchpad_solution(999, 999) == "9+9+0=18 9+9+1=19 9+9+1=19 #### 1998"


def test_rewards_give_one_on_the_reference_solution_and_zero_on_a_wrong_answer():
    train, _ = make_problems(SCRATCHPAD, seed=0)
    train = train.slice(0, 64)
    prompts, references = train.column("prompt").to_pylist(), train.column("reference").to_pylist()
    solutions = supervised_responses(train, SCRATCHPAD, seed=0)
    wrong_answer = [s.rpartition(" ")[0] + " " + str(int(r) + 1) for s, r in zip(solutions, references)]
    no_marker = [s.replace("####", "") for s in solutions]
    answer, steps = get_reward("final_answer"), get_reward("scratchpad_steps")

    assert answer(prompts, solutions, reference=references) == [1.0] * 64
    assert answer(prompts, wrong_answer, reference=references) == [0.0] * 64
    assert answer(prompts, no_marker, reference=references) == [0.0] * 64
    assert answer(prompts[:2], solutions[:2], reference=[None, references[1]]) == [None, 1.0]
    for completions, expected in [(solutions, 1.0), (wrong_answer, 0.0), (no_marker, 0.0)]:
        got = answer.vectorized(pa.chunked_array([completions]), pa.chunked_array([references]))
        assert got.to_pylist() == [expected] * 64

    assert steps(prompts, solutions) == [1.0] * 64
    assert steps(prompts, wrong_answer) == [1.0] * 64  # the steps are right, only the answer is not
    one_slip = [s.replace("+0=", "+1=", 1) for s in solutions]  # the ones column never has a carry in
    assert steps(prompts, one_slip) == [pytest.approx(2 / 3)] * 64
    assert steps(["hello"], [solutions[0]]) == [None]


# --- builds ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_same_seed_gives_identical_files(tmp_path: Path):
    a = check_same_seed_same_bytes(tmp_path, TINY)
    meta = json.loads((a / META_FILE).read_text())
    assert meta["config"] == TINY.model_dump() and meta["rows"] == {"train": 512, "eval": 20}
    assert meta["model"]["vocab_size"] == 4 + len(FAMILIES["scratchpad"].characters) == 20
    assert meta["response_tokens"]["min"] >= 20 and meta["response_tokens"]["max"] <= 60
    assert "wrong_supervised_answers" not in meta


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_the_build_flag_picks_the_task(tmp_path: Path):
    done = groupforge_in_process("toy", "build", "--task", "scratchpad", "--max-steps", "2", "--eval-every", "2",
                                 "--n-eval", "20", "--n-train", "256", "--out", tmp_path / "toy")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "toy" / META_FILE).read_text())
    assert ToyConfig.model_validate(meta["config"]) == SCRATCHPAD.model_copy(
        update={"max_steps": 2, "eval_every": 2, "n_eval": 20, "n_train": 256})
    assert pq.read_table(tmp_path / "toy" / "eval.parquet").column("prompt")[0].as_py().count("+") == 1
    refused = groupforge_in_process("toy", "build", "--task", "scratchpad", "--variant", "noisy",
                                    "--out", tmp_path / "noisy")
    assert refused.returncode == 2 and refused.stderr.startswith("error: toy variant 'noisy' of the scratchpad "
                                                                 "task: label_noise is for the addition task only")
    assert not (tmp_path / "noisy").exists()


# --- the shipped build (~2-3 minutes once, then cached in runs/toy-scratchpad; the tiny builds above
# cover the build itself): `make test-exhaustive` builds it, as it builds the toy's variants and families ---


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_warm_start_learns_the_format_but_not_all_the_arithmetic(scratchpad_dir: Path):
    meta = json.loads((scratchpad_dir / META_FILE).read_text())
    assert meta["config"] == SCRATCHPAD.model_dump() and meta["task"].startswith("addition with a column")
    assert meta["warm_start"]["steps"] < SCRATCHPAD.max_steps  # stopped on the target, not the cap
    assert 0.20 <= meta["eval_greedy_accuracy"] <= 0.45  # room to learn
    assert meta["eval_well_formed"] >= 0.9  # the format is learned
    # Room for group RL at the spec's temperature: samples keep the format, and the right answer
    # is often among 8 of them where the greedy one is wrong.
    samples = meta["eval_samples"]
    assert samples["temperature"] == tomllib.loads(SPEC.read_text())["generator"]["temperature"] == 0.7
    assert samples["well_formed"] >= 0.9 and samples["pass_at_8"] >= meta["eval_greedy_accuracy"] + 0.15
    assert 0.05 <= samples["accuracy"] <= meta["eval_greedy_accuracy"]
    assert meta["response_tokens"] == {"min": 36, "max": 37, "mean": pytest.approx(36.6, abs=0.2)}

    greedy, references = greedy_responses(scratchpad_dir / "model", scratchpad_dir / "eval.parquet",
                                          config=SCRATCHPAD)
    scores = get_reward("final_answer")(None, greedy, reference=references)
    assert sum(scores) / len(scores) == pytest.approx(meta["eval_greedy_accuracy"], abs=0.01)
    assert sum(WELL_FORMED.match(g) is not None for g in greedy) / len(greedy) == pytest.approx(
        meta["eval_well_formed"], abs=0.01)

    before = {p: p.stat().st_mtime_ns for p in scratchpad_dir.rglob("*") if p.is_file()}
    assert build_toy(scratchpad_dir, progress=False, config=SCRATCHPAD) == scratchpad_dir  # a cache hit
    assert {p: p.stat().st_mtime_ns for p in scratchpad_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_shipped_spec_runs_two_rounds(scratchpad_dir: Path, tmp_path: Path):
    args = ["--set", "run.rounds=2", "--set", "run.steps_per_round=1", "--set", "prompts.per_round=16",
            "--set", "prompts.eval_limit=50", "--set", "train.batch_size=128", "--run-dir", str(tmp_path / "run")]
    done = groupforge_in_process("run", SPEC, *args)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r.get("event") == "round"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    greedy, references = greedy_responses(scratchpad_dir / "model", scratchpad_dir / "eval.parquet", limit=50,
                                          config=SCRATCHPAD)
    start = sum(final_answer(g) == r for g, r in zip(greedy, references)) / 50
    assert rounds[0]["eval_accuracy"] == pytest.approx(start, abs=0.04)  # the loop's metric is the build's
    assert rounds[-1]["eval_accuracy"] is not None and 0.0 < rounds[-1]["eval_accuracy"] < 1.0
