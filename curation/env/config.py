"""The configuration of a multi-turn generate: which environment, its tools, the trajectory's limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EnvConfig(BaseModel):
    """The environment a multi-turn generate talks to (a spec's `[env]` section)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("tools", description="The environment: 'tools' (runs the model's tool calls), another name "
                                           "registered with register_environment, or 'module:factory'.")
    tools: list[str] = Field(default_factory=list, description="The tools the model may call: registered names "
                             "(calculator) or 'module:function'. Their schemas go to the chat template's `tools`.")
    tools_prompt: Literal["template", "system"] = Field(
        "template", description="How the model learns its tools: 'template' passes their schemas to the chat "
                                "template's `tools` (the template must render them: checked before the run opens); "
                                "'system' writes them into a system message in the Hermes form, for models whose "
                                "template ignores `tools` (SmolLM2's).")
    max_turns: int = Field(4, ge=1, description="Assistant turns per trajectory at most; a trajectory that reaches "
                                                "it stops with stop_reason 'max_turns'.")
    max_tokens: int = Field(1024, ge=1, description="Tokens per trajectory after the prompt at most (model and "
                                                    "tool turns together); past it: stop_reason 'max_tokens'.")
    tool_timeout_s: float = Field(5.0, gt=0, description="Wall-clock limit of one tool call in its worker process; "
                                  "a call past it gets the tool message 'error: timeout after Xs'.")
    tool_cpu_seconds: float | None = Field(None, gt=0, description="CPU seconds one tool call may use (RLIMIT_CPU); "
                                           "default: tool_timeout_s.")
    tool_memory_mb: int | None = Field(2048, ge=64, description="Address-space limit of each tool worker process "
                                       "(RLIMIT_AS); None: no limit.")
    tool_workers: int | None = Field(None, ge=1, description="Worker processes for tool calls; default: the usable "
                                     "CPUs, at most 8.")
    max_result_chars: int = Field(4000, ge=1, description="Characters of a tool's result at most; a longer result "
                                  "is a tool error.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Settings of a custom environment, read by its "
                                   "factory (the tools environment takes none).")

    @field_validator("tools")
    @classmethod
    def _tools_are_distinct(cls, tools: list[str]) -> list[str]:
        for name in tools:
            if not name.strip():
                raise ValueError("a tool name is empty")
        repeated = sorted({name for name in tools if tools.count(name) > 1})
        if repeated:
            raise ValueError(f"tool {repeated[0]!r} is listed twice")
        return tools
