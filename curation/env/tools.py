"""Tools: plain Python functions a model may call, their JSON schemas, and a registry by name.

A tool is a function with a type hint on every parameter and a Google-style docstring whose
"Args:" section describes every parameter (the functions TRL's `tools=` and transformers'
`apply_chat_template(tools=...)` take):

    @register_tool()
    def add(a: int, b: int) -> str:
        '''Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        '''
        return str(a + b)

`tool_schema(add)` is the function schema a chat template renders:

    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description":
     "The first integer."}, ...}, "required": ["a", "b"]}}}

Parameter types: str, int, float, bool, list / list[X], dict / dict[str, X], X | None
(Optional: "nullable"), other unions (anyOf) and Literal[...] of strings, numbers or bools
("enum"). A parameter with a default is not required.

Names resolve like the rewards' (curation/rewards/registry.py): a name registered with
`@register_tool(name)` (the function's own name by default), or `"module:function"`, any
importable function. The tools environment runs tools in worker processes, so a tool is a
module-level function (pickled by reference). Shipped: `calculator`.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from curation.rewards.registry import add_to_registry, import_reference

Tool = Callable[..., Any]
_REGISTRY: dict[str, Tool] = {}

_SIMPLE_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


# ---- schemas ------------------------------------------------------------------------


def tool_schema(fn: Tool, name: str | None = None) -> dict[str, Any]:
    """The OpenAI / chat-template function schema of `fn` (called `name`, default its own name)
    from its signature, type hints and docstring; ValueError (one line) for a parameter without
    a type hint or with a type the schema cannot express, a missing docstring, or a parameter
    missing from "Args:"."""
    name = name or getattr(fn, "__name__", None)
    if not callable(fn) or not name:
        raise ValueError(f"tool {fn!r}: not a named function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tool {name!r}: no signature ({exc})") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - a hint naming what does not exist
        raise ValueError(f"tool {name!r}: its type hints cannot be resolved ({type(exc).__name__}: {exc})") from None
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ValueError(f"tool {name!r}: no docstring; describe the tool and its parameters in an 'Args:' section")
    description, arg_docs = _parse_docstring(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: parameter {param.name!r} is *args or **kwargs; name every parameter")
        if param.kind is param.POSITIONAL_ONLY:
            raise ValueError(f"tool {name!r}: parameter {param.name!r} is positional-only; tools are called by keyword")
        if param.name not in hints:
            raise ValueError(f"tool {name!r}: parameter {param.name!r} has no type hint")
        try:
            schema = _type_schema(hints[param.name])
        except TypeError as exc:
            raise ValueError(f"tool {name!r}: parameter {param.name!r} has an unsupported type {exc}") from None
        if param.name not in arg_docs:
            raise ValueError(f"tool {name!r}: parameter {param.name!r} is not described in the docstring's 'Args:' "
                             "section")
        properties[param.name] = {**schema, "description": arg_docs[param.name]}
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "function",
            "function": {"name": name, "description": description,
                         "parameters": {"type": "object", "properties": properties, "required": required}}}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the description: the text before the first section, joined into one paragraph per
    blank line; {parameter: its description} from the "Args:" section)."""
    lines = doc.splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        header = _SECTION.match(line)
        if header:
            section = header.group(1).lower()
            current, arg_indent = None, None
            continue
        if section is None:
            description.append(line.strip())
            continue
        if section not in ("args", "arguments", "parameters") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = _ARG_LINE.match(line.strip())
        if entry and (arg_indent is None or indent <= arg_indent):
            arg_indent = indent
            current = entry.group(1).lstrip("*")
            args[current] = entry.group(2).strip()
        elif current is not None:  # a continuation line of the current parameter
            args[current] = f"{args[current]} {line.strip()}".strip()
    paragraphs = " ".join(line if line else "\n" for line in description).split("\n")
    return "\n".join(p.strip() for p in paragraphs if p.strip()), args


