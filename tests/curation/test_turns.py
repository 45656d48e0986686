"""Multi-turn generate (curation/generate/turns.py) with a real generator on the real model:
SmolLM2-135M-Instruct sampled by transformers, an environment that answers each turn, and the
tokens checked against a fresh rendering of the conversation by the chat template."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from curation.env.environments import EnvStep, prompt_messages
from curation.generate.base import SamplingConfig
from curation.generate.hf import HFGenerator
from curation.generate.turns import STOP_REASONS, RollOut, render, roll_out

pytestmark = pytest.mark.xdist_group("real_model_hf")


@pytest.fixture(scope="module")
def engine(real_model):
    generator = HFGenerator(real_model)
    yield generator
    generator.close()


PROMPTS = [[{"role": "user", "content": "Say one word."}], [{"role": "user", "content": "Name a colour."}]]
SAMPLING = SamplingConfig(group_size=2, max_tokens=12, temperature=1.0, seed=3)


class Replies:
    """An environment that answers every assistant turn with the same user message (and a
    reward of 0.5): the trajectories stop at a limit."""

    def reset(self, prompt_row: dict) -> list[dict]:
        return prompt_messages(prompt_row)

    def step(self, assistant_message: dict) -> EnvStep:
        return self.step_many([assistant_message])[0]

    def step_many(self, messages: list[dict]) -> list[EnvStep]:
        return [EnvStep(messages=[{"role": "user", "content": "Another word, please."}], done=False, reward=0.5)
                for _ in messages]


def _roll(engine, env, **limits):
    return roll_out(engine, engine.tokenizer, env, PROMPTS, [11, 12], SAMPLING, tools=None,
                    max_turns=limits.get("max_turns", 3), max_tokens=limits.get("max_tokens", 200))


def test_trajectories_keep_the_sampled_tokens_and_render_the_environment_as_the_template_does(engine):
    tokenizer = engine.tokenizer
    prompts, groups = _roll(engine, Replies(), max_turns=3)
    assert [len(g) for g in groups] == [2, 2]
    for prompt_ids, group in zip(prompts, groups):
        for traj in group:
            n = len(traj.token_ids)
            assert len(traj.mask) == len(traj.logprobs) == n
            # the turns cover the response in order, the model's spans are the mask's ones
            assert traj.turns[0].start == 0 and sum(t.length for t in traj.turns) == n
            for turn in traj.turns:
                span = range(turn.start, turn.start + turn.length)
                assert {traj.mask[i] for i in span} <= ({1} if turn.role == "assistant" else {0})
                if turn.role != "assistant":
                    assert all(traj.logprobs[i] == 0.0 for i in span)
                    text = tokenizer.decode(traj.token_ids[turn.start:turn.start + turn.length])
                    assert "Another word, please." in text and "<|im_start|>user" in text
            assert traj.num_turns == len(traj.turn_rewards) <= 3
            assert traj.stop_reason in STOP_REASONS
            # the whole sequence is the template's rendering of the conversation, up to the
            # model's last token: no model turn was re-tokenized, no environment text is lost
            rendered = render(tokenizer, traj.messages, None, add_generation_prompt=False)
            ours = tokenizer.decode(prompt_ids + traj.token_ids, skip_special_tokens=False)
            assert rendered.startswith(ours)
            # (what is left: the newline after the last end-of-turn token, or, for a turn cut by
            # max_tokens, the end-of-turn token the template closes it with)
            assert rendered[len(ours):].strip() == ("" if traj.finish_reason == "stop" else tokenizer.eos_token)
            # the environment's tokens are those of a fresh rendering; the model's are the ones
            # sampled, equal to a fresh tokenization only where the model chose its canonical tokens
            fresh = tokenizer.encode(rendered, add_special_tokens=False)
            for turn in traj.turns:
                if turn.role != "assistant":
                    env_ids = traj.token_ids[turn.start:turn.start + turn.length]
                    position = len(prompt_ids) + turn.start
                    canonical_before = fresh[:position] == (prompt_ids + traj.token_ids)[:position]
                    if canonical_before:
                        assert fresh[position:position + len(env_ids)] == env_ids


def test_each_limit_is_a_stop_reason(engine):
    _, groups = _roll(engine, Replies(), max_turns=1)
    assert {t.stop_reason for g in groups for t in g} <= {"max_turns", "length"}
    assert all(t.num_turns == 1 and all(m == 1 for m in t.mask) for g in groups for t in g)
    _, groups = _roll(engine, Replies(), max_turns=5, max_tokens=30)
    assert all(len(t.token_ids) <= 30 for g in groups for t in g)
    assert {t.stop_reason for g in groups for t in g} <= {"max_tokens", "length"}


def test_a_rerun_samples_the_same_trajectories(engine):
    _, first = _roll(engine, Replies(), max_turns=2)
    _, again = _roll(engine, Replies(), max_turns=2)
    assert [[t.token_ids for t in g] for g in first] == [[t.token_ids for t in g] for g in again]


class Stopped(Exception):
    """Stands in for a kill between two turns."""


def test_a_roll_out_stopped_between_turns_goes_on_from_its_staged_state(engine):
    """The state `on_turn` gets after each environment turn, through its JSON (what a generate
    stages), resumes to exactly the trajectories of a roll-out nobody stopped."""
    _, whole = _roll(engine, Replies(), max_turns=3)
    assert any(t.num_turns == 3 for g in whole for t in g), "no trajectory took 3 turns: change SAMPLING's seed"
    for stop_at in (1, 2):
        staged: list[bytes] = []

        def on_turn(state: RollOut, staged: list[bytes] = staged, stop_at: int = stop_at) -> None:
            staged.append(state.to_json())
            if state.turn == stop_at:
                raise Stopped

        with pytest.raises(Stopped):
            roll_out(engine, engine.tokenizer, Replies(), PROMPTS, [11, 12], SAMPLING, tools=None, max_turns=3,
                     max_tokens=200, on_turn=on_turn)
        state = RollOut.from_json(staged[-1])
        assert state.turn == stop_at and all(t.num_turns <= stop_at for g in state.groups for t in g)
        _, resumed = roll_out(engine, engine.tokenizer, Replies(), PROMPTS, [11, 12], SAMPLING, tools=None,
                              max_turns=3, max_tokens=200, resume=state)
        assert [[t.__dict__ for t in g] for g in resumed] == [[t.__dict__ for t in g] for g in whole]


def test_the_generate_stage_writes_trajectory_columns(engine, tmp_path):
    import polars as pl

    from curation.env.config import EnvConfig
    from curation.env.environments import register_environment
    from curation.generate.stage import generate

    name = "test-turns-counting"
    try:
        register_environment(name)(lambda config: Replies())
    except ValueError:
        pass  # registered by an earlier test in this process
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_id": f"p{i}", "messages": m}) + "\n" for i, m in enumerate(PROMPTS)))
    result = generate(tmp_path / "run", prompts, SAMPLING, generator=engine, round=1,
                      env=EnvConfig(name=name, max_turns=2, max_tokens=100))
    assert result.samples == 4
    files = sorted((tmp_path / "run" / "samples").rglob("*.parquet"))
    table = pl.from_arrow(pq.read_table(files[0]))
    assert {"response_mask", "turns", "num_turns", "messages_out", "turn_rewards", "tool_calls", "tool_errors",
            "stop_reason"} <= set(table.columns)
    for row in table.iter_rows(named=True):
        assert len(row["response_mask"]) == len(row["response_token_ids"]) == len(row["behavior_logprobs"])
        out = json.loads(row["messages_out"])
        assert out[0]["role"] == "assistant" and row["num_turns"] == sum(m["role"] == "assistant" for m in out)
