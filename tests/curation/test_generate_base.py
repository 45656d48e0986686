"""What every generator shares: the settings (validated once), prompt loading, ids and seeds.
"""

from __future__ import annotations

import json

import pytest

from curation.generate.base import (
    GENERATOR_DEFAULTS,
    GeneratorConfig,
    SamplingConfig,
    load_prompts,
    prompt_id_of,
    prompt_seed,
)


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


@pytest.mark.parametrize("kwargs,message", [
    ({"group_size": 0}, "group_size must be >= 1, got 0"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"temperature": 0.0}, "temperature must be > 0, got 0.0 (greedy decoding is not sampling)"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -1}, "top_k must be >= 0, got -1"),
    ({"groupsize": 8}, "Extra inputs are not permitted"),
])
def test_sampling_config_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingConfig(**kwargs)
    assert message in str(err.value)


def test_sampling_config_is_a_frozen_record_of_the_manifest():
    sampling = SamplingConfig(group_size=8, max_tokens=8, seed=0)
    assert sampling.as_dict() == {"group_size": 8, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                  "seed": 0}
    assert list(sampling.as_dict()) == ["group_size", "max_tokens", "temperature", "top_p", "top_k", "seed"]
    assert sampling == SamplingConfig(group_size=8, max_tokens=8) and hash(sampling) == hash(SamplingConfig(
        group_size=8, max_tokens=8))
    with pytest.raises(ValueError):
        sampling.seed = 1


def test_generator_config_gives_each_backend_its_arguments():
    assert GENERATOR_DEFAULTS == GeneratorConfig()
    assert GeneratorConfig(backend="hf", dtype="bfloat16").generator_kwargs() == {"dtype": "bfloat16",
                                                                                   "max_model_len": None}
    assert GeneratorConfig(max_model_len=128, gpu_memory_utilization=0.3).generator_kwargs() == {
        "dtype": "float32", "max_model_len": 128, "gpu_memory_utilization": 0.3, "tensor_parallel_size": 1}
    auto = GeneratorConfig(backend="auto")
    assert auto.generator_kwargs("hf") == {"dtype": "float32", "max_model_len": None}
    assert set(auto.generator_kwargs("vllm")) == {"dtype", "max_model_len", "gpu_memory_utilization",
                                                  "tensor_parallel_size"}


def test_generator_classes_take_their_defaults_from_generator_config():
    import inspect

    from curation.generate.hf import HFGenerator
    from curation.generate.stage import generate
    from curation.generate.vllm import VLLMGenerator

    vllm = inspect.signature(VLLMGenerator).parameters
    hf = inspect.signature(HFGenerator).parameters
    for name in ("dtype", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size"):
        assert vllm[name].default == getattr(GENERATOR_DEFAULTS, name), name
    for name in ("dtype", "max_model_len"):
        assert hf[name].default == getattr(GENERATOR_DEFAULTS, name), name
    stage = inspect.signature(generate).parameters
    assert stage["backend"].default == GENERATOR_DEFAULTS.backend
    assert stage["chunk_prompts"].default == GENERATOR_DEFAULTS.chunk_prompts


def test_prompt_ids_and_seeds_are_stable():
    assert prompt_id_of("1+1=", None) == prompt_id_of("1+1=", None) != prompt_id_of("1+2=", None)
    # a conversation's id ignores key order and extra keys of its messages
    assert prompt_id_of(None, [{"content": "hi", "role": "user", "name": "x"}]) == prompt_id_of(
        None, [{"role": "user", "content": "hi"}])
    assert prompt_id_of("hi", None) != prompt_id_of(None, [{"role": "user", "content": "hi"}])
    pid = prompt_id_of("1+1=", None)
    seeds = {prompt_seed(s, r, pid) for s in range(3) for r in range(3)}
    assert len(seeds) == 9 and all(0 <= s < 2**60 for s in seeds)
    assert prompt_seed(0, 1, pid) == prompt_seed(0, 1, pid)
