"""Reward functions by name, with TRL's signature, and their fingerprints.

A reward function scores a batch of completions:

    f(prompts: list, completions: list, **columns) -> list[float | None]

exactly as TRL calls its `reward_funcs`, so a TRL reward function plugs in unchanged. `None`
means "not applicable" (e.g. no reference). The score stage passes these columns, one list
entry per completion: reference, metadata, prompt_id, sample_idx, run_id, round, group_size,
finish_reason, policy_version, response_token_ids (and its TRL name completion_ids).
Prompts are strings, or message lists for chat prompts; then, as in TRL, each completion is
`[{"role": "assistant", "content": text}]`.

A multi-turn sample (a trajectory: the samples table's trajectory columns) is conversational
as TRL's tool-calling completions are: its prompt is the prompt's message list (a text prompt
as one user turn) and its completion the trajectory's messages after the prompt (messages_out:
assistant turns with `tool_calls`, `tool` messages, environment `user` turns), ending with the
last assistant turn, so `completion_text` is its `response`. The rewards also get its
TRAJECTORY_COLUMNS (num_turns, tool_calls, tool_errors, stop_reason, turn_rewards; None in the
rows of single-turn samples). A table of single-turn samples gives exactly the arguments above.

Names resolve in two ways:

- a registered name: `@register_reward("exact_match")` on a factory (a class or function)
  whose keyword arguments are the spec's `kwargs`; it returns the callable;
- `"module:function"`: any importable function (or callable class) - a user's TRL reward.

Factories return picklable callable classes, not closures, because the score stage runs
reward functions in worker processes. Optional attributes of a reward callable:

- `version` (str): part of its fingerprint; bump it when its scores change.
- `vectorized(completions, **columns) -> pa.Array`: the same scores over Arrow columns, used
  instead of per-row Python calls.
- `isolate` (bool, default True): False runs it in the stage's process, batched (a reward
  model holding weights); True runs it one completion at a time in a process pool with a
  per-item timeout.
- `prepare()`: called once in each worker before its first item, outside the item timeout
  (import heavy modules, load tables).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

RewardFunction = Callable[..., list]
_REGISTRY: dict[str, Callable[..., RewardFunction]] = {}

# Columns every reward function receives (besides prompts and completions), in this order.
TRL_COLUMNS = ("reference", "metadata", "prompt_id", "sample_idx", "run_id", "round", "group_size",
               "finish_reason", "policy_version", "response_token_ids")

# Columns a reward function also receives when some of its rows are trajectories (a multi-turn
# samples table); messages_out becomes the completion itself.
TRAJECTORY_COLUMNS = ("messages_out", "num_turns", "tool_calls", "tool_errors", "stop_reason", "turn_rewards")


def register_reward(name: str) -> Callable:
    """Register a reward factory under `name`; the factory's kwargs are the spec's kwargs.

    >>> @register_reward("always_one")
    ... class AlwaysOne:
    ...     version = "1"
    ...     def __call__(self, prompts, completions, **columns):
    ...         return [1.0] * len(completions)
    >>> get_reward("always_one")(["1+1="], ["2"])
    [1.0]
    """
    if ":" in name or not name:
        raise ValueError(f"reward name {name!r}: must be non-empty and without ':'")

    def decorator(factory):
        return add_to_registry(_REGISTRY, "reward", name, factory)

    return decorator


def list_rewards() -> dict[str, str]:
    """{name: first line of its docstring} of every registered reward, sorted by name."""
    _load_builtins()
    return {name: (inspect.getdoc(f) or "").split("\n")[0] for name, f in sorted(_REGISTRY.items())}


def add_to_registry(registry: dict[str, Any], kind: str, name: str, obj: Any) -> Any:
    """Put `obj` in `registry` under `name` and return it; a ValueError naming the `kind` when
    another object holds the name (the same function defined again by a re-import, same module
    and qualified name, replaces it)."""
    old = registry.get(name)
    if old is not None and old is not obj and (old.__module__, old.__qualname__) != (obj.__module__, obj.__qualname__):
        raise ValueError(f"{kind} {name!r} is already registered by {old.__module__}.{old.__qualname__}")
    registry[name] = obj
    return obj


def import_reference(name: str, kind: str) -> Any:
    """The object a 'module:attr' (or 'module:Class.attr') reference names; a ValueError of one
    line naming the `kind` ("reward", "tool", "environment") when it cannot be imported."""
    module_name, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{kind} {name!r}: cannot import ({type(exc).__name__}: {exc})") from None
    return obj


def get_reward(name: str, **kwargs: Any) -> RewardFunction:
    """The reward callable for a registered name or a 'module:function' path.

    For 'module:function', a class is instantiated with `kwargs`; a function gets them bound
    with functools.partial (which pickles when the function is importable).
    """
    if ":" in name:
        obj = import_reference(name, "reward")
        if inspect.isclass(obj):
            return obj(**kwargs)
        if not callable(obj):
            raise ValueError(f"reward {name!r} is a {type(obj).__name__}, not a function")
        return functools.partial(obj, **kwargs) if kwargs else obj
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered: {', '.join(sorted(_REGISTRY))}; "
                         "or give a 'module:function'")
    return _REGISTRY[name](**kwargs)


def reward_version(fn: RewardFunction) -> str:
    """`fn.version`, or for a plain function without one: 'src-' + a hash of its source code,
    so editing a user's function rescored its column."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    version = getattr(target, "version", None)
    if version is not None:
        return str(version)
    try:
        source = inspect.getsource(target if inspect.isfunction(target) or inspect.isclass(target)
                                   else type(target))
    except (OSError, TypeError):
        return "unversioned"
    return "src-" + hashlib.sha256(source.encode()).hexdigest()[:12]


