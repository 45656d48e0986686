"""Environments: what answers a model's turn in a multi-turn generate.

An environment starts the conversation from a prompt row and answers each assistant turn:

    class Environment(Protocol):
        def reset(self, prompt_row: dict) -> list[dict]: ...        # the opening messages
        def step(self, assistant_message: dict) -> EnvStep: ...     # the answer to one turn

`EnvStep(messages, done, reward)` holds the messages that follow the turn (tool results,
a user's reply), whether the trajectory ends here, and the environment's reward for the turn
(None: it gives none). An environment may also offer `step_many(messages)`, the answers to
one turn of many trajectories at once; `step_many(env, messages)` below calls it, or `step`
on each.

Environments are made by name from an `EnvConfig` (curation/env/config.py):
`@register_environment(name)` on a factory `factory(config) -> Environment`, or
`"module:factory"`; `make_environment(config)` calls it. `check_environment(config,
tokenizer)` checks a definition before a run opens: the environment and tools exist, the
tools have schemas, the names do not clash and the chat template renders them
(`check_model_environment(config, model)`: the same with a model folder's tokenizer, which
must have a chat template; `groupforge run` and `groupforge generate` call it).

The shipped "tools" environment runs the model's tool calls. Its tools reach the model through
the chat template's `tools` (`tools_prompt = "template"`) or, for a template that ignores them
(SmolLM2's), through a system message that lists them in the Hermes form (`"system"`). It keeps no state between
turns, so one instance serves every trajectory of a generate (`step_many` sends all the calls
of a turn to its worker processes together); an environment with per-trajectory state is made
once per trajectory. For each assistant message it parses the `<tool_call>` blocks
(curation/env/calls.py; or takes the message's structured "tool_calls" if it has them): no
block ends the trajectory (done); otherwise each call runs in a worker process of
curation/rewards/pool.py (a fresh interpreter, a timeout per call, CPU and memory limits, a
dead worker replaced) and its result becomes a tool message

    {"role": "tool", "tool_call_id": "call_...", "name": "calculator", "content": "6912"}

A call that cannot run becomes a tool error: its message's content is one "error: ..." line,
and the round goes on. Tool errors are: a block that is not a call (invalid JSON, no name),
an unknown tool name, a tool that raises (wrong arguments included), one that runs past
`tool_timeout_s` or its CPU or memory limit or kills its worker, and a result that is not
text: None, an object without a text form (or whose __str__ raises), a dict or list that is
not JSON, or text over `max_result_chars`. Numbers become their str(); dicts and lists JSON.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from curation.env.calls import CallParseError, ToolCall, parse_tool_calls
from curation.env.config import EnvConfig
from curation.env.tools import Tool, get_tool, tool_call_name, tool_schema
from curation.rewards.pool import CallEach, WorkerPool, default_workers, error_text
from curation.rewards.registry import add_to_registry, import_reference


@dataclass
class EnvStep:
    """The environment's answer to one assistant turn.

    messages: what follows the turn in the conversation (tool results, a user's reply).
    done: the trajectory ends after this turn.
    reward: the environment's reward for the turn; None where it gives none.
    tool_calls, tool_errors: the turn's tool calls, and those that failed (see the module).
    calls: the turn's parsed calls in the OpenAI form of an assistant message's "tool_calls",
        [{"id", "type": "function", "function": {"name", "arguments": {...}}}], whose ids the
        tool messages answer (a block that could not be parsed has no entry, only its error
        message).
    """

    messages: list[dict[str, Any]]
    done: bool
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)


@runtime_checkable
class Environment(Protocol):
    """What answers a model's turns: `reset` gives a prompt row's opening messages, `step` the
    answer to an assistant message ({"role": "assistant", "content": text})."""

    def reset(self, prompt_row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, assistant_message: dict[str, Any]) -> EnvStep: ...


EnvironmentFactory = Callable[[EnvConfig], Environment]
_REGISTRY: dict[str, EnvironmentFactory] = {}


def prompt_messages(prompt_row: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a prompt row starts with: its `messages`, or its `prompt` as one user message."""
    messages = prompt_row.get("messages")
    if messages:
        return [dict(m) for m in messages]
    prompt = prompt_row.get("prompt")
    if prompt is None:
        raise ValueError(f"prompt row {prompt_row.get('prompt_id', '')!r}: neither 'prompt' nor 'messages'")
    return [{"role": "user", "content": prompt}]


def step_many(env: Environment, assistant_messages: Sequence[dict[str, Any]]) -> list[EnvStep]:
    """The environment's answers to one turn of many trajectories: its `step_many` when it has
    one, else `step` on each message in order."""
    batch = getattr(env, "step_many", None)
    if batch is not None:
        return batch(assistant_messages)
    return [env.step(message) for message in assistant_messages]


# ---- the registry -------------------------------------------------------------------


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    """Register an environment factory under `name`: `factory(config: EnvConfig) -> Environment`
    (a class whose __init__ takes the config is one)."""
    if ":" in name or not name:
        raise ValueError(f"environment name {name!r}: must be non-empty and without ':'")

    def decorator(factory: EnvironmentFactory) -> EnvironmentFactory:
        return add_to_registry(_REGISTRY, "environment", name, factory)

    return decorator


def environment_names() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(_REGISTRY)


def get_environment(name: str) -> EnvironmentFactory:
    """The factory of a registered environment name or a 'module:factory' reference."""
    if ":" in name:
        obj = import_reference(name, "environment")
        if not callable(obj):
            raise ValueError(f"environment {name!r} is a {type(obj).__name__}, not a factory")
        return obj
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(environment_names())}; "
                         "or give a 'module:factory'")
    return _REGISTRY[name]


