"""Environments and tools for multi-turn generation: tools (plain typed functions) and their
schemas, tool calls parsed from a model's text, the Environment protocol and the shipped
"tools" environment, and the `[env]` configuration."""

from curation.env.calls import CallParseError, ToolCall, content_without_calls, parse_tool_calls
from curation.env.config import EnvConfig
from curation.env.environments import (
    Environment,
    EnvStep,
    ToolsEnvironment,
    check_environment,
    check_model_environment,
    check_tools_render,
    get_environment,
    make_environment,
    register_environment,
    step_many,
)
from curation.env.tools import calculator, get_tool, register_tool, tool_names, tool_schema

__all__ = ["CallParseError", "EnvConfig", "EnvStep", "Environment", "ToolCall", "ToolsEnvironment", "calculator",
           "check_environment", "check_model_environment", "check_tools_render", "content_without_calls",
           "get_environment", "get_tool", "make_environment", "parse_tool_calls", "register_environment",
           "register_tool", "step_many", "tool_names", "tool_schema"]
