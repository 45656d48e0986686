"""curation/generate/hf.py keeps each prompt's token ids and each response's text once
computed (the round loop chooses the same prompts again, and the toy's short answers recur):
the kept values are the tokenizer's own, and a round sampled with a generator that has seen
its prompts and answers before writes the same samples as a new generator. Real toy model,
real tokenizer."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq

from curation.generate.base import SamplingConfig, tokenize_prompt
from curation.generate.hf import HFGenerator
from curation.generate.stage import generate
from curation.store.run_store import RunStore


def chat_model(toy_dir, out):
    """The toy model with a chat template (the toy's tokenizer has none)."""
    from transformers import AutoTokenizer

    shutil.copytree(toy_dir / "model", out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                               "{% endfor %}{% if add_generation_prompt %}={% endif %}")
    tokenizer.save_pretrained(out)
    return out


def test_tokenize_keeps_the_tokenizers_ids_per_prompt_and_conversation(toy_dir, tmp_path):
    generator = HFGenerator(chat_model(toy_dir, tmp_path / "chat-model"))
    prompts = pq.read_table(toy_dir / "eval.parquet").column("prompt").to_pylist()[:20]
    conversations = [[{"role": "user", "content": "12+34"}], [{"role": "user", "content": "12+35"}],
                     [{"role": "system", "content": "12+34"}], [{"content": "12+34", "role": "user"}]]
    for _ in range(2):  # the second time from what the generator kept
        for prompt in prompts:
            assert generator.tokenize(prompt, None) == tokenize_prompt(generator.tokenizer, prompt, None)
        for messages in conversations:
            assert generator.tokenize(None, messages) == tokenize_prompt(generator.tokenizer, None, messages)
    assert len({tuple(generator.tokenize(None, m)) for m in conversations[:3]}) == 3
    ids = generator.tokenize(prompts[0], None)
    ids.append(-1)  # a caller's change to the returned list is not kept
    assert generator.tokenize(prompts[0], None) == tokenize_prompt(generator.tokenizer, prompts[0], None)


def test_response_texts_are_the_tokenizers(toy_dir):
    generator = HFGenerator(toy_dir / "model")
    eos = min(generator.eos_ids)
    responses = [[5, 6, eos], [5, 6, eos, 7], [5, 6], [5, 6, 7], [eos], [5, 6, eos]]
    for tokens in responses + responses:
        completion = generator._completion(tokens, [-0.5] * len(tokens))
        ids = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        assert completion.token_ids == ids
        assert completion.text == generator.tokenizer.decode(ids, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if eos in tokens else "length")


def test_a_generator_that_saw_the_prompts_before_samples_the_same(toy_dir, tmp_path):
    """Round 2 samples round 1's prompts again: with the generator that sampled round 1 (its
    prompts' ids and answers' texts kept) the samples equal those of a new generator."""
    path = tmp_path / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / "eval.parquet").slice(0, 16), path)
    sampling = SamplingConfig(group_size=4, max_tokens=8, seed=3)
    used = HFGenerator(toy_dir / "model")
    generate(tmp_path / "a", path, sampling, generator=used, round=1)
    generate(tmp_path / "a", path, sampling, generator=used, round=2)
    generate(tmp_path / "b", path, sampling, generator=HFGenerator(toy_dir / "model"), round=2)
    again, fresh = (RunStore(tmp_path / run).read("samples", 2).drop_columns(["run_id"]) for run in ("a", "b"))
    assert again.num_rows == 64 and again.equals(fresh)
