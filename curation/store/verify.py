"""Is a run folder what its manifests say? `check_run(RUN)` before a command reads or extends it.

A run folder is shared with people and tools: a part file can be cut short by a copy, a
manifest edited by hand, a Parquet file dropped into a table folder (every reader globs
`RUN/<table>/**/*.parquet`, so its rows would count), or the run written by a newer
groupforge. Each of these is a `RunFolderError` (a ValueError: exit 2 in the CLI) naming the
file and the problem, raised before anything is read or written:

    manifest   not JSON; a `format_version` newer than FORMAT_VERSION; a `seal` (sha256 of
               the manifest's other fields, written by the commit) that no longer matches
    outputs    a file a manifest lists is missing, or its size or row count differs from
               what the manifest recorded (`deep`: its sha256 too)
    links      an entry of the run folder (or a round folder) that is a symlink leading out of
               it: no write of a job may land outside the run folder
    foreign    a *.parquet file in a table folder that no manifest or pending journal lists
               (in a folder with manifests: tables written by hand, with no RUN/_manifests,
               are only held to the table contracts when read)

Outputs of a commit whose journal is still pending (a kill while publishing) are left to that
commit's rerun, which finishes or replaces them. Cost: one JSON read per manifest, one stat and
one Parquet footer per part file (`deep` reads and hashes every byte).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from curation import schema
from curation.store.runlog import read_json

FORMAT_VERSION = 1
"""The run-folder format this groupforge writes and reads (manifests' `format_version`; a
manifest without one is version 1)."""

SEAL_FIELD = "seal"


class RunFolderError(ValueError):
    """A run folder that does not match its manifests; the message names the file."""


def seal_of(manifest: dict) -> str:
    """sha256 of a manifest's fields other than the seal, as canonical JSON."""
    body = {key: value for key, value in manifest.items() if key != SEAL_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class RunCheck:
    manifests: int = 0
    files: int = 0
    bytes: int = 0
    pending: int = 0


def check_run(root: str | Path, deep: bool = False) -> RunCheck:
    """Check the run folder `root` (see the module docstring); what was checked, or a RunFolderError."""
    root = Path(root)
    _check_links(root)
    folder = root / "_manifests"
    listed: set[str] = set()
    recorded: dict[str, tuple[Path, dict, int | None]] = {}
    pending_outputs: set[str] = set()
    result = RunCheck()
    for path in sorted(folder.glob("*.pending")) if folder.is_dir() else []:
        try:
            outputs = _read(path).get("outputs", [])
        except RunFolderError:
            if path.exists():
                raise
            continue  # its commit finished while we looked
        result.pending += 1
        pending_outputs.update(outputs)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        manifest = _read(path)
        result.manifests += 1
        version = manifest.get("format_version", 1)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise RunFolderError(f"manifest {path}: written by a newer groupforge (run-folder format {version}; this "
                                 f"one reads up to {FORMAT_VERSION}): upgrade groupforge to read this run")
        if SEAL_FIELD in manifest and manifest[SEAL_FIELD] != seal_of(manifest):
            raise RunFolderError(f"manifest {path}: edited after its commit (its seal does not match its content); "
                                 "restore it, or rerun the stage with --force to write it again")
        listed.update(manifest.get("outputs", []))
        rows = manifest.get("output_rows", {})
        for rel, meta in (manifest.get("output_files") or {}).items():
            recorded[rel] = (path, meta, rows.get(rel))
    listed |= pending_outputs
    if not folder.is_dir():
        return result  # no manifests at all: tables written by hand, nothing to hold them to
    for rel, (manifest_path, meta, rows) in sorted(recorded.items()):
        if rel in pending_outputs:
            continue  # its commit is being published; the rerun finishes it
        _check_output(root, rel, manifest_path, meta, rows, deep)
        result.files += 1
        result.bytes += int(meta.get("size", 0))
    unlisted = [(table, file) for table in schema.SCHEMAS if (root / table).is_dir()
                for file in sorted((root / table).rglob("*.parquet"))
                if file.relative_to(root).as_posix() not in listed]
    if unlisted:  # a second look: a commit beside us may have published since (journal first, then manifest)
        listed = _listed_now(folder)
    for table, file in unlisted:
        if file.relative_to(root).as_posix() not in listed and file.exists():
            raise RunFolderError(f"{file}: a Parquet file in the {table} table folder that no manifest lists (a "
                                 "foreign file: every reader of the table would count its rows); move it out "
                                 "of the run folder")
    return result


def _listed_now(folder: Path) -> set[str]:
    """Every output the pending journals, then the manifests, list (in that order: a commit writes
    its journal before it moves a file and removes it only after its manifest is written)."""
    listed: set[str] = set()
    for suffix in ("*.pending", "*.json"):
        for path in sorted(folder.glob(suffix)):
            try:
                listed.update(_read(path).get("outputs", []))
            except RunFolderError:
                continue  # gone while we looked
    return listed


def _check_links(root: Path) -> None:
    """No entry of the run folder (nor a table's round folder) is a symlink that leads out of
    it: every write of a job stays inside the run folder."""
    inside = root.resolve()
    entries = list(root.iterdir()) if root.is_dir() else []
    entries += [sub for table in schema.SCHEMAS if (root / table).is_dir() and not (root / table).is_symlink()
                for sub in (root / table).iterdir()]
    for entry in entries:
        if entry.is_symlink() and not entry.resolve().is_relative_to(inside):
            raise RunFolderError(f"{entry}: a symlink to {entry.resolve()}, outside the run folder {root}; "
                                 "groupforge writes only inside the run folder: replace the link with a folder")


def _read(path: Path) -> dict:
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise RunFolderError(f"manifest {exc}") from None
    if data is None:
        raise RunFolderError(f"manifest {path}: gone while it was read")
    return data


def _check_output(root: Path, rel: str, manifest: Path, meta: dict, rows: int | None, deep: bool) -> None:
    file = root / rel
    if not file.is_file():
        raise RunFolderError(f"{file}: listed by manifest {manifest.name} but missing")
    size = file.stat().st_size
    if "size" in meta and size != meta["size"]:
        raise RunFolderError(f"{file}: {size:,} bytes, but manifest {manifest.name} recorded {meta['size']:,} "
                             "(truncated or replaced after its commit)")
    if rows is not None:
        try:
            found = pq.read_metadata(file).num_rows
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad footer
            raise RunFolderError(f"{file}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
        if found != rows:
            raise RunFolderError(f"{file}: {found:,} rows, but manifest {manifest.name} recorded {rows:,}")
    if deep and "sha256" in meta:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != meta["sha256"]:
            raise RunFolderError(f"{file}: its sha256 differs from the one manifest {manifest.name} recorded "
                                 "(changed after its commit)")
