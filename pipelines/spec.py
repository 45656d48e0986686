"""Specs: TOML files validated by pydantic models, with errors that name the key and the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config {path}: file not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config {path}: not valid TOML ({exc})") from None


def validate_model(model: type[M], data: dict[str, Any], path: str | Path | None = None,
                   section: str | None = None) -> M:
    """`model` from `data`; a ValidationError becomes one ValueError line naming every bad key
    (as section.key) and the file."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        prefix = (section,) if section else ()
        problems = "; ".join(f"{'.'.join(str(p) for p in prefix + tuple(err['loc'])) or 'config'}: {err['msg']}"
                             for err in exc.errors())
        raise ValueError(f"config {path}: {problems}" if path else problems) from None


def load_section(model: type[M], path: str | Path | None, section: str,
                 overrides: dict[str, Any] | None = None) -> M:
    """The [section] of a TOML file (defaults without a file) as `model`, with `overrides`
    (e.g. CLI flags; None values ignored) applied on top."""
    data = read_toml(path).get(section, {}) if path is not None else {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: [{section}] must be a table")
    data = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return validate_model(model, data, path, section)
