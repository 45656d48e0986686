"""Tools and environments (curation/env/): schemas from type hints, the calculator, tool-call
parsing, the tools environment over real isolated worker processes, and the definition checks
with SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import pickle
import re
import sys
import textwrap
import time
from typing import Literal, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from curation.env import (
    CallParseError,
    EnvConfig,
    EnvStep,
    ToolCall,
    ToolsEnvironment,
    calculator,
    check_environment,
    check_tools_render,
    content_without_calls,
    get_environment,
    get_tool,
    make_environment,
    parse_tool_calls,
    register_environment,
    register_tool,
    step_many,
    tool_names,
    tool_schema,
)
from curation.rewards.pool import CallEach, WorkerPool, call_isolated

USER_MODULE = "gf_user_tools_t"


@pytest.fixture(scope="module")
def user_tools(tmp_path_factory) -> str:
    """A user's tool module on sys.path (the worker processes import it by name)."""
    folder = tmp_path_factory.mktemp("user_tools")
    (folder / f"{USER_MODULE}.py").write_text(textwrap.dedent('''
        import os, time

        class NoText:
            def __str__(self):
                raise RuntimeError("no text here")

        def echo(text: str) -> str:
            """Echo the text.

            Args:
                text: What to echo.
            """
            return text

        def explode(reason: str) -> str:
            """Raise an error.

            Args:
                reason: The error message.
            """
            raise ValueError(reason)

        def sleep(seconds: float) -> str:
            """Sleep, then say so.

            Args:
                seconds: How long.
            """
            time.sleep(seconds)
            return "awake"

        def garbage(kind: str) -> str:
            """Return something that is not text.

            Args:
                kind: notext, none, huge, dict, number or exit.
            """
            if kind == "notext":
                return NoText()
            if kind == "none":
                return None
            if kind == "huge":
                return "x" * 100_000
            if kind == "dict":
                return {"a": [1, 2]}
            if kind == "number":
                return 42
            if kind == "surrogate":
                return "bad " + chr(0xD800)
            if kind == "exit":
                os._exit(3)
            return object()

        def untyped(x) -> str:
            """No type hint.

            Args:
                x: Anything.
            """
            return str(x)

        def square(item):
            if item == "HANG":
                time.sleep(60)
            if item == "RAISE":
                raise KeyError(item)
            return item * 2
    '''))
    sys.path.insert(0, str(folder))
    yield USER_MODULE
    sys.path.remove(str(folder))
    sys.modules.pop(USER_MODULE, None)


# ---- schemas ------------------------------------------------------------------------


def typed_tool(city: str, days: int, scale: float, detailed: bool, tags: list[str], extra: dict,
               unit: Literal["c", "f"] = "c", note: Optional[str] = None, limit: int | None = None) -> str:
    """Get the weather forecast
    for a city.

    Args:
        city: The city's name.
        days (int): Days ahead,
            counted from today.
        scale: A factor.
        detailed: Whether to add details.
        tags: Labels to attach.
        extra: Anything else.
        unit: Celsius or Fahrenheit.
        note: A free note.
        limit: At most this many.

    Returns:
        The forecast.
    """
    return ""


def test_schema_from_type_hints_and_docstring():
    schema = tool_schema(typed_tool)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "typed_tool"
    assert function["description"] == "Get the weather forecast for a city."
    props = function["parameters"]["properties"]
    assert function["parameters"]["type"] == "object"
    assert props["city"] == {"type": "string", "description": "The city's name."}
    assert props["days"] == {"type": "integer", "description": "Days ahead, counted from today."}
    assert props["scale"]["type"] == "number" and props["detailed"]["type"] == "boolean"
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "Labels to attach."}
    assert props["extra"]["type"] == "object"
    assert props["unit"] == {"type": "string", "enum": ["c", "f"], "description": "Celsius or Fahrenheit."}
    assert props["note"] == {"type": "string", "nullable": True, "description": "A free note."}
    assert props["limit"]["type"] == "integer" and props["limit"]["nullable"] is True
    assert function["parameters"]["required"] == ["city", "days", "scale", "detailed", "tags", "extra"]
    json.dumps(schema)  # what a chat template gets is plain JSON


def no_hint(x, y: int) -> str:
    """A tool.

    Args:
        x: One.
        y: Two.
    """
    return ""


