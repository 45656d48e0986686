"""The generate stage on the real toy model and real Parquet/DuckDB: seeds, rejects, reruns,
chat prompts, and the tables it declares.
"""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.generate.base import SamplingConfig, prompt_id_of, prompt_seed
from curation.generate.stage import AUTO_HF_MAX_PARAMS, READS, STAGE, WRITES, generate, make_generator, resolve_backend
from store.run_store import RunStore
from store.schema import SCHEMAS
from store.weights import count_parameters
from tests import helpers
from tests.helpers import SAMPLING

prompts_file = helpers.prompts_file  # fixtures
vllm_generator = helpers.vllm_generator


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
    first_group = [r for r, p in zip(a.column("response_token_ids").to_pylist(), a.column("prompt_id").to_pylist())
                   if p == pid]
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


def test_the_stage_declares_its_tables():
    assert STAGE == "generate"
    assert READS == ("prompts file", "model weights")
    assert WRITES == ("samples", "rejects", "prompts")
    assert set(WRITES) <= set(SCHEMAS)


def test_make_generator_names_the_backends(toy_dir):
    with pytest.raises(ValueError, match="unknown generator backend 'tgi'; choose 'vllm', 'hf' or 'auto'"):
        make_generator("tgi", toy_dir / "model")


def test_count_parameters_reads_the_safetensors_headers(toy_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_dir / "model")
    assert count_parameters(toy_dir / "model") == sum(p.numel() for p in model.parameters())


def _header_only_model(folder, weights: int):
    """A model folder whose one safetensors file declares `weights` float32 weights in its header
    (the bytes after it are never read by count_parameters)."""
    folder.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [weights], "data_offsets": [0, 4 * weights]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


def test_auto_backend_picks_hf_for_tiny_models_on_cpu_and_vllm_from_the_threshold(tmp_path, toy_dir):
    import torch

    assert resolve_backend("vllm", toy_dir / "model") == "vllm" and resolve_backend("hf", "anything") == "hf"
    big = _header_only_model(tmp_path / "big", AUTO_HF_MAX_PARAMS)
    small = _header_only_model(tmp_path / "small", AUTO_HF_MAX_PARAMS - 1)
    if torch.cuda.is_available():
        assert resolve_backend("auto", small) == "vllm"
    else:
        assert resolve_backend("auto", toy_dir / "model") == "hf"
        assert resolve_backend("auto", small) == "hf"
    assert resolve_backend("auto", big) == "vllm"


def test_auto_backend_records_the_backend_that_ran(tmp_path, prompts_file, toy_dir):
    generate(tmp_path / "run", prompts_file, SAMPLING, model=toy_dir / "model", backend="auto")
    manifest = RunStore(tmp_path / "run").load_manifest("generate", 0)
    assert manifest["config"]["backend"] == "hf" and manifest["rows_out"] > 0


def test_rejects_are_written_with_the_contract_schema(tmp_path, toy_dir):
    """A prompt too long for the hf generator's context: one rejects row with the rejects schema."""
    prompts = pq.read_table(toy_dir / "eval.parquet").slice(0, 2).to_pylist()
    long_prompt = "1+" * 64 + "1="
    prompts.append({"prompt": long_prompt, "reference": "0"})
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompts), path)
    result = generate(tmp_path / "run", path, SamplingConfig(group_size=2, max_tokens=4), model=toy_dir / "model",
                      backend="hf", generator_kwargs={"max_model_len": 64})
    assert result.rejected_prompts == 1 and result.samples == 2 * 2
    rejects = RunStore(tmp_path / "run").read("rejects")
    assert rejects.schema.equals(SCHEMAS["rejects"])
    assert rejects.to_pylist() == [{
        "run_id": "run", "round": 0, "prompt_id": prompt_id_of(long_prompt, None), "sample_idx": None,
        "stage": "generate", "reason": "prompt_too_long", "detail": f"{len(long_prompt) + 1} prompt tokens >= "
                                                                       "max_model_len 64"}]
