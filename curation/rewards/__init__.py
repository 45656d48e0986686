"""Reward functions with TRL's signature `f(prompts, completions, **columns) -> list[float | None]`.

Shipped (by registry name): exact_match, final_answer, math, regex, length_penalty,
overlong_penalty, reward_model, scratchpad_steps. Any importable function is usable as 'module:function'.
"""

from curation.rewards.registry import (
    TRL_COLUMNS,
    column_name,
    completion_text,
    get_reward,
    list_rewards,
    register_reward,
    reward_fingerprint,
    reward_version,
)

__all__ = ["TRL_COLUMNS", "column_name", "completion_text", "get_reward", "list_rewards", "register_reward",
           "reward_fingerprint", "reward_version"]