def odd_type(x: set[int]) -> str:
    """A tool.

    Args:
        x: A set.
    """
    return ""


def no_doc(x: int) -> str:
    return ""


def missing_arg(x: int, y: int) -> str:
    """A tool.

    Args:
        x: One.
    """
    return ""


def star_args(*values: int) -> str:
    """A tool.

    Args:
        values: Numbers.
    """
    return ""


@pytest.mark.parametrize("fn, message", [
    (no_hint, "tool 'no_hint': parameter 'x' has no type hint"),
    (odd_type, "tool 'odd_type': parameter 'x' has an unsupported type set[int]"),
    (no_doc, "tool 'no_doc': no docstring"),
    (missing_arg, "tool 'missing_arg': parameter 'y' is not described in the docstring's 'Args:' section"),
    (star_args, "tool 'star_args': parameter 'values' is *args or **kwargs"),
])
def test_schema_errors_are_one_line(fn, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        tool_schema(fn)
    assert "\n" not in str(info.value)


def test_registry_by_name_and_module_function(user_tools):
    assert "calculator" in tool_names() and get_tool("calculator") is calculator

    def triple(x: int) -> str:
        """Triple a number.

        Args:
            x: The number.
        """
        return str(3 * x)

    register_tool("test_triple")(triple)
    assert get_tool("test_triple")(x=2) == "6"
    assert get_tool("test_triple") is triple
    with pytest.raises(ValueError, match="already registered"):
        register_tool("calculator")(triple)
    with pytest.raises(ValueError, match="has no type hint"):  # checked where it is registered
        register_tool("test_untyped")(no_hint)
    assert "test_untyped" not in tool_names()
    with pytest.raises(ValueError, match="unknown tool 'nope'; registered: .*calculator"):
        get_tool("nope")
    assert get_tool(f"{user_tools}:echo")(text="hi") == "hi"
    with pytest.raises(ValueError, match="cannot import"):
        get_tool(f"{user_tools}:missing")
    with pytest.raises(ValueError, match="parameter 'x' has no type hint"):
        get_tool(f"{user_tools}:untyped")


# ---- the calculator -----------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("1234 + 5678", "6912"),
    ("(1234 + 5678) * 3", "20736"),
    ("987654321 * 123456789", str(987654321 * 123456789)),
    ("7 / 2", "3.5"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("17 % 5", "2"),
    ("2 ** 10", "1024"),
    ("2 ** -1", "0.5"),
    ("-(3 - 10)", "7"),
    ("+4", "4"),
    ("1.5 * 4", "6.0"),
    (" 12 ", "12"),
])
def test_calculator_results(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("'a' * 3", "str 'a' is not a number"),
    ("True + 1", "bool True is not a number"),
    ("9 ** 9 ** 9", "result too large"),
    ("10 ** 100 * 10 ** 100", "result too large"),
    ("2.0 ** 5000", "result too large"),
    ("1e308 * 10", "result too large"),
    ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1+" * 300 + "1", "over the limit of 500"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


# ---- parsing calls ------------------------------------------------------------------


def test_parse_hermes_blocks_with_text_around():
    text = ('I will compute both.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n'
            '</tool_call>\nand\n<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+2"}), ToolCall("echo", {"text": "hi"})]
    assert content_without_calls(text) == "I will compute both.\n\nand\n done"


def test_parse_smollm2_list_block():
    text = ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}, {"name": "c"}]'
            '</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {})]
    assert content_without_calls(text) == ""


