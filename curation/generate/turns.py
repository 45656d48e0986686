"""Multi-turn generate: every trajectory of a chunk advances turn by turn against an environment.

    prompt row ──env.reset──> messages ──chat template (+ the tools' schemas)──> prompt ids
        ▼ turn 1: generator.sample(prompt ids, G per prompt)           (the model's tokens, mask 1)
        ▼ env.step_many(each trajectory's assistant message)           (tool results, done, reward)
        ▼ the template's rendering of what the environment said        (appended as tokens, mask 0)
        ▼ turn 2..: generator.sample(each live trajectory's ids, 1 each) ...
    until the environment says done, or max_turns, max_tokens or the context is reached

The token ids the trainer sees are exactly the ones sampled: a model turn is never decoded
and encoded again. Only the environment's turns are tokenized, as the chat template renders
them after the model's end-of-turn token: the text of the conversation rendered with the new
messages, minus the text rendered up to and including the model's last sampled token (the
template's own end-of-turn marker), is encoded without special tokens added.
tests/curation/test_turns.py compares the ids with a fresh rendering of the whole conversation.

A trajectory stops with `stop_reason`:
    done        the environment ended it (the tools environment: an assistant turn without a tool call)
    max_turns   its `max_turns`-th assistant turn was answered and the environment would go on
    max_tokens  the environment's answer would take it past `max_tokens` (or the model's context)
    length      a model turn was cut by the sampling `max_tokens` (no end-of-turn token to continue after)

Works with any `Generator` (vLLM, transformers, engines on Ray): turn 1 samples G completions
per prompt, later turns one completion per live trajectory, seeded from the trajectory's
identity and the turn (`turn_seed`), so a rerun samples the same trajectories.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from curation.env.environments import Environment, EnvStep, step_many
from curation.generate.base import Completion, Generator, SamplingConfig
from store.schema import STOP_REASONS  # noqa: F401  (the values of stop_reason)


@dataclass
class Turn:
    """A span of a trajectory's response tokens: who wrote it, where it starts, how long it is."""

    role: str
    """"assistant" (the model's tokens), "tool" or "user" (the environment's)."""
    start: int
    length: int


@dataclass
class Trajectory:
    """One sample of a multi-turn generate: the response tokens after the prompt, model and
    environment turns in order, with the mask, the behavior log-probs and the conversation."""

    prompt_index: int
    sample_idx: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """One per token; 0.0 at the environment's tokens (masked)."""
    mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as rendered: the opening messages, then each turn's."""
    opening: int = 0
    """How many of `messages` the environment's reset gave (the prompt's)."""
    messages_out: list[dict[str, Any]] = field(default_factory=list)
    """The OpenAI-style messages after the prompt (assistant turns with `tool_calls`)."""
    turn_rewards: list[float | None] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    last_text: str = ""
    finish_reason: str = "stop"
    stop_reason: str | None = None

    @property
    def num_turns(self) -> int:
        return sum(turn.role == "assistant" for turn in self.turns)

    def add(self, role: str, token_ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        if logprobs is None:
            self.logprobs.extend([0.0] * len(token_ids))
        else:
            self.logprobs.extend(float(x) for x in logprobs)
        self.mask.extend([1 if role == "assistant" else 0] * len(token_ids))
        self.turns.append(Turn(role, start, len(token_ids)))


def turn_seed(prompt_seed: int, sample_idx: int, turn: int) -> int:
    """The seed of trajectory `sample_idx` of a prompt's group at `turn` (>= 2; turn 1 samples
    the group with the prompt's seed). Fits in int63."""
    digest = hashlib.sha256(f"{prompt_seed}:{sample_idx}:{turn}".encode()).hexdigest()
    return int(digest[:15], 16)


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, *,
           add_generation_prompt: bool) -> str:
    """The chat template's text of `messages` (with `tools` when there are any)."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
    """The prompt's token ids, rendered with the tools' schemas, ready for the first assistant turn."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False,
                                        **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def environment_token_ids(tokenizer: Any, messages: list[dict[str, Any]], new: list[dict[str, Any]],
                          tools: list[dict] | None, end_of_turn: str) -> list[int]:
    """The tokens the chat template puts after an assistant turn (the last of `messages`, which
    ended with the sampled token whose text is `end_of_turn`): the rendering of the `new`
    messages and the next assistant turn's header, encoded without special tokens added."""
    before = render(tokenizer, messages, tools, add_generation_prompt=False)
    after = render(tokenizer, messages + new, tools, add_generation_prompt=True)
    cut = before.rfind(end_of_turn)
    if not end_of_turn or cut < 0 or after[: cut + len(end_of_turn)] != before[: cut + len(end_of_turn)]:
        raise ValueError("the chat template does not render the assistant's turn ending with its end-of-turn "
                         f"token {end_of_turn!r}, so the environment's turn cannot be appended after it")
    # verbose=False: a tool's long answer is cut by max_tokens below, not worth the tokenizer's warning
    return list(tokenizer.encode(after[cut + len(end_of_turn):], add_special_tokens=False, verbose=False))