def template_tools(env: Environment) -> list[dict[str, Any]] | None:
    """The tool schemas the environment gives the chat template (its optional `template_tools`),
    None when it gives none."""
    return getattr(env, "template_tools", None)


def make_environment(config: EnvConfig) -> Environment:
    """The environment `config.name` names, made from `config`."""
    env = get_environment(config.name)(config)
    if not isinstance(env, Environment):
        raise ValueError(f"environment {config.name!r}: its factory returned a {type(env).__name__}, "
                         "which has no reset(prompt_row) and step(assistant_message)")
    return env


@contextmanager
def opened_environment(config: EnvConfig) -> Iterator[Environment]:
    """`make_environment(config)` for the block, closed after it (its optional `close`: the
    tools environment stops its worker processes)."""
    env = make_environment(config)
    try:
        yield env
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()


# ---- definition checks --------------------------------------------------------------


def tool_table(names: Sequence[str]) -> dict[str, Tool]:
    """{the name the model calls it by: function} of the configured tool names; ValueError (one
    line) for an unknown tool, a tool without a schema, a tool the worker processes cannot
    import, or two tools the model would call by one name."""
    tools: dict[str, Tool] = {}
    for name in names:
        fn = get_tool(name)
        call_name = tool_call_name(name)
        tool_schema(fn, call_name)
        if call_name in tools:
            raise ValueError(f"tool {name!r}: two tools are called {call_name!r}")
        if fn.__module__ == "__main__":
            raise ValueError(f"tool {name!r} is defined in __main__, which worker processes cannot import; "
                             "define it in a module")
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - a nested function, a lambda
            raise ValueError(f"tool {name!r} cannot be sent to worker processes ({error_text(exc)}); "
                             "define it at module level") from None
        tools[call_name] = fn
    return tools


def tool_schemas(names: Sequence[str]) -> list[dict[str, Any]]:
    """The function schemas of the configured tools, in order: the chat template's `tools`."""
    return [tool_schema(fn, call_name) for call_name, fn in tool_table(names).items()]


def check_environment(config: EnvConfig, tokenizer: Any = None) -> list[dict[str, Any]]:
    """Check an environment definition before a run opens and return its tools' schemas: a
    ValueError of one line for an unknown environment, an unknown tool or one without a schema
    (type hints, docstring), the tools environment without tools, and, given the model's
    tokenizer, a chat template that cannot render the tools (`check_tools_render`)."""
    try:
        get_environment(config.name)
        if config.name == "tools" and not config.tools:
            raise ValueError("the tools environment needs at least one tool in `tools` (e.g. 'calculator')")
        schemas = tool_schemas(config.tools)
        if tokenizer is not None and schemas and config.tools_prompt == "template":
            check_tools_render(tokenizer, schemas)
        elif tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {getattr(tokenizer, 'name_or_path', '') or 'the model'} has no chat "
                             "template, which a multi-turn generate needs")
    except ValueError as exc:
        raise ValueError(f"[env] {exc}") from None
    return schemas


