"""The vLLM generator on the real toy model: behavior_logprobs equal a fresh transformers fp32
forward over the same token ids, at temperature 1.0 and 0.7, and after update_weights; seeded
sampling of more prompt tokens than the engine schedules in one step; multi-turn trajectories.
"""

from __future__ import annotations

from safetensors.torch import load_file

from curation.generate.base import SamplingConfig
from curation.generate.stage import generate
from store.run_store import RunStore
from tests import helpers
from tests.helpers import (
    SAMPLING,
    check_samples_table,
    load_fp32,
    mean_abs_diff,
    perturbed_model,
    transformers_logprobs,
)

prompts_file = helpers.prompts_file  # fixtures
vllm_generator = helpers.vllm_generator


def test_vllm_behavior_logprobs_match_transformers(tmp_path, toy_dir, prompts_file, vllm_generator):
    result = generate(tmp_path / "run", prompts_file, SAMPLING, generator=vllm_generator)
    assert not result.skipped and result.samples == 24 * 4
    samples = RunStore(tmp_path / "run").read("samples")
    check_samples_table(samples, 24, 4)
    diff = mean_abs_diff(samples.column("behavior_logprobs").to_pylist(),
                         transformers_logprobs(load_fp32(toy_dir / "model"), samples))
    assert diff < 1e-4, f"vLLM behavior_logprobs differ from transformers by {diff:.2e} on average"


def test_behavior_logprobs_follow_temperature(tmp_path, toy_dir, prompts_file, vllm_generator):
    """At temperature 0.7 the log-probs are those of logits / 0.7 (the sampling distribution)."""
    sampling = SamplingConfig(group_size=2, max_tokens=8, temperature=0.7, seed=1)
    generate(tmp_path / "run", prompts_file, sampling, generator=vllm_generator)
    samples = RunStore(tmp_path / "run").read("samples")
    model = load_fp32(toy_dir / "model")
    got = samples.column("behavior_logprobs").to_pylist()
    assert mean_abs_diff(got, transformers_logprobs(model, samples, temperature=0.7)) < 1e-4
    assert mean_abs_diff(got, transformers_logprobs(model, samples, temperature=1.0)) > 1e-3


def test_seeded_sampling_over_the_batched_token_budget(vllm_generator):
    """96 prompts of 49 tokens, 4 samples each, are more prompt tokens than the engine schedules
    in one step. On CPU a chunked prefill would rewind each seeded request's generator, which a
    CPU generator cannot do ("CPU Generator does not use offset"). The same seeds give the same
    tokens again; other seeds give other tokens."""
    prompts = ["+".join(str(10 + (7 * i + k) % 90) for k in range(16)) + "=" for i in range(96)]
    token_ids = [vllm_generator.tokenize(prompt, None) for prompt in prompts]
    sampling = SamplingConfig(group_size=4, max_tokens=4, temperature=1.0)
    budget = vllm_generator.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert {len(ids) for ids in token_ids} == {49} and 96 * 49 > budget  # the prompts alone overflow a step
    seeds = list(range(1000, 1096))

    def tokens(seeds: list[int]) -> list[list[list[int]]]:
        return [[c.token_ids for c in group] for group in vllm_generator.sample(token_ids, seeds, sampling)]

    first = tokens(seeds)
    assert [len(group) for group in first] == [4] * 96 and all(1 <= len(ids) <= 4 for group in first for ids in group)
    assert tokens(seeds) == first
    other = tokens([seed + 10_000 for seed in seeds])
    assert sum(a != b for a, b in zip(first, other)) > 48  # 59 of 96: the toy often gives one answer


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


class _Asks:
    """Answers every assistant turn with another sum to do (a user turn): trajectories of the
    toy run to max_turns."""

    def reset(self, prompt_row: dict) -> list[dict]:
        return [{"role": "user", "content": prompt_row["prompt"]}]

    def step(self, assistant_message: dict):
        from curation.env.environments import EnvStep

        return EnvStep(messages=[{"role": "user", "content": "11+22="}], done=False, reward=None)


def test_multi_turn_trajectories_on_vllm(toy_dir, vllm_generator):
    """roll_out on the vLLM engine: every later turn is sampled after the earlier turns' ids as
    they are (the model's and the environment's), so the behavior log-probs of every model token
    equal a transformers forward over the whole trajectory; the environment's tokens are its
    turn rendered; a rerun samples the same trajectories."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer

    from curation.generate.turns import roll_out

    tokenizer = AutoTokenizer.from_pretrained(toy_dir / "model")  # the toy has no chat template: one for this test
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m.content }}"
                               "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    rows = pq.read_table(toy_dir / "eval.parquet").slice(0, 4).to_pylist()
    sampling = SamplingConfig(group_size=2, max_tokens=8, temperature=1.0, seed=5)

    def roll():
        return roll_out(vllm_generator, tokenizer, _Asks(), [_Asks().reset(r) for r in rows], [1, 2, 3, 4],
                        sampling, tools=None, max_turns=3, max_tokens=60)

    prompts, groups = roll()
    model = load_fp32(toy_dir / "model")
    asked = tokenizer.encode("11+22=", add_special_tokens=False)
    turns = 0
    for prompt_ids, group in zip(prompts, groups):
        for traj in group:
            turns = max(turns, traj.num_turns)
            with torch.no_grad():
                ids = torch.tensor([prompt_ids + traj.token_ids])
                logp = model(ids).logits[0, len(prompt_ids) - 1:-1].float().log_softmax(-1)
                logp = logp.gather(-1, ids[0, len(prompt_ids):, None])[:, 0].tolist()
            model_tokens = [i for i, m in enumerate(traj.mask) if m]
            assert max(abs(logp[i] - traj.logprobs[i]) for i in model_tokens) < 1e-3
            for turn in traj.turns:
                if turn.role == "user":
                    assert traj.token_ids[turn.start:turn.start + turn.length] == asked
                    assert set(traj.logprobs[turn.start:turn.start + turn.length]) == {0.0}
    assert turns == 3, "no trajectory took 3 turns: the toy answers in a few tokens, then EOS"
    _, again = roll()
    assert [[t.token_ids for t in g] for g in again] == [[t.token_ids for t in g] for g in groups]