def _type_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of one parameter's type; TypeError(the type's name) when unsupported."""
    if hint in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(_type_name(hint) + " (JSON object keys are strings)")
        return {"type": "object", "additionalProperties": _type_schema(args[1])} if args else {"type": "object"}
    if origin is Literal:
        if not args or not all(isinstance(a, (str, int, float, bool)) for a in args):
            raise TypeError(_type_name(hint))
        kinds = {_SIMPLE_TYPES[type(a)] for a in args}
        return {"type": kinds.pop() if len(kinds) == 1 else sorted(kinds), "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        if len(members) < len(args):  # X | None
            inner = _type_schema(members[0]) if len(members) == 1 else {"anyOf": [_type_schema(a) for a in members]}
            return {**inner, "nullable": True}
        return {"anyOf": [_type_schema(a) for a in members]}
    raise TypeError(_type_name(hint))


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else repr(hint).replace("typing.", "")


# ---- the registry -------------------------------------------------------------------


def register_tool(name: str | None = None) -> Callable[[Tool], Tool]:
    """Register a tool under `name` (default: the function's name); its schema is checked now,
    so a tool without type hints or docstring fails where it is defined.

    >>> @register_tool("double_it")
    ... def double(x: int) -> str:
    ...     '''Double a number.
    ...
    ...     Args:
    ...         x: The number.
    ...     '''
    ...     return str(2 * x)
    >>> get_tool("double_it")(x=21)
    '42'
    """
    if name is not None and (":" in name or not name):
        raise ValueError(f"tool name {name!r}: must be non-empty and without ':'")

    def decorator(fn: Tool) -> Tool:
        key = name or fn.__name__
        tool_schema(fn, key)
        return add_to_registry(_REGISTRY, "tool", key, fn)

    return decorator


def tool_names() -> list[str]:
    """The registered tool names, sorted."""
    return sorted(_REGISTRY)


def tool_call_name(name: str) -> str:
    """The name the model calls a tool by: the registered name, or a 'module:function''s function name."""
    return name.rpartition(":")[2].rpartition(".")[2] if ":" in name else name


def get_tool(name: str) -> Tool:
    """The tool function of a registered name or a 'module:function' reference (its schema
    checked: ValueError as `tool_schema` gives it)."""
    if ":" in name:
        obj = import_reference(name, "tool")
        if not inspect.isfunction(obj):
            raise ValueError(f"tool {name!r} is a {type(obj).__name__}, not a function")
        tool_schema(obj)
        return obj
    if name not in _REGISTRY:
        raise ValueError(f"unknown tool {name!r}; registered: {', '.join(tool_names())}; or give a 'module:function'")
    return _REGISTRY[name]


# ---- the calculator -----------------------------------------------------------------

MAX_EXPRESSION_CHARS = 500
MAX_INTEGER_DIGITS = 100  # an integer result (or intermediate) longer than this is refused
_MAX_INTEGER_BITS = math.ceil(MAX_INTEGER_DIGITS * math.log2(10))
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(1234 + 5678) * 3".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters is over the limit of {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result too large") from None
    except RecursionError:
        raise ValueError("expression nested too deeply") from None
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic node: numbers, the binary operators of _BINARY, unary + and -."""
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise ValueError(f"{type(node.value).__name__} {node.value!r} is not a number")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    raise ValueError(f"{type(node).__name__} is not allowed; only numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would pass the integer limit before computing it."""
    if isinstance(exponent, int) and isinstance(base, int) and abs(base) > 1 and exponent > 0:
        if exponent * (abs(base).bit_length() - 1) > _MAX_INTEGER_BITS:
            raise ValueError(f"result too large (over {MAX_INTEGER_DIGITS} digits)")
    if abs(exponent) > 10_000:
        raise ValueError(f"exponent {exponent} too large")


def _checked(value: Any) -> int | float:
    """`value` if it is a finite int or float within the size limit."""
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > _MAX_INTEGER_BITS:
        raise ValueError(f"result too large (over {MAX_INTEGER_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result too large")
    return value