def check_model_environment(config: EnvConfig, model: str | Path, trust_remote_code: bool = False
                            ) -> list[dict[str, Any]]:
    """`check_environment` with the tokenizer of the model folder `model` (a path, or an
    object-store URL: this machine's copy), which must have a chat template: the multi-turn
    driver renders every conversation with it. Returns the tools' schemas; a ValueError of one
    line starting "[env]" otherwise."""
    from transformers import AutoTokenizer

    from store.location import local_folder

    tokenizer = AutoTokenizer.from_pretrained(local_folder(model), trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"[env] the tokenizer of model folder {model} has no chat template, which a multi-turn "
                         "generate renders every conversation with: use a model whose tokenizer has one")
    return check_environment(config, tokenizer)


def check_tools_render(tokenizer: Any, schemas: Sequence[dict[str, Any]]) -> None:
    """A ValueError of one line unless the tokenizer's chat template renders the tools: it has no
    template, rendering a user turn with `tools=schemas` raises, or the rendered prompt does not
    name every tool more often than the same prompt without tools (the template ignores them)."""
    where = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where.replace('the chat template of', 'the tokenizer of')} has no chat template, "
                         "so it cannot render tools")
    messages = [{"role": "user", "content": "x"}]
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=list(schemas), tokenize=False,
                                                   add_generation_prompt=True)
        without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - any template error is the definition's
        raise ValueError(f"{where} cannot render the tools: {error_text(exc)}") from None
    names = [schema["function"]["name"] for schema in schemas]
    ignored = [name for name in names if with_tools.count(name) <= without.count(name)]
    if ignored:
        raise ValueError(f"{where} ignores tools: the prompt it renders does not name {', '.join(ignored)}; "
                         "use a model whose template renders `tools`, or give it one that does")


# ---- the tools environment ----------------------------------------------------------


def tools_system_text(schemas: Sequence[dict[str, Any]]) -> str:
    """A system message's description of the tools in the Hermes form (the schemas as JSON
    inside <tools>, a call as a <tool_call> block), for a template that does not render `tools`."""
    listed = "\n".join(json.dumps(schema, sort_keys=True) for schema in schemas)
    return ("You may call tools to help you answer. The tools:\n<tools>\n" + listed + "\n</tools>\n"
            'To call one, write <tool_call>{"name": "<tool name>", "arguments": {<its arguments>}}</tool_call>; '
            "its result comes back in a tool message. When you have the answer, reply without a tool call.")


