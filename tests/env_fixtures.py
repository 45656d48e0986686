"""Environments and tools for the tests of multi-turn rollouts through the round loop and the
CLI, named in specs as 'tests.env_fixtures:<name>'. The environments are deterministic and
need no tool call from the model: they answer every assistant turn that ends with its
end-of-turn token, whatever it says, so a trajectory runs until `max_turns` (or a limit)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from curation.env.config import EnvConfig
from curation.env.environments import EnvStep, ToolsEnvironment, prompt_messages

SLOW_ADD = "tests.env_fixtures:slow_add"
TOOL_SECONDS = 0.3
"""How long `slow_add` takes: a kill at the tools environment's `env.tool_call` point lands while
the call runs."""


def slow_add(a: int, b: int) -> int:
    """Add two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    time.sleep(TOOL_SECONDS)
    return a + b


def untyped_tool(x):  # noqa: ANN001, ANN201 - the tool without type hints a definition check refuses
    """Return x.

    Args:
        x: Anything.
    """
    return x


class Replies:
    """Answers every assistant turn with the same user message and a reward of 0.5; never done."""

    def __init__(self, config: EnvConfig):
        self.text = str(config.kwargs.get("reply", "Another word, please."))

    def reset(self, prompt_row: dict[str, Any]) -> list[dict[str, Any]]:
        return prompt_messages(prompt_row)

    def step(self, assistant_message: dict[str, Any]) -> EnvStep:
        return EnvStep(messages=[{"role": "user", "content": self.text}], done=False, reward=0.5)


class ScriptedCalls:
    """Answers every assistant turn as if it had called slow_add(2, 3): the call runs in the tools
    environment's worker processes and its result is the tool message; never done. It offers
    the chat template no tools (its `[env] tools` stay empty), so any chat model can run it."""

    def __init__(self, config: EnvConfig):
        self.tools = ToolsEnvironment(config.model_copy(update={"tools": [SLOW_ADD], "tool_workers": 1}))

    def reset(self, prompt_row: dict[str, Any]) -> list[dict[str, Any]]:
        return prompt_messages(prompt_row)

    def step(self, assistant_message: dict[str, Any]) -> EnvStep:
        return self.step_many([assistant_message])[0]

    def step_many(self, assistant_messages: Sequence[dict[str, Any]]) -> list[EnvStep]:
        call = {"type": "function", "function": {"name": "slow_add", "arguments": {"a": 2, "b": 3}}}
        return self.tools.step_many([{**message, "tool_calls": [{**call, "id": f"call_{k}"}]}
                                     for k, message in enumerate(assistant_messages)])

    def close(self) -> None:
        self.tools.close()


class OneTurn:
    """Ends every trajectory after the model's first turn (done, no messages): a multi-turn
    generate or eval through it is a single-turn one."""

    def __init__(self, config: EnvConfig):
        self.config = config

    def reset(self, prompt_row: dict[str, Any]) -> list[dict[str, Any]]:
        return prompt_messages(prompt_row)

    def step(self, assistant_message: dict[str, Any]) -> EnvStep:
        return EnvStep(messages=[], done=True, reward=None)