def test_parse_errors_take_the_place_of_the_bad_block():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", arguments: }</tool_call>'  # not JSON
            '<tool_call>{"arguments": {"x": 1}}</tool_call>'  # no name
            '<tool_call>[{"name": "c"}, 7]</tool_call>'  # a list with a bad entry
            '<tool_call>{"name": "d", "arguments": "{nope"}</tool_call>'  # arguments: a string, not JSON
            '<tool_call>{"name": "e", "arguments": [1]}</tool_call>'  # arguments: not an object
            '<tool_call>"just text"</tool_call>'
            '<tool_call>[]</tool_call>'
            'tail <tool_call>{"name": "f"')  # left open
    found = parse_tool_calls(text)
    assert [type(c).__name__ for c in found] == ["ToolCall", "CallParseError", "CallParseError", "ToolCall",
                                                 "CallParseError", "CallParseError", "CallParseError",
                                                 "CallParseError", "CallParseError", "CallParseError"]
    errors = [c.error for c in found if isinstance(c, CallParseError)]
    assert errors[0].startswith("invalid JSON: ")
    assert errors[1:] == ['a call needs a "name" string', "a call must be a JSON object, got a number",
                          errors[3], "arguments of 'e' must be a JSON object, got a list",
                          "a call must be a JSON object, got a string", "an empty list of calls",
                          "<tool_call> without </tool_call>"]
    assert errors[3].startswith("arguments of 'd' are not valid JSON: ")
    assert found[3] == ToolCall("c", {})
    assert content_without_calls(text) == "tail"


def test_no_block_no_call():
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("") == []
    assert content_without_calls("  The answer is 42. ") == "The answer is 42."


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', ":", '"a"', ",",
                                 '"arguments"', "1", "null", "\\", " ", "text", "\n"]), max_size=30))
def test_parsing_never_raises_on_model_text(pieces):
    text = "".join(pieces)
    found = parse_tool_calls(text)
    assert all(isinstance(c, (ToolCall, CallParseError)) for c in found)
    assert isinstance(content_without_calls(text), str)


# ---- the worker pool's generic primitive --------------------------------------------


def test_call_isolated_isolates_each_item(user_tools):
    module = __import__(user_tools)
    tic = time.monotonic()
    results, errors = call_isolated(module.square, [1, "HANG", 3, "RAISE", "ab"], timeout_s=0.5, workers=2,
                                    chunk_items=2, what="test")
    assert results == [2, None, 6, None, "abab"]
    assert errors == [None, "timeout after 0.5s", None, "KeyError: 'RAISE'", None]
    assert time.monotonic() - tic < 20


def test_worker_pool_serves_several_runs(user_tools):
    module = __import__(user_tools)
    items = [1, 2, 3]
    with WorkerPool(CallEach(module.square), timeout_s=5, workers=1, what="test") as pool:
        assert pool.run(3, lambda a, b: pickle.dumps(items[a:b])) == ([2, 4, 6], [None] * 3)
        pid = pool.workers[0].process.pid
        assert pool.run(2, lambda a, b: pickle.dumps(items[a:b])) == ([2, 4], [None] * 2)
        assert pool.workers[0].process.pid == pid  # the same worker, not a new interpreter per run
    assert pool.workers == []


# ---- the tools environment ----------------------------------------------------------


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.fixture(scope="module")
def tools_env(user_tools):
    config = EnvConfig(tools=["calculator", f"{user_tools}:echo", f"{user_tools}:explode", f"{user_tools}:sleep",
                              f"{user_tools}:garbage"], tool_timeout_s=1.0, tool_workers=2, max_result_chars=1000)
    env = make_environment(config)
    yield env
    env.close()


