"""Generators on the real toy model: vLLM and transformers, real Parquet, real DuckDB.

The central check: behavior_logprobs equal a fresh transformers fp32 forward over the same
token ids (temperature 1.0), for both backends, and for vLLM also after update_weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from curation.generate.base import SamplingConfig, load_prompts, prompt_id_of, prompt_seed
from curation.generate.stage import generate
from curation.store import RunStore

SAMPLING = SamplingConfig(group_size=4, max_tokens=8, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def prompts_file(toy_dir: Path, tmp_path_factory) -> Path:
    """24 eval prompts of the toy, with their references."""
    table = pq.read_table(toy_dir / "eval.parquet").slice(0, 24)
    path = tmp_path_factory.mktemp("prompts") / "prompts.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def vllm_generator(toy_dir: Path):
    from curation.generate.vllm import VLLMGenerator

    generator = VLLMGenerator(toy_dir / "model", dtype="float32")
    yield generator
    generator.close()


def transformers_logprobs(model, samples: pa.Table, temperature: float = 1.0) -> list[list[float]]:
    """log p(response token | prefix) from one plain fp32 forward per sample."""
    out = []
    with torch.no_grad():
        for prompt_ids, response_ids in zip(
            samples.column("prompt_token_ids").to_pylist(), samples.column("response_token_ids").to_pylist()
        ):
            ids = torch.tensor([prompt_ids + response_ids])
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
            out.append(logp.tolist())
    return out


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    flat_a = [x for row in a for x in row]
    flat_b = [x for row in b for x in row]
    assert len(flat_a) == len(flat_b) > 0
    return sum(abs(x - y) for x, y in zip(flat_a, flat_b)) / len(flat_a)


def load_fp32(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_samples_table(samples: pa.Table, n_prompts: int, group_size: int) -> None:
    assert samples.num_rows == n_prompts * group_size
    for ids, logprobs, reason in zip(
        samples.column("response_token_ids").to_pylist(),
        samples.column("behavior_logprobs").to_pylist(),
        samples.column("finish_reason").to_pylist(),
    ):
        assert len(ids) == len(logprobs) >= 1
        assert all(lp <= 0.0 for lp in logprobs)
        assert reason in {"stop", "length"}
    keys = samples.select(["prompt_id", "sample_idx"]).to_pylist()
    assert len({(k["prompt_id"], k["sample_idx"]) for k in keys}) == samples.num_rows


def test_vllm_behavior_logprobs_match_transformers(tmp_path, toy_dir, prompts_file, vllm_generator):
    result = generate(tmp_path / "run", prompts_file, SAMPLING, generator=vllm_generator)
    assert not result.skipped and result.samples == 24 * 4
    samples = RunStore(tmp_path / "run").read("samples")
    check_samples_table(samples, 24, 4)
    diff = mean_abs_diff(samples.column("behavior_logprobs").to_pylist(),
                         transformers_logprobs(load_fp32(toy_dir / "model"), samples))
    assert diff < 1e-4, f"vLLM behavior_logprobs differ from transformers by {diff:.2e} on average"


def test_hf_behavior_logprobs_match_transformers(tmp_path, toy_dir, prompts_file):
    result = generate(tmp_path / "run", prompts_file, SAMPLING, model=toy_dir / "model", backend="hf")
    assert result.samples == 24 * 4
    samples = RunStore(tmp_path / "run").read("samples")
    check_samples_table(samples, 24, 4)
    assert samples.column("generator")[0].as_py().startswith("hf-")
    diff = mean_abs_diff(samples.column("behavior_logprobs").to_pylist(),
                         transformers_logprobs(load_fp32(toy_dir / "model"), samples))
    assert diff < 1e-4, f"hf behavior_logprobs differ from transformers by {diff:.2e} on average"


def test_behavior_logprobs_follow_temperature(tmp_path, toy_dir, prompts_file, vllm_generator):
    """At temperature 0.7 the log-probs are those of logits / 0.7 (the sampling distribution)."""
    sampling = SamplingConfig(group_size=2, max_tokens=8, temperature=0.7, seed=1)
    generate(tmp_path / "run", prompts_file, sampling, generator=vllm_generator)
    samples = RunStore(tmp_path / "run").read("samples")
    model = load_fp32(toy_dir / "model")
    got = samples.column("behavior_logprobs").to_pylist()
    assert mean_abs_diff(got, transformers_logprobs(model, samples, temperature=0.7)) < 1e-4
    assert mean_abs_diff(got, transformers_logprobs(model, samples, temperature=1.0)) > 1e-3


def perturbed_model(toy_dir: Path, out: Path, scale: float = 0.05, seed: int = 3) -> Path:
    """A copy of the toy model with every weight moved, the LM head included."""
    import shutil

    shutil.copytree(toy_dir / "model", out)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    new = {k: (v + scale * v.std() * torch.randn(v.shape, generator=gen)).contiguous() for k, v in state.items()}
    new["lm_head.weight"] = (state["lm_head.weight"] * 1.5 + 0.1 * torch.randn(state["lm_head.weight"].shape, generator=gen)).contiguous()
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_vllm_update_weights_from_folder_and_state_dict(tmp_path, toy_dir, prompts_file, vllm_generator):
    """After update_weights the logprobs are the new model's; a stale LM head would fail this."""
    old_model = load_fp32(toy_dir / "model")
    new_dir = perturbed_model(toy_dir, tmp_path / "new-model")
    new_model = load_fp32(new_dir)
    try:
        vllm_generator.update_weights(new_dir, policy_version=5)
        generate(tmp_path / "run", prompts_file, SAMPLING, generator=vllm_generator, round=1)
        samples = RunStore(tmp_path / "run").read("samples", rounds=1)
        got = samples.column("behavior_logprobs").to_pylist()
        assert set(samples.column("policy_version").to_pylist()) == {5}
        assert mean_abs_diff(got, transformers_logprobs(new_model, samples)) < 1e-4
        assert mean_abs_diff(got, transformers_logprobs(old_model, samples)) > 1e-2  # the test can tell

        # Only the LM head differs from the new model: a stale head is caught too.
        head_only = dict(load_file(new_dir / "model.safetensors"))
        head_only["lm_head.weight"] = old_model.lm_head.weight.detach().clone()
        head_model = load_fp32(new_dir)
        head_model.lm_head.weight.data.copy_(head_only["lm_head.weight"])
        vllm_generator.update_weights(head_only, policy_version=6)
        generate(tmp_path / "run", prompts_file, SAMPLING, generator=vllm_generator, round=2)
        samples = RunStore(tmp_path / "run").read("samples", rounds=2)
        got = samples.column("behavior_logprobs").to_pylist()
        assert mean_abs_diff(got, transformers_logprobs(head_model, samples)) < 1e-4
        assert mean_abs_diff(got, transformers_logprobs(new_model, samples)) > 1e-2
    finally:
        vllm_generator.update_weights(toy_dir / "model", policy_version=0)


