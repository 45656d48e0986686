"""The transformers generator on the real toy model: behavior_logprobs equal a fresh fp32 forward,
over the full vocabulary (no hidden top-k).
"""

from __future__ import annotations

import pyarrow as pa
import torch

from curation.generate.base import SamplingConfig
from curation.generate.stage import generate
from store.run_store import RunStore
from tests import helpers
from tests.helpers import (
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


def test_hf_greedy_matches_transformers_generate_one_prompt_at_a_time(toy_dir):
    """Batched (left padding, rows leaving the cache at EOS) greedy equals transformers'
    own `generate` on each prompt alone."""
    import pyarrow.parquet as pq

    from curation.generate.hf import HFGenerator

    generator = HFGenerator(toy_dir / "model", batch_size=16)
    prompts = pq.read_table(toy_dir / "eval.parquet").column("prompt").to_pylist()[:30]
    prompts[::3] = [p.replace("+", "+0+") for p in prompts[::3]]  # longer prompts among the rest
    prompts[1::7] = [p[1:] for p in prompts[1::7]]  # and shorter ones
    ids = [generator.tokenize(p, None) for p in prompts]
    assert len({len(x) for x in ids}) > 1, "the batch should mix prompt lengths"
    model = load_fp32(toy_dir / "model")
    expected = []
    for prompt_ids in ids:
        out = model.generate(input_ids=torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=8,
                             eos_token_id=sorted(generator.eos_ids), pad_token_id=generator.pad_id,
                             top_k=None, top_p=None, temperature=None)
        expected.append(generator.tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True))
    assert generator.greedy(ids, 8) == expected


def test_hf_top_k_and_top_p_sample_from_the_truncated_distribution(toy_dir):
    """top_k / top_p: every sampled token is inside the kept set of a fresh forward, and its
    behavior logprob is log softmax over that set."""
    from curation.generate.hf import HFGenerator

    generator = HFGenerator(toy_dir / "model")
    model = load_fp32(toy_dir / "model")
    ids = [generator.tokenize(p, None) for p in ("12+34=", "7+5=", "40+60=")]
    for cfg in (SamplingConfig(group_size=16, max_tokens=8, temperature=1.5, top_k=2),
                SamplingConfig(group_size=16, max_tokens=8, temperature=1.5, top_p=0.6)):
        groups = generator.sample(ids, [1, 2, 3], cfg)
        checked = 0
        for prompt_ids, group in zip(ids, groups):
            for completion in group:
                seq = torch.tensor([prompt_ids + completion.token_ids])
                with torch.no_grad():
                    logits = model(seq).logits[0, len(prompt_ids) - 1 : -1] / cfg.temperature
                probs, order = logits.softmax(-1).sort(-1, descending=True)
                if cfg.top_k:
                    kept = torch.arange(logits.shape[-1]) < cfg.top_k
                    kept = kept.expand_as(probs)
                else:
                    kept = probs.cumsum(-1) - probs < cfg.top_p
                for t, token in enumerate(completion.token_ids):
                    allowed = order[t][kept[t]]
                    assert token in allowed.tolist()
                    want = logits[t, allowed].log_softmax(-1)[(allowed == token).nonzero()[0, 0]]
                    assert abs(completion.logprobs[t] - want.item()) < 1e-4
                    checked += 1
        assert checked > 48