def test_tools_environment_records_every_failure_and_goes_on(tools_env):
    assert isinstance(tools_env, ToolsEnvironment)
    message = {"role": "assistant", "content": "Let me see. " + "".join([
        call("calculator", expression="1234 + 5678"),
        call("explode", reason="boom"),
        call("sleep", seconds=30),
        call("garbage", kind="notext"),
        call("garbage", kind="none"),
        call("garbage", kind="huge"),
        call("garbage", kind="object"),
        call("garbage", kind="exit"),
        call("no_such_tool"),
        "<tool_call>{not json}</tool_call>",
        call("echo", text="after the failures"),
        call("echo", wrong="argument"),
        call("garbage", kind="dict"),
        call("garbage", kind="number"),
        call("garbage", kind="surrogate"),
    ])}
    tic = time.monotonic()
    step = tools_env.step(message)
    assert time.monotonic() - tic < 20  # the hanging call was stopped at its timeout, not after 30 s
    contents = [m["content"] for m in step.messages]
    assert contents[0] == "6912"
    assert contents[1] == "error: ValueError: boom"
    assert contents[2] == "error: timeout after 1s"
    assert contents[3] == "error: RuntimeError: no text here"
    assert contents[4] == "error: TypeError: tool returned None, not text"
    assert contents[5] == "error: ValueError: tool result of 100000 characters is over the limit of 1000"
    assert contents[6] == "error: TypeError: tool returned a object, which has no text form"
    assert contents[7] == "error: tool worker died (exit code 3)"
    assert contents[8].startswith("error: unknown tool 'no_such_tool'; the tools are: calculator, echo, ")
    assert contents[9].startswith("error: could not parse the tool call: invalid JSON: ")
    assert contents[10] == "after the failures"
    assert contents[11].startswith("error: TypeError: ") and "wrong" in contents[11]
    assert contents[12] == '{"a": [1, 2]}' and contents[13] == "42"
    assert contents[14] == "error: ValueError: tool result is not valid Unicode text (a lone surrogate)"
    assert all("\n" not in c for c in contents)
    assert step.tool_calls == 15 and step.tool_errors == 11
    assert step.done is False and step.reward is None
    assert [m["role"] for m in step.messages] == ["tool"] * 15
    assert [m["name"] for m in step.messages][:3] == ["calculator", "explode", "sleep"]
    assert step.messages[9]["name"] == ""
    # every parsed call is in `calls`, its id answered by the tool message in the same place
    ids = [m["tool_call_id"] for m in step.messages]
    assert len(set(ids)) == 15
    assert [c["id"] for c in step.calls] == ids[:9] + ids[10:]
    assert step.calls[0] == {"id": ids[0], "type": "function",
                             "function": {"name": "calculator", "arguments": {"expression": "1234 + 5678"}}}


def test_step_many_answers_each_trajectory_in_order(tools_env):
    messages = [
        {"role": "assistant", "content": call("calculator", expression=f"{i} * 1111")} for i in range(6)
    ] + [
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "assistant", "content": call("calculator", expression="2 ** 1000") + call("echo", text="x")},
        {"role": "assistant", "content": None},
    ]
    steps = step_many(tools_env, messages)
    assert [s.messages[0]["content"] for s in steps[:6]] == [str(i * 1111) for i in range(6)]
    assert all(not s.done and s.tool_calls == 1 and s.tool_errors == 0 for s in steps[:6])
    assert steps[6] == EnvStep(messages=[], done=True, reward=None, tool_calls=0, tool_errors=0, calls=[])
    assert steps[7].tool_calls == 2 and steps[7].tool_errors == 1
    assert steps[7].messages[0]["content"] == "error: ValueError: result too large (over 100 digits)"
    assert steps[7].messages[1]["content"] == "x"
    assert steps[8].done is True


def test_structured_tool_calls_are_taken_as_given(tools_env):
    step = tools_env.step({"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc", "type": "function", "function": {"name": "echo", "arguments": '{"text": "hi"}'}},
        {"id": "def", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}},
    ]})
    assert [(m["tool_call_id"], m["content"]) for m in step.messages] == [("abc", "hi"), ("def", "42")]


def test_reset_gives_the_prompt_messages(tools_env):
    assert tools_env.reset({"prompt": "12+30=", "messages": None}) == [{"role": "user", "content": "12+30="}]
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+2?"}]
    assert tools_env.reset({"prompt": None, "messages": chat}) == chat
    with pytest.raises(ValueError, match="neither 'prompt' nor 'messages'"):
        tools_env.reset({"prompt_id": "p1", "prompt": None, "messages": None})


class CountdownEnv:
    """A custom environment: asks again until the third turn."""

    def __init__(self, config: EnvConfig):
        self.turns = config.kwargs.get("turns", 3)
        self.seen = 0

    def reset(self, prompt_row):
        return [{"role": "user", "content": prompt_row["prompt"]}]

    def step(self, assistant_message):
        self.seen += 1
        done = self.seen >= self.turns
        return EnvStep(messages=[] if done else [{"role": "user", "content": "again"}], done=done,
                       reward=1.0 if done else None)


