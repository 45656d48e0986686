"""The transformers generator on the real toy model: behavior_logprobs equal a fresh fp32 forward,
over the full vocabulary (no hidden top-k).
"""

from __future__ import annotations

import pyarrow as pa
import torch

from curation.generate.base import SamplingConfig
from curation.generate.stage import generate
from curation.store import RunStore
from tests.curation import generate_helpers as helpers
from tests.curation.generate_helpers import (
    SAMPLING,
    check_samples_table,
    load_fp32,
    mean_abs_diff,
    transformers_logprobs,
)

prompts_file = helpers.prompts_file  # a fixture


def test_hf_behavior_logprobs_match_transformers(tmp_path, toy_dir, prompts_file):
    result = generate(tmp_path / "run", prompts_file, SAMPLING, model=toy_dir / "model", backend="hf")
    assert result.samples == 24 * 4
    samples = RunStore(tmp_path / "run").read("samples")
    check_samples_table(samples, 24, 4)
    assert samples.column("generator")[0].as_py().startswith("hf-")
    diff = mean_abs_diff(samples.column("behavior_logprobs").to_pylist(),
                         transformers_logprobs(load_fp32(toy_dir / "model"), samples))
    assert diff < 1e-4, f"hf behavior_logprobs differ from transformers by {diff:.2e} on average"


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