def assistant_message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@dataclass
class RollOut:
    """A chunk's trajectories after the environment answered turn `turn`: those without a
    stop_reason take turn `turn + 1`. What a generate stages between turns (`to_json`), so a
    killed one goes on from there (`roll_out(..., resume=)`)."""

    groups: list[list[Trajectory]]
    turn: int

    def to_json(self) -> bytes:
        return json.dumps({"turn": self.turn, "groups": [[_as_dict(t) for t in group] for group in self.groups]},
                          ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RollOut:
        raw = json.loads(data)
        return cls([[_from_dict(t) for t in group] for group in raw["groups"]], int(raw["turn"]))


def _as_dict(traj: Trajectory) -> dict[str, Any]:
    return {**traj.__dict__, "turns": [turn.__dict__ for turn in traj.turns]}


def _from_dict(raw: dict[str, Any]) -> Trajectory:
    return Trajectory(**{**raw, "turns": [Turn(**turn) for turn in raw["turns"]]})


def roll_out(generator: Generator, tokenizer: Any, env: Environment, opening: Sequence[list[dict[str, Any]]],
             seeds: Sequence[int], sampling: SamplingConfig, *, tools: list[dict] | None, max_turns: int,
             max_tokens: int, resume: RollOut | None = None, on_turn: Callable[[RollOut], None] | None = None
             ) -> tuple[list[list[int]], list[list[Trajectory]]]:
    """The prompts' token ids and their groups of trajectories: `sampling.group_size` per
    prompt (`opening[i]`: prompt i's messages from `env.reset`, `seeds[i]`: its seed), each
    advanced turn by turn until it stops (see the module). `on_turn` gets the chunk after each
    environment turn that leaves trajectories to go on; `resume`, one it got, goes on from there
    (the same trajectories as without the stop: each turn's seeds are the trajectory's)."""
    prompts = [prompt_token_ids(tokenizer, messages, tools) for messages in opening]

    def next_turn(trajs: list[Trajectory], turn: int) -> list[tuple[Trajectory, Completion]]:
        sampled = []
        for budget, batch in _by_budget(trajs, sampling.max_tokens, max_tokens, prompts,
                                        generator.max_model_len).items():
            cfg = sampling.model_copy(update={"group_size": 1, "max_tokens": budget})
            out = generator.sample([prompts[t.prompt_index] + t.token_ids for t in batch],
                                   [turn_seed(seeds[t.prompt_index], t.sample_idx, turn) for t in batch], cfg)
            sampled.extend((traj, completions[0]) for traj, completions in zip(batch, out))
        return sampled

    if resume is None:
        groups = [[Trajectory(i, k, messages=[dict(m) for m in opening[i]], opening=len(opening[i]))
                   for k in range(sampling.group_size)] for i in range(len(prompts))]
        first = generator.sample(prompts, seeds, sampling)
        live = [(traj, completion) for group, completions in zip(groups, first)
                for traj, completion in zip(group, completions)]
        turn = 1
    else:
        groups, turn = resume.groups, resume.turn + 1
        live = next_turn([traj for group in groups for traj in group if traj.stop_reason is None], turn)
    while live:
        answering = [traj for traj, completion in live if _take_model_turn(traj, completion, max_tokens)]
        steps = step_many(env, [assistant_message(traj.last_text) for traj in answering]) if answering else []
        go_on = [traj for traj, step in zip(answering, steps)
                 if _take_environment_turn(traj, step, turn, max_turns, max_tokens, tokenizer, tools,
                                           len(prompts[traj.prompt_index]), generator.max_model_len)]
        if go_on and on_turn is not None:
            on_turn(RollOut(groups, turn))
        turn += 1
        live = next_turn(go_on, turn)
    return prompts, groups


def _take_model_turn(traj: Trajectory, completion: Completion, max_tokens: int) -> bool:
    """Append a sampled turn; whether the environment answers it (the turn ended with an
    end-of-turn token and the trajectory has room)."""
    traj.add("assistant", completion.token_ids, completion.logprobs)
    traj.last_text = completion.text
    traj.finish_reason = completion.finish_reason
    traj.messages.append(assistant_message(completion.text))
    traj.messages_out.append(assistant_message(completion.text))
    if completion.finish_reason != "stop":
        traj.stop_reason = "length" if len(traj.token_ids) < max_tokens else "max_tokens"
        traj.turn_rewards.append(None)
        return False
    return True


def _take_environment_turn(traj: Trajectory, step: EnvStep, turn: int, max_turns: int, max_tokens: int,
                           tokenizer: Any, tools: list[dict] | None, prompt_tokens: int, context: int) -> bool:
    """Record the environment's answer to turn `turn`; whether the model takes another turn."""
    traj.turn_rewards.append(step.reward)
    traj.tool_calls += step.tool_calls
    traj.tool_errors += step.tool_errors
    if step.calls:
        traj.messages_out[-1] = {**traj.messages_out[-1], "tool_calls": step.calls}
    if step.done:
        traj.stop_reason = "done"
        return False
    if turn >= max_turns:
        traj.stop_reason = "max_turns"
        return False
    end_of_turn = tokenizer.decode(traj.token_ids[-1:], skip_special_tokens=False)
    ids = environment_token_ids(tokenizer, traj.messages, step.messages, tools, end_of_turn)
    if len(traj.token_ids) + len(ids) >= max_tokens or prompt_tokens + len(traj.token_ids) + len(ids) >= context:
        traj.stop_reason = "max_tokens"
        return False
    role = "tool" if all(m.get("role") == "tool" for m in step.messages) else "user"
    traj.add(role, ids, None)
    traj.messages.extend(step.messages)
    traj.messages_out.extend(step.messages)
    return True


def _by_budget(trajs: list[Trajectory], turn_tokens: int, max_tokens: int, prompts: list[list[int]],
               context: int) -> dict[int, list[Trajectory]]:
    """The live trajectories grouped by how many tokens their next turn may sample: the
    sampling's `max_tokens`, less where the trajectory's or the context's room is smaller."""
    batches: dict[int, list[Trajectory]] = {}
    for traj in trajs:
        room = min(turn_tokens, max_tokens - len(traj.token_ids),
                   context - len(prompts[traj.prompt_index]) - len(traj.token_ids))
        batches.setdefault(max(1, room), []).append(traj)
    return batches


def trajectory_columns(trajectories: Sequence[Trajectory]) -> dict[str, list]:
    """The samples table's trajectory columns of `trajectories`, in order (store/schema.py)."""
    return {
        "response_mask": [t.mask for t in trajectories],
        "turns": [[{"role": turn.role, "start": turn.start, "length": turn.length} for turn in t.turns]
                  for t in trajectories],
        "num_turns": [t.num_turns for t in trajectories],
        "messages_out": [json.dumps(t.messages_out, ensure_ascii=False, sort_keys=True) for t in trajectories],
        "turn_rewards": [t.turn_rewards for t in trajectories],
        "tool_calls": [t.tool_calls for t in trajectories],
        "tool_errors": [t.tool_errors for t in trajectories],
        "stop_reason": [t.stop_reason for t in trajectories],
    }
