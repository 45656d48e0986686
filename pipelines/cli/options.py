"""CLI options built from pydantic models: one `--field-name` flag per field, whose type,
default and help text are the field's own, so a flag cannot drift from the spec key it sets.

    @app.command()
    @model_options(TrainConfig)
    def train(run: Path = typer.Argument(...), overrides: dict = OVERRIDES) -> None:
        cfg = load_section(TrainConfig, config, "train", overrides=overrides)

Each flag's default is the field's default (the help shows it), but the command receives only
the flags given on the command line, as `overrides` {field: value}: a flag left out never
overrides a config file's key. Field types become flags as follows:

    int, float, str         --lr 3e-4
    bool                    --reference / --no-reference
    Literal[...]            --objective gspo          (one of the choices)
    tuple[float, float]     --adam-betas 0.9 0.95     (one value per element)
    list[int]               --rounds 0-3,5            (numbers and ranges, comma-separated)

A field holding another model (e.g. TrainConfig.lora) gets no flag: it is set in a config file.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Optional, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from rich.markup import escape

OVERRIDES: Any = None
"""The default of a command's `overrides` parameter (filled in by `model_options`)."""
_CONTEXT = "typer_context"  # the parameter typer passes its context in


def flag_name(field: str) -> str:
    """The flag of a field: `batch_size` -> `--batch-size`."""
    return "--" + field.replace("_", "-")


def parse_int_list(text: str) -> list[int]:
    """'0,1,3' or '2-5' or '0,2-4' -> the listed numbers, ranges inclusive."""
    numbers: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            numbers.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected numbers like 0,1,3 or 2-5") from None
    return numbers


def _base_type(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _option(name: str, info: FieldInfo, aliases: Iterable[str], panel: str) -> tuple[Any, Any]:
    """(annotation, typer.Option) of the flag of field `name`."""
    kind = _base_type(info.annotation)
    flag = flag_name(name)
    extra: dict[str, Any] = {}
    if kind is bool:
        decls = [f"{flag}/--no-{flag[2:]}"]
    else:
        decls = [flag]
    if get_origin(kind) is list:
        if get_args(kind) != (int,):
            raise TypeError(f"{name}: only list[int] fields become flags, not {kind}")
        kind, extra = str, {"parser": parse_int_list, "metavar": "N,M-K"}
    elif get_origin(kind) is Literal:
        extra = {"case_sensitive": True}
    elif kind not in (int, float, str, bool) and get_origin(kind) is not tuple:
        raise TypeError(f"{name}: a {kind} field has no flag type")
    if info.default is PydanticUndefined:
        raise TypeError(f"{name}: a field without a default cannot be an optional flag")
    option = typer.Option(info.default, *decls, *aliases, help=escape(info.description or ""),
                          show_default=info.default is not None, rich_help_panel=panel, **extra)
    return Optional[kind], option


def model_options(*models: type[BaseModel],
                  aliases: Mapping[str, Iterable[str]] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a typer command with one flag per field of `models` (after the command's own
    parameters, in field order, in a help panel named after the model); the command gets
    the flags given as `overrides`."""
    fields: dict[str, tuple[FieldInfo, str]] = {}
    for model in models:
        for name, info in model.model_fields.items():
            base = _base_type(info.annotation)
            if isinstance(base, type) and issubclass(base, BaseModel):
                continue  # a nested table (e.g. [train] lora): set in a config file or spec, not a flag
            if name in fields:
                raise TypeError(f"field {name} is in two of the models {[m.__name__ for m in models]}")
            fields[name] = info, f"{model.__name__} options"

    def decorate(command: Callable) -> Callable:
        own = inspect.signature(command, eval_str=True)
        if "overrides" not in own.parameters:
            raise TypeError(f"{command.__name__} needs an `overrides` parameter to receive the flags")
        params = [p for p in own.parameters.values() if p.name != "overrides"]
        clash = {p.name for p in params} & fields.keys()
        if clash:
            raise TypeError(f"{command.__name__}: parameters {sorted(clash)} are also model fields")
        for name, (info, panel) in fields.items():
            annotation, option = _option(name, info, (aliases or {}).get(name, ()), panel)
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))
        params.append(inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            context = kwargs.pop(_CONTEXT)
            values = {name: kwargs.pop(name) for name in fields}
            return command(**kwargs, overrides=given(context, values))

        wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": own.return_annotation}
        return wrapper

    return decorate


def given(context: typer.Context, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `values` whose flag was given (on the command line or in an environment
    variable), not left at its default."""
    return {name: value for name, value in values.items()
            if (source := context.get_parameter_source(name)) is not None and source.name != "DEFAULT"}


def pick(model: type[BaseModel], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `overrides` that are fields of `model`."""
    return {k: v for k, v in overrides.items() if k in model.model_fields}


def build(model: type[BaseModel], overrides: Mapping[str, Any]) -> BaseModel:
    """`model` from the flags given; a validation error is one ValueError line naming the flags."""
    try:
        return model.model_validate(pick(model, overrides))
    except ValidationError as exc:
        raise ValueError("; ".join(
            (f"{flag_name(str(err['loc'][0]))}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
            for err in exc.errors())) from None
