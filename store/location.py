"""Where a run lives: its storage, which keeps everything that lasts, and a work folder on this
machine, for what a process needs as local files.

    RunLocation.of("runs/x")             storage: the folder runs/x; work: runs/x itself
    RunLocation.of("s3://bucket/runs/x") storage: the objects under that prefix;
                                         work: a node-local cache folder (`node_cache`)

The run's tables go through the run store (store/run_store.py) and its logs through
`Storage`. Checkpoints, the report and the round prompt files are written as local files (a
model folder is what transformers and vLLM load) into the work folder, then `upload`ed; a
process that needs them and does not have them (another node, a rerun on a fresh machine)
`fetch`es them. For a local run both are the same folder and both calls do nothing, so local
and object-store runs take one code path.

A model given as an object-store URL (`[model] path = "s3://bucket/models/m"`) is fetched the
same way into this machine's cache (`local_folder`): each node of a cluster keeps its own copy,
so engines and trainer ranks never read another node's disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from store.faults import fault_point
from store.storage import Storage, check_location, is_object_url, open_storage

CACHE_ENV = "GROUPFORGE_CACHE"
"""The folder for node-local copies of object-store runs (default ~/.cache/groupforge)."""


def node_cache(url: str, kind: str = "runs") -> Path:
    """This machine's folder for the object-store folder `url` (a run, or a model):
    $GROUPFORGE_CACHE/<kind>/<sha256 of the URL, 12 hex digits>/<last path segment>. The folder
    keeps the URL's last segment as its name, which is what a model's fingerprint shows."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "groupforge")
    tail = url.rstrip("/").rsplit("/", 1)[-1] or kind
    return root / kind / hashlib.sha256(url.encode()).hexdigest()[:12] / tail


def local_folder(folder: str | os.PathLike) -> Path:
    """A model (or other read-only) folder as a local path: a local path as it is; an
    object-store URL as this machine's copy (`node_cache(url, "models")`), downloading the
    files it lacks, config.json last (a copy with a config.json is whole)."""
    if not is_object_url(folder):
        return Path(folder)
    storage = open_storage(str(folder))
    return RunLocation(storage, node_cache(storage.url, "models")).fetch("", last="config.json")


@dataclass(frozen=True)
class RunLocation:
    """A run's storage and its work folder on this machine (see the module docstring)."""

    storage: Storage
    work: Path

    @classmethod
    def of(cls, run: str | os.PathLike | Storage | RunLocation) -> RunLocation:
        """The location of `run`: a local folder, an object-store URL, a Storage, or a location."""
        if isinstance(run, RunLocation):
            return run
        if not isinstance(run, Storage):
            check_location(str(run), run=True)
        storage = run if isinstance(run, Storage) else open_storage(run)
        local = storage.local_path()
        return cls(storage, local if local is not None else node_cache(storage.url))

    @property
    def url(self) -> str:
        """The run as a path or URL (for messages, and for other processes to open it)."""
        return self.storage.url

    @property
    def name(self) -> str:
        """The run's folder name (the last segment of its path or URL)."""
        return self.storage.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def key(self) -> str:
        """The run's identity: its resolved folder, or its URL."""
        local = self.storage.local_path()
        return str(local.resolve()) if local is not None else self.storage.url

    @property
    def is_local(self) -> bool:
        """True when the work folder is the run folder itself: nothing to upload or fetch."""
        return self.storage.local_path() == self.work

    def upload(self, rel: str, last: str | None = None) -> None:
        """Copy the local file or folder `work/rel` to the storage (a folder: every file in it,
        the file named `last` after all others, so that its presence in the storage means the
        rest is there). Nothing to do for a local run."""
        if self.is_local:
            return
        local = self.work / rel
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        files.sort(key=lambda p: p.name == last)  # stable: `last` moves to the end
        for path in files:
            self.storage.upload(path.relative_to(self.work).as_posix(), path)
            fault_point("location.file_uploaded")

    def fetch(self, rel: str, last: str | None = None) -> Path:
        """`work/rel`, holding the storage's file or folder `rel` ("": everything): objects
        missing locally, or of another size, are downloaded (`last` after the others, as
        `upload` wrote them).
        For a local run, the path itself."""
        local = self.work / rel if rel else self.work
        if self.is_local:
            return local
        entries = self.storage.list(rel + "/" if rel else "")
        if not entries and not rel:
            raise FileNotFoundError(f"{self.storage.url}: no such folder (no objects under it)")
        if not entries:  # a single file
            size = self.storage.size(rel)
            if size is None:
                raise FileNotFoundError(f"{self.storage.where(rel)}: no such file or folder")
            if not local.is_file() or local.stat().st_size != size:
                self.storage.download(rel, local)
            return local
        entries.sort(key=lambda e: e.rel.rsplit("/", 1)[-1] == last)
        for entry in entries:
            path = self.work / entry.rel
            if not path.is_file() or path.stat().st_size != entry.size:
                self.storage.download(entry.rel, path)
        return local

    def remove(self, rel: str) -> None:
        """Delete the file or folder `rel` from the storage and from the work folder."""
        if not self.is_local:
            self.storage.delete_all(e.rel for e in self.storage.list(rel + "/"))
            self.storage.delete(rel)
        local = self.work / rel
        if local.is_dir():
            shutil.rmtree(local, ignore_errors=True)
        else:
            local.unlink(missing_ok=True)
