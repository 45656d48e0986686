"""With top_p or top_k the engine samples from a truncated, renormalised distribution and logs
its log-probs under it (vLLM's processed log-probs); the trainer's log-probs at the same
weights must be those, not the full softmax's."""

from __future__ import annotations

import pytest
import torch

from curation.generate.base import SamplingConfig
from curation.generate.stage import generate
from store.run_store import RunStore
from tests import helpers
from tests.helpers import load_fp32
from training.batching import policy_batches
from training.logprobs import token_logprobs

prompts_file = helpers.prompts_file  # fixtures
vllm_generator = helpers.vllm_generator


def trainer_gap(model, samples, **truncation) -> float:
    """Mean |trainer log-prob - behavior_logprobs| over the response tokens of `samples`."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in policy_batches(samples, token_budget=4096):
            logp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask, **truncation)
            total += float((logp - mb.old_logp).abs()[mb.target_mask].sum())
            tokens += int(mb.target_mask.sum())
    return total / tokens


@pytest.mark.parametrize("top_p,top_k", [(0.9, 0), (1.0, 5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_the_engines_under_top_p_and_top_k(tmp_path, toy_dir, prompts_file, vllm_generator,
                                                                  top_p, top_k, temperature):
    sampling = SamplingConfig(group_size=4, max_tokens=8, temperature=temperature, top_p=top_p, top_k=top_k, seed=2)
    generate(tmp_path / "run", prompts_file, sampling, generator=vllm_generator)
    samples = RunStore(tmp_path / "run").read("samples")
    model = load_fp32(toy_dir / "model")
    matched = trainer_gap(model, samples, temperature=temperature, top_k=top_k, top_p=top_p)
    full = trainer_gap(model, samples, temperature=temperature)
    assert matched < 1e-4, f"trainer vs engine log-probs under top_p={top_p}, top_k={top_k}: {matched:.2e}"
    assert full > 1e-3, f"the full softmax should differ (it is what the trainer computed before): {full:.2e}"