def tool_result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the tool message's text: a str as it is, a number's str(), a
    dict or list as JSON, an object's own __str__; TypeError for None, an object without a
    text form or a dict that is not JSON, ValueError for text over `max_chars` or that UTF-8
    cannot encode (the tables store UTF-8)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float)):
        text = str(value)
    elif isinstance(value, (dict, list, tuple)):
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"tool returned a {type(value).__name__} that is not JSON ({exc})") from None
    elif value is None:
        raise TypeError("tool returned None, not text")
    elif type(value).__str__ is object.__str__:
        raise TypeError(f"tool returned a {type(value).__name__}, which has no text form")
    else:
        text = str(value)
    if len(text) > max_chars:
        raise ValueError(f"tool result of {len(text)} characters is over the limit of {max_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("tool result is not valid Unicode text (a lone surrogate)") from None
    return text


class RunTool:
    """What a tool worker does with one call: run the tool and make its result text."""

    def __init__(self, tools: dict[str, Tool], max_result_chars: int):
        self.tools, self.max_result_chars = tools, max_result_chars

    def __call__(self, call: tuple[str, dict[str, Any]]) -> str:
        name, arguments = call
        return tool_result_text(self.tools[name](**arguments), self.max_result_chars)


@dataclass(frozen=True)
class _Pending:
    """A call of one message, identified, before it runs."""

    id: str
    call: ToolCall | CallParseError


@register_environment("tools")
class ToolsEnvironment:
    """Runs an assistant message's tool calls in isolated worker processes (see the module)."""

    def __init__(self, config: EnvConfig):
        self.config = config
        self.tools = tool_table(config.tools)
        self.schemas = [tool_schema(fn, name) for name, fn in self.tools.items()]
        self._pool: WorkerPool | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The schemas the chat template renders (`tools_prompt = "template"`), else None."""
        return self.schemas if self.config.tools_prompt == "template" else None

    def reset(self, prompt_row: dict[str, Any]) -> list[dict[str, Any]]:
        """The prompt row's messages; with `tools_prompt = "system"` the tools are described in its
        system message (`tools_system_text`), added first or put before the row's own."""
        messages = prompt_messages(prompt_row)
        if self.config.tools_prompt != "system":
            return messages
        text = tools_system_text(self.schemas)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def step(self, assistant_message: dict[str, Any]) -> EnvStep:
        """The tool messages answering one assistant message; done when it calls no tool."""
        return self.step_many([assistant_message])[0]

    def step_many(self, assistant_messages: Sequence[dict[str, Any]]) -> list[EnvStep]:
        """`step` of each message, the calls of all of them run in the workers together."""
        pending = [self._calls_of(message) for message in assistant_messages]
        runnable = [(k, j) for k, calls in enumerate(pending) for j, p in enumerate(calls)
                    if isinstance(p.call, ToolCall) and p.call.name in self.tools]
        items = [(pending[k][j].call.name, pending[k][j].call.arguments) for k, j in runnable]
        results, errors = self._run(items)
        outcome = {place: (result, error) for place, result, error in zip(runnable, results, errors)}
        steps = []
        for k, calls in enumerate(pending):
            messages, parsed, failed = [], [], 0
            for j, p in enumerate(calls):
                content, failed_here = self._answer(p, outcome.get((k, j)))
                name = "" if isinstance(p.call, CallParseError) else p.call.name
                if isinstance(p.call, ToolCall):
                    parsed.append({"id": p.id, "type": "function",
                                   "function": {"name": name, "arguments": p.call.arguments}})
                failed += failed_here
                messages.append({"role": "tool", "tool_call_id": p.id, "name": name, "content": content})
            steps.append(EnvStep(messages=messages, done=not calls, reward=None, tool_calls=len(calls),
                                 tool_errors=failed, calls=parsed))
        return steps

    def _answer(self, pending: _Pending, outcome: tuple[Any, str | None] | None) -> tuple[str, bool]:
        """(the tool message's content for one call, whether it is a tool error)."""
        call = pending.call
        if isinstance(call, CallParseError):
            return f"error: could not parse the tool call: {call.error}", True
        if call.name not in self.tools:
            return f"error: unknown tool {call.name!r}; the tools are: {', '.join(self.tools)}", True
        result, error = outcome
        return (result, False) if error is None else (f"error: {error}", True)

    def close(self) -> None:
        """Stop the tool workers (a later step starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> ToolsEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _calls_of(self, message: dict[str, Any]) -> list[_Pending]:
        """The message's calls with their ids: its structured "tool_calls" if it has them, else
        the `<tool_call>` blocks of its content."""
        structured = message.get("tool_calls")
        if structured:
            return [_Pending(str(entry.get("id") or f"call_{j}") if isinstance(entry, dict) else f"call_{j}",
                             _structured_call(entry))
                    for j, entry in enumerate(structured)]
        content = message.get("content") or ""
        if not isinstance(content, str):
            return [_Pending("call_0", CallParseError(f"content is a {type(content).__name__}, not text", ""))]
        digest = hashlib.sha256(content.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        return [_Pending(f"call_{digest}_{j}", call) for j, call in enumerate(parse_tool_calls(content))]

    def _run(self, items: list[tuple[str, dict[str, Any]]]) -> tuple[list[Any], list[str | None]]:
        if not items:
            return [], []
        if self._pool is None:
            config = self.config
            self._pool = WorkerPool(CallEach(RunTool(self.tools, config.max_result_chars)),
                                    timeout_s=config.tool_timeout_s, workers=config.tool_workers or default_workers(),
                                    memory_mb=config.tool_memory_mb,
                                    cpu_s=config.tool_cpu_seconds or config.tool_timeout_s,
                                    what="tool", describe=f"tools {', '.join(self.tools)}",
                                    started_point="env.tool_call")
        return self._pool.run(len(items), lambda start, stop: pickle.dumps(items[start:stop]))


def _structured_call(entry: Any) -> ToolCall | CallParseError:
    """A call from an OpenAI-form "tool_calls" entry ({"function": {"name", "arguments"}})."""
    function = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(function, dict):
        return CallParseError('a tool_calls entry needs a "function" object', str(entry)[:200])
    found = parse_tool_calls(f"<tool_call>{json.dumps(function, default=str)}</tool_call>")
    return found[0]

