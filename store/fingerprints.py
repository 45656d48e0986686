"""Fingerprints: what makes a stage's output up to date or stale.

    fingerprint_file(path)     sha256 of a file's bytes (a table part, a prompts file)
    known_fingerprint(path)    the same, without reading the bytes again when a manifest recorded
                               them and the file's size and mtime_ns still match
    fingerprint_path(path)     sha256 of a file, or of a folder's relative paths and file hashes
    config_hash(config)        sha256 of a config's canonical JSON (sorted keys)
    code_version()             'groupforge <version> (<commit>[-dirty])', recorded in manifests

A stage is skipped when its manifest holds the same input fingerprints and config hash
(store.run_store.RunStore.is_up_to_date); the code version is recorded, not compared.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path


def fingerprint_file(path: str | Path) -> str:
    """sha256 (hex) of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_stat(path: str | Path) -> dict[str, int]:
    """{"size", "mtime_ns"} of a file: what tells a recorded hash still holds."""
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def known_fingerprint(path: str | Path, recorded: Mapping[str, object] | None = None) -> str:
    """sha256 of a file, hashed only when `recorded` (a manifest's `output_files` entry:
    sha256, size, mtime_ns) does not vouch for it: the file's size and mtime_ns still match."""
    return recorded["sha256"] if recorded and _vouches(path, recorded) else fingerprint_file(path)


def _vouches(path: str | Path, recorded: Mapping[str, object]) -> bool:
    """Whether a recorded sha256 holds for the file: recorded with the file's size and mtime_ns."""
    stat = file_stat(path)
    return (isinstance(recorded.get("sha256"), str)
            and (recorded.get("size"), recorded.get("mtime_ns")) == (stat["size"], stat["mtime_ns"]))


def fingerprint_path(path: str | Path) -> str:
    """sha256 of a file, or of a folder: its sorted relative paths and their content hashes."""
    path = Path(path)
    if path.is_file():
        return fingerprint_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"cannot fingerprint {path}: no such file or folder")
    digest = hashlib.sha256()
    for rel in sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()):
        digest.update(f"{rel}\0{fingerprint_file(path / rel)}\n".encode())
    return digest.hexdigest()


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"config value {value!r} ({type(value).__name__}) is not JSON-serialisable")


def canonical_json(config: Mapping) -> str:
    """Compact JSON with sorted keys: equal configs, equal text."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"), default=_json_default)


def config_hash(config: Mapping) -> str:
    """sha256 of the canonical JSON of `config` (sorted keys), so key order does not matter."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """'groupforge <version> (<short commit>[-dirty])', or without the commit outside a git checkout."""
    try:
        version = importlib.metadata.version("groupforge")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    here = Path(__file__).resolve()
    try:
        git = ["git", "-C", str(here.parent)]
        top, commit = subprocess.run(git + ["rev-parse", "--show-toplevel", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=10, check=True).stdout.split()
        if (Path(top) / "store" / here.name).resolve() != here:
            return f"groupforge {version}"  # installed inside some other repository
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return f"groupforge {version}"
    return f"groupforge {version} ({commit}{'-dirty' if dirty else ''})"