def test_same_seed_same_samples_and_rounds_differ(tmp_path, prompts_file, vllm_generator):
    generate(tmp_path / "a", prompts_file, SAMPLING, generator=vllm_generator)
    generate(tmp_path / "b", prompts_file, SAMPLING, generator=vllm_generator)
    generate(tmp_path / "b", prompts_file, SAMPLING, generator=vllm_generator, round=1)
    a = RunStore(tmp_path / "a").read("samples")
    b0 = RunStore(tmp_path / "b").read("samples", rounds=0)
    b1 = RunStore(tmp_path / "b").read("samples", rounds=1)
    assert a.column("response_token_ids").to_pylist() == b0.column("response_token_ids").to_pylist()
    assert a.column("response_token_ids").to_pylist() != b1.column("response_token_ids").to_pylist()
    pid = a.column("prompt_id")[0].as_py()
    assert a.column("seed")[0].as_py() == prompt_seed(SAMPLING.seed, 0, pid)
    # G samples of one prompt are not copies of each other
    first_group = [r for r, p in zip(a.column("response_token_ids").to_pylist(), a.column("prompt_id").to_pylist()) if p == pid]
    assert len(first_group) == 4


def test_prompt_too_long_goes_to_rejects(tmp_path, toy_dir, vllm_generator):
    prompts = pq.read_table(toy_dir / "eval.parquet").slice(0, 5).to_pylist()
    long_prompt = "1+" * vllm_generator.max_model_len + "1="
    prompts.append({"prompt": long_prompt, "reference": "0"})
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompts), path)
    result = generate(tmp_path / "run", path, SAMPLING, generator=vllm_generator)
    assert result.rejected_prompts == 1 and result.samples == 5 * 4
    rejects = RunStore(tmp_path / "run").read("rejects")
    assert rejects.column("reason").to_pylist() == ["prompt_too_long"]
    assert rejects.column("prompt_id").to_pylist() == [prompt_id_of(long_prompt, None)]
    assert rejects.column("sample_idx").null_count == 1
    manifest = RunStore(tmp_path / "run").load_manifest("generate", 0)
    assert manifest["drops"] == {"prompt_too_long": 1}
    # the prompts table holds every prompt used, with its reference
    stored = RunStore(tmp_path / "run").read("prompts")
    assert stored.num_rows == 6 and stored.column("reference").null_count == 0