def reward_fingerprint(name: str, fn: RewardFunction, kwargs: Mapping[str, Any]) -> str:
    """'<name>@<version>#<hash of kwargs>': what a scores column was computed with.

    >>> reward_fingerprint("exact_match", get_reward("exact_match"), {})
    'exact_match@1#44136fa355b3'
    """
    canonical = json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":"), default=str)
    return f"{name}@{reward_version(fn)}#{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def column_name(name: str) -> str:
    """The default scores column of a reward name: 'my_pkg.rewards:accuracy' -> 'my_pkg_rewards_accuracy'."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_") or "reward_fn"


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the last message of a chat completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content") or "")
    raise TypeError(f"completion of type {type(completion).__name__} is neither text nor a message list")


def trl_arguments(table: pa.Table) -> tuple[list, list, dict[str, list]]:
    """(prompts, completions, columns) in TRL's form from a table of prompt, messages,
    response and the TRL_COLUMNS (which the score stage builds), and the TRAJECTORY_COLUMNS
    when it has them: a row whose messages_out is not null is a trajectory (the module)."""
    prompt = table.column("prompt").to_pylist()
    messages = table.column("messages").to_pylist()
    responses = table.column("response").to_pylist()
    prompts = [p if p is not None else m for p, m in zip(prompt, messages)]
    completions = [r if p is not None else [{"role": "assistant", "content": r}]
                   for p, r in zip(prompt, responses)]
    columns = {c: table.column(c).to_pylist() for c in TRL_COLUMNS if c in table.column_names}
    if "response_token_ids" in columns:
        columns["completion_ids"] = columns["response_token_ids"]
    if "messages_out" in table.column_names:
        for i, out in enumerate(table.column("messages_out").to_pylist()):
            if out is not None:
                prompts[i] = messages[i] if messages[i] is not None else [{"role": "user", "content": prompt[i]}]
                completions[i] = json.loads(out)
        columns.update({c: table.column(c).to_pylist() for c in TRAJECTORY_COLUMNS[1:] if c in table.column_names})
    return prompts, completions, columns


@functools.cache
def _load_builtins() -> None:
    """Import the shipped rewards so that their @register_reward runs."""
    importlib.import_module("curation.rewards.rules")
    importlib.import_module("curation.rewards.math_answers")
    importlib.import_module("curation.rewards.reward_model")
    importlib.import_module("curation.rewards.scratchpad")
