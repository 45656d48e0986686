"""Fingerprints: what makes a stage's output up to date or stale.

    fingerprint_file(path)     sha256 of a file's bytes (a table part, a prompts file)
    known_fingerprint(path)    the same, without reading the bytes again when a manifest (or this
                               process) hashed them already and the file's size and mtime_ns match
    fingerprint_path(path)     sha256 of a file, or of a folder's relative paths and file hashes
    config_hash(config)        sha256 of a config's canonical JSON (sorted keys)
    code_version()             'groupforge <version> (<commit>[-dirty])', recorded in manifests

A stage is skipped when its manifest holds the same input fingerprints and config hash
(curation.store.run_store.RunStore.is_up_to_date); the code version is recorded, not compared.
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
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_HASHED: dict[str, tuple[int, int, str]] = {}  # absolute path -> (size, mtime_ns, sha256) hashed here


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


def remember_fingerprint(path: str | Path, sha256: str, stat: Mapping[str, int]) -> None:
    """Note that the file at `path` with this size and mtime_ns has `sha256` (known_fingerprint
    then trusts it for the rest of the process)."""
    _HASHED[os.path.abspath(path)] = (int(stat["size"]), int(stat["mtime_ns"]), sha256)


def known_fingerprint(path: str | Path, recorded: Mapping[str, object] | None = None,
                      compute: bool = True) -> str | None:
    """sha256 of a file, hashed only when nothing vouches for it: `recorded` (a manifest's
    `output_files` entry: sha256, size, mtime_ns) or an earlier hash in this process holds when
    the file's size and mtime_ns still match; otherwise its bytes are read (and remembered),
    or, with `compute=False`, None is returned."""
    stat = file_stat(path)
    key = (stat["size"], stat["mtime_ns"])
    if recorded and (recorded.get("size"), recorded.get("mtime_ns")) == key and isinstance(recorded.get("sha256"), str):
        return recorded["sha256"]
    seen = _HASHED.get(os.path.abspath(path))
    if seen is not None and seen[:2] == key:
        return seen[2]
    if not compute:
        return None
    digest = fingerprint_file(path)
    if file_stat(path) == stat:  # not changed while it was read
        remember_fingerprint(path, digest, stat)
    return digest


class FileCache(Generic[T]):
    """Values computed from files (a parsed table), kept while a file's size and mtime_ns are
    the ones it had when the value was computed; at most `max_entries` (None: no bound), the
    oldest dropped first."""

    def __init__(self, max_entries: int | None = None):
        self._entries: dict[str, tuple[int, int, T]] = {}
        self._max = max_entries

    def get(self, path: str | Path, compute: Callable[[], T]) -> T:
        key, stat = os.path.abspath(path), os.stat(path)
        known = self._entries.get(key)
        if known is None or known[:2] != (stat.st_size, stat.st_mtime_ns):
            if known is None and self._max is not None and len(self._entries) >= self._max:
                self._entries.pop(next(iter(self._entries)))
            known = (stat.st_size, stat.st_mtime_ns, compute())
            self._entries[key] = known
        return known[2]

    def put(self, path: str | Path, stat: Mapping[str, int], value: T) -> None:
        """Keep `value` for the file at `path` with this size and mtime_ns (a file this process
        just wrote, whose value it has without reading the file back)."""
        key = os.path.abspath(path)
        if key not in self._entries and self._max is not None and len(self._entries) >= self._max:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (int(stat["size"]), int(stat["mtime_ns"]), value)


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
        if (Path(top) / "curation" / "store" / here.name).resolve() != here:
            return f"groupforge {version}"  # installed inside some other repository
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return f"groupforge {version}"
    return f"groupforge {version} ({commit}{'-dirty' if dirty else ''})"