def test_a_registered_environment_without_step_many():
    register_environment("test_countdown")(CountdownEnv)
    assert get_environment("test_countdown") is CountdownEnv
    env = make_environment(EnvConfig(name="test_countdown", kwargs={"turns": 2}))
    steps = step_many(env, [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert [(s.done, s.reward) for s in steps] == [(False, None), (True, 1.0)]
    with pytest.raises(ValueError, match="already registered"):
        register_environment("tools")(CountdownEnv)


# ---- definition checks --------------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    (EnvConfig(name="nowhere", tools=["calculator"]), r"\[env\] unknown environment 'nowhere'; registered: .*tools"),
    (EnvConfig(tools=["calculator", "abacus"]), r"\[env\] unknown tool 'abacus'"),
    (EnvConfig(tools=[]), r"\[env\] the tools environment needs at least one tool"),
])
def test_check_environment_refuses_bad_definitions(config, message):
    with pytest.raises(ValueError, match=message) as info:
        check_environment(config)
    assert "\n" not in str(info.value)


def test_check_environment_refuses_bad_tools(user_tools):
    with pytest.raises(ValueError, match=r"\[env\] tool 'untyped': parameter 'x' has no type hint"):
        check_environment(EnvConfig(tools=[f"{user_tools}:untyped"]))
    with pytest.raises(ValueError, match=r"two tools are called 'calculator'"):
        check_environment(EnvConfig(tools=["calculator", "curation.env.tools:calculator"]))
    schemas = check_environment(EnvConfig(tools=["calculator", f"{user_tools}:echo"]))
    assert [s["function"]["name"] for s in schemas] == ["calculator", "echo"]


def test_env_config_fields():
    config = EnvConfig()
    assert (config.name, config.tools, config.max_turns) == ("tools", [], 4)
    with pytest.raises(ValidationError, match="listed twice"):
        EnvConfig(tools=["calculator", "calculator"])
    with pytest.raises(ValidationError, match="Extra inputs"):
        EnvConfig(tool=["calculator"])
    with pytest.raises(ValidationError):
        EnvConfig(max_turns=0)


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_check_tools_render_with_smollm2(real_model):
    from transformers import AutoTokenizer

    schemas = check_environment(EnvConfig(tools=["calculator"]))
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    # SmolLM2-135M-Instruct's own template renders the messages only: the tools would never reach the model
    with pytest.raises(ValueError, match="ignores tools: the prompt it renders does not name calculator"):
        check_tools_render(tokenizer, schemas)
    with pytest.raises(ValueError, match=r"\[env\] the chat template of .*SmolLM2-135M-Instruct ignores tools"):
        check_environment(EnvConfig(tools=["calculator"]), tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE  # a template that renders `tools`
    check_tools_render(tokenizer, schemas)
    assert check_environment(EnvConfig(tools=["calculator"]), tokenizer) == schemas
    tokenizer.chat_template = "{{ raise_exception('tools are not supported') }}"
    with pytest.raises(ValueError, match="cannot render the tools: .*tools are not supported") as info:
        check_tools_render(tokenizer, schemas)
    assert "\n" not in str(info.value)


def test_check_tools_render_without_a_template(toy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_dir / "model")
    with pytest.raises(ValueError, match="has no chat template, so it cannot render tools"):
        check_tools_render(tokenizer, check_environment(EnvConfig(tools=["calculator"])))


def test_tools_in_the_system_message_reach_a_template_that_ignores_tools(real_model, toy_dir):
    """`tools_prompt = "system"`: the schemas are written into the system message, so SmolLM2's
    template, which ignores `tools`, renders them; nothing goes to the template's `tools`."""
    from transformers import AutoTokenizer

    from curation.env.environments import ToolsEnvironment

    config = EnvConfig(tools=["calculator"], tools_prompt="system")
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert check_environment(config, tokenizer)[0]["function"]["name"] == "calculator"
    with ToolsEnvironment(config) as env:
        assert env.template_tools is None
        opening = env.reset({"prompt_id": "p", "prompt": "What is 123*45?"})
        assert [m["role"] for m in opening] == ["system", "user"]
        rendered = tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)
        assert '"name": "calculator"' in rendered and "<tool_call>" in rendered
        own = env.reset({"prompt_id": "p", "messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "2+2?"}]})
        assert own[0]["content"].startswith("Be brief.\n\n") and "calculator" in own[0]["content"]
    with ToolsEnvironment(EnvConfig(tools=["calculator"])) as env:
        assert env.template_tools == env.schemas
    toy_tokenizer = AutoTokenizer.from_pretrained(toy_dir / "model")
    with pytest.raises(ValueError, match=r"\[env\] the tokenizer of .* has no chat template"):
        check_environment(config, toy_tokenizer)