def test_rerun_is_noop_and_tables_read_across_rounds(tmp_path, prompts_file, vllm_generator):
    run = tmp_path / "run"
    first = generate(run, prompts_file, SAMPLING, generator=vllm_generator)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*.parquet")}
    again = generate(run, prompts_file, SAMPLING, generator=vllm_generator)
    assert again.skipped and not first.skipped
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.parquet")} == before
    generate(run, prompts_file, SAMPLING, generator=vllm_generator, round=1)
    rows = duckdb.sql(
        f"SELECT round, count(*) AS n FROM read_parquet('{run}/samples/**/*.parquet', hive_partitioning=true) "
        "GROUP BY round ORDER BY round"
    ).fetchall()
    assert rows == [(0, 96), (1, 96)]
    prompts_rows = duckdb.sql(f"SELECT count(*) FROM read_parquet('{run}/prompts/*.parquet')").fetchall()[0][0]
    assert prompts_rows == 24  # the same prompt file is stored once


def test_load_prompts_jsonl_messages_and_duplicates(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "1+1=", "reference": 2},
        {"prompt": "1+1=", "reference": 2},
        {"messages": [{"role": "user", "content": "hi"}], "metadata": {"source": "x"}},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    table = load_prompts(path)
    assert table.num_rows == 2
    assert table.column("reference").to_pylist() == ["2", None]
    assert json.loads(table.column("metadata")[1].as_py()) == {"source": "x"}
    assert table.column("prompt_id").to_pylist() == [
        prompt_id_of("1+1=", None),
        prompt_id_of(None, [{"role": "user", "content": "hi"}]),
    ]


def test_hf_samples_the_full_vocabulary(tmp_path, toy_dir):
    """With top_k=0 no top-k truncation happens, even for a vocabulary larger than
    transformers' default top-k of 50: logprobs match the full-vocabulary forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from curation.generate.hf import HFGenerator

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "wide")
    # the toy's tokenizer serves: prompts only use its ids, responses are ids in 0..299
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(toy_dir / "model").save_pretrained(tmp_path / "wide")
    generator = HFGenerator(tmp_path / "wide")
    prompt_ids = [generator.tokenize("12+34=", None)]
    groups = generator.sample(prompt_ids, [5], SamplingConfig(group_size=8, max_tokens=16))
    samples = pa.table({"prompt_token_ids": [prompt_ids[0]] * 8,
                        "response_token_ids": [c.token_ids for c in groups[0]]})
    got = [c.logprobs for c in groups[0]]
    assert mean_abs_diff(got, transformers_logprobs(model.eval(), samples)) < 1e-4


def test_messages_prompts_use_the_chat_template(tmp_path, toy_dir):
    """A conversation is rendered with the tokenizer's chat template, then sampled."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "chat-model"
    shutil.copytree(toy_dir / "model", model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    tokenizer.save_pretrained(model_dir)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "12+34"}], "reference": "46"}) + "\n")
    generate(tmp_path / "run", path, SamplingConfig(group_size=2, max_tokens=4), model=model_dir, backend="hf")
    samples = RunStore(tmp_path / "run").read("samples")
    assert samples.column("prompt_token_ids")[0].as_py() == tokenizer("12+34=").input_ids
