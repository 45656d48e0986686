"""The embedded toy (pipelines/toy/build.py): real build, real transformers, real vLLM.

`toy_dir` (tests/conftest.py) builds runs/toy once, cached by config and seed,
so every test here and elsewhere shares one build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from pipelines.toy.build import META_FILE, build_toy
from pipelines.toy.model import CHARACTERS, eval_greedy_accuracy, generate_responses
from pipelines.toy.task import VLLM_CPU_HEAD_SIZES, ToyConfig, make_problems
from tests.helpers import check_same_seed_same_bytes

ROOT = Path(__file__).resolve().parents[2]
# A build that stops after a few steps: the whole pipeline (data, warm start, save,
# measure) in a few seconds, for the determinism and atomicity checks.
TINY = ToyConfig(max_steps=3, eval_every=3, n_eval=50)


def load_fp32(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# --- what a build leaves behind -----------------------------------------------------------


def test_build_writes_an_hf_folder_tables_and_meta(toy_dir: Path):
    model_dir = toy_dir / "model"
    hf_files = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    for name in hf_files:
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.glob("*.bin")) and not list(model_dir.glob("*.pt")), "weights must not be pickled"
    assert (toy_dir / "train.parquet").is_file() and (toy_dir / "eval.parquet").is_file()

    meta = json.loads((toy_dir / META_FILE).read_text())
    assert meta["seed"] == 0 and meta["config"] == ToyConfig().model_dump()
    assert 0.15 <= meta["eval_greedy_accuracy"] <= 0.6
    # Room for group RL: the right answer is often among 8 samples at temperature 1.
    assert meta["eval_pass_at_8"] >= meta["eval_greedy_accuracy"] + 0.2
    # The warm start stopped on the accuracy rule, not on the step cap.
    assert meta["warm_start"]["steps"] < ToyConfig().max_steps


def test_tables_hold_disjoint_correct_addition_problems(toy_dir: Path):
    train = pq.read_table(toy_dir / "train.parquet")
    eval_ = pq.read_table(toy_dir / "eval.parquet")
    assert train.column_names == ["prompt", "reference"] == eval_.column_names
    assert eval_.num_rows == ToyConfig().n_eval == 400
    assert train.num_rows + eval_.num_rows == 90 * 90  # every a+b with a, b in 10..99, once

    train_prompts, eval_prompts = set(train.column("prompt").to_pylist()), set(eval_.column("prompt").to_pylist())
    assert len(train_prompts) == train.num_rows and len(eval_prompts) == eval_.num_rows
    assert not train_prompts & eval_prompts
    for table in (train, eval_):
        for prompt, reference in zip(table.column("prompt").to_pylist(), table.column("reference").to_pylist()):
            a, b = prompt.removesuffix("=").split("+")
            assert prompt.endswith("=") and reference == str(int(a) + int(b))


def test_problem_split_is_a_function_of_the_seed(toy_dir: Path):
    train0, eval0 = make_problems(ToyConfig(), seed=0)
    again_train, again_eval = make_problems(ToyConfig(), seed=0)
    assert train0.equals(again_train) and eval0.equals(again_eval)
    assert eval0.equals(pq.read_table(toy_dir / "eval.parquet"))
    assert train0.equals(pq.read_table(toy_dir / "train.parquet"))
    _, eval1 = make_problems(ToyConfig(), seed=1)
    assert not eval0.equals(eval1)


# --- tokenizer and model --------------------------------------------------------------------


def test_tokenizer_is_character_level_with_bos_and_round_trips(toy_dir: Path):
    tokenizer = load_tokenizer(toy_dir / "model")
    ids = tokenizer("37+48=").input_ids
    assert len(ids) == 1 + len("37+48=") and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "37+48="
    text = CHARACTERS + "9876"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    answer = tokenizer("85", add_special_tokens=False).input_ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "85"
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}) == 4
    assert tokenizer("7/3").input_ids[2] == tokenizer.unk_token_id


def test_model_is_a_small_untied_llama(toy_dir: Path):
    model = load_fp32(toy_dir / "model")
    config = model.config
    assert config.model_type == "llama" and config.tie_word_embeddings is False
    assert config.head_dim in VLLM_CPU_HEAD_SIZES
    assert config.max_position_embeddings == 64
    assert config.vocab_size == len(load_tokenizer(toy_dir / "model"))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.data_ptr() != head.data_ptr() and not torch.equal(embed, head)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000

    generation = json.loads((toy_dir / "model" / "generation_config.json").read_text())
    tokenizer = load_tokenizer(toy_dir / "model")
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    assert generation["pad_token_id"] == tokenizer.pad_token_id
    assert generation["bos_token_id"] == tokenizer.bos_token_id


def test_greedy_accuracy_is_partial_and_matches_the_recorded_value(toy_dir: Path):
    accuracy = eval_greedy_accuracy(toy_dir / "model", toy_dir / "eval.parquet")
    assert 0.15 <= accuracy <= 0.6
    # Same computation as the build's; only a different thread count could flip a near-tie.
    assert accuracy == pytest.approx(json.loads((toy_dir / META_FILE).read_text())["eval_greedy_accuracy"], abs=0.01)
    # `limit` reads the first rows only: 10 prompts give a multiple of 0.1.
    assert round(eval_greedy_accuracy(toy_dir / "model", toy_dir / "eval.parquet", limit=10) * 10, 6) % 1 == 0


def test_responses_stop_at_eos(toy_dir: Path):
    model, tokenizer = load_fp32(toy_dir / "model"), load_tokenizer(toy_dir / "model")
    prompts = pq.read_table(toy_dir / "eval.parquet").column("prompt").to_pylist()[:32]
    for (response,) in generate_responses(model, tokenizer, prompts):
        assert response.isdigit() and 1 <= len(response) <= 3, response


# --- caching, determinism, atomic writes -------------------------------------------------------


def test_second_build_is_a_cache_hit(toy_dir: Path):
    """No retraining: every file of the toy is left as it was (no wall-time assertion)."""
    before = {p: p.stat().st_mtime_ns for p in toy_dir.rglob("*") if p.is_file()}
    assert build_toy(toy_dir, progress=False) == toy_dir
    assert {p: p.stat().st_mtime_ns for p in toy_dir.rglob("*") if p.is_file()} == before


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_same_seed_gives_identical_files_and_another_config_rebuilds(tmp_path: Path):
    a = check_same_seed_same_bytes(tmp_path, TINY)

    # A different config (or seed) at the same place is rebuilt and replaces the old build.
    before = json.loads((a / META_FILE).read_text())
    build_toy(a, seed=3, progress=False, config=TINY.model_copy(update={"max_steps": 4, "eval_every": 4}))
    after = json.loads((a / META_FILE).read_text())
    assert before["warm_start"]["steps"] == 3 and after["warm_start"]["steps"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"], "no temp folders left behind"


def test_a_failed_build_leaves_nothing(tmp_path: Path):
    with pytest.raises(ValueError, match="divisible"):
        build_toy(tmp_path / "toy", progress=False, config=TINY.model_copy(update={"num_heads": 3}))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:toy warm start ended")
def test_a_killed_build_leaves_no_toy_and_the_rerun_builds_it(tmp_path: Path):
    out = tmp_path / "toy"
    code = (
        "import sys; from pipelines.toy.build import build_toy; from pipelines.toy.task import ToyConfig;"
        f"build_toy({str(out)!r}, progress=False, config=ToyConfig(max_steps=100000, target_accuracy=2.0))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".toy.building-*/train.parquet")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the warm start
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == [".toy.building"]
    assert build_toy(out, progress=False, config=TINY) == out
    assert json.loads((out / META_FILE).read_text())["warm_start"]["steps"] == 3
    # The rerun removed the killed build's temp folder (its process is gone).
    assert [p.name for p in tmp_path.iterdir()] == ["toy"]


# --- vLLM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(toy_dir: Path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    llm = vllm.LLM(model=str(toy_dir / "model"), enforce_eager=True, dtype="float32", seed=0)
    yield llm
    del llm
    import gc

    gc.collect()


def greedy_with_margins(model, prompt_ids: list[int], max_new_tokens: int = 8) -> tuple[list[int], float]:
    """Greedy tokens from plain fp32 forwards, and the smallest top-1 minus top-2 logit gap
    along the way (a near-tie may legitimately break differently in another kernel)."""
    ids, margin = list(prompt_ids), float("inf")
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2).values
            margin = min(margin, float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
            if ids[-1] == model.config.eos_token_id:
                break
    return ids[len(prompt_ids) :], margin


def test_vllm_loads_the_toy_and_greedy_matches_transformers(toy_dir: Path, vllm_engine):
    from vllm import SamplingParams

    model, tokenizer = load_fp32(toy_dir / "model"), load_tokenizer(toy_dir / "model")
    prompts = pq.read_table(toy_dir / "eval.parquet").column("prompt").to_pylist()[:24]
    outputs = vllm_engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outputs):
        assert list(out.prompt_token_ids) == tokenizer(prompt).input_ids  # BOS prepended by vLLM too
        expected, margin = greedy_with_margins(model, out.prompt_token_ids)
        assert out.outputs[0].finish_reason == "stop"
        if margin > 1e-3:
            assert list(out.outputs[0].token_ids) == expected, prompt
            assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
            compared += 1
    assert compared >= 16
    assert vllm_engine.llm_engine.model_config.max_model_len == 64
