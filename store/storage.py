"""Where a run's files live: a local folder or an object store, behind one small interface.

`open_storage("runs/x")` is a local folder; `open_storage("s3://bucket/runs/x")` (also `gs://`,
`az://`, `abfss://`, `memory://`) an object store reached with obstore. The run store above
this module (its tables, commits and their Delta logs) reads and writes whole
objects by a path relative to the run ("samples/round=3/part-generate-1a2b.parquet"), so a
local run and an object-store run share one format and one code path. The run's other files
go through it too: its logs as whole objects (store/run_files.py), the folders that must
be local files to be used (checkpoints, the report) through `RunLocation`
(store/location.py).

Why obstore: one API over S3, GCS, Azure and local files with *conditional writes*
(`create`: If-None-Match, the primitive that makes commits atomic without a rename and lets
two writers never both win), the same Rust `object_store` crate that delta-rs and Polars use
(so the same URLs and environment variables reach all three), and no Python event loop or
threads of its own. fsspec/s3fs and pyarrow.fs expose no conditional put.

Credentials and endpoints come from the standard environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ALLOW_HTTP;
GOOGLE_SERVICE_ACCOUNT / GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_ACCOUNT_NAME,
AZURE_STORAGE_ACCOUNT_KEY, ...), read by obstore when a request is made; `options` adds
non-secret settings (endpoint, region, allow_http). Nothing here writes a credential anywhere.

The local backend is plain files, not obstore's LocalStore (which, in 0.12, has no fsync): every
write goes through `write_atomic`, a temporary file fsynced and renamed into place, so a kill or
a power cut leaves the old object or the new one; `create` links the temporary file to its name,
which fails when the name exists. A full disk is a NoSpaceError naming the object
(store.errors).

`ObjectStorage`, the object-store backend: a bucket and prefix reached with
obstore (S3 and S3-compatible servers, GCS, Azure), opened by `open_storage` for an `s3://`,
`gs://` or `az://` URL. Writes are whole objects (a multipart upload for a large local file);
`create` is a put with If-None-Match; every failed request is one StorageError line naming the
object (store/store_errors.py); retries are bounded (`retry_config`).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from store.errors import disk_write, first_line
from store.store_errors import StorageError, retry_config, store_error

__all__ = ["Entry", "LocalStorage", "ObjectStorage", "Storage", "StorageError", "check_location", "is_object_url",
           "open_storage"]

OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure", "memory")
TEMP_PREFIX = ".gf-tmp-"
"""Local temporary files start with this; listings leave them out."""

Data = bytes | bytearray | memoryview
WriteData = str | Data | Iterable[Data] | Callable[[IO[bytes]], object]
"""What write_atomic takes: text, bytes or any buffer, chunks of bytes, or a function writing to the file."""


@dataclass(frozen=True)
class Entry:
    """One object in a listing."""

    rel: str
    """Its path relative to the storage root, '/'-separated."""
    size: int


def is_object_url(location: str | os.PathLike) -> bool:
    """True for `s3://...`, `gs://...`, `az://...` (an object store), False for a local path."""
    text = str(location)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in OBJECT_SCHEMES


def open_storage(location: str | os.PathLike, options: Mapping[str, Any] | None = None) -> Storage:
    """The storage at `location`: a local folder (a path or `file://...`) or an object-store URL.
    `options`: obstore settings for an object store (endpoint, region, allow_http, ...).
    A malformed location is a ValueError naming it (`check_location`)."""
    text = str(location)
    check_location(text)
    if text.startswith("file://"):
        return LocalStorage(Path(text.removeprefix("file://")))
    if is_object_url(text):
        return ObjectStorage(text, options or {})
    return LocalStorage(Path(text))


def check_location(text: str, run: bool = False) -> None:
    """Refuse, with a ValueError naming `text`, a location that is neither a local path nor a
    well-formed object-store URL:

        foo://x/y            an unknown scheme
        s3://  s3:///run     no bucket
        s3://bucket          with `run`: a whole bucket (a run is a folder inside one, so that its
                             files do not mix with the bucket's others)
        s3:/bucket/run       an object-store scheme with its '//' missing (a local folder `s3:`
        s3:bucket/run        is never made by mistake; write ./s3:/... to mean one)
        gs//bucket/run       an object-store scheme with its ':' missing
    """
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() not in (*OBJECT_SCHEMES, "file"):
            raise ValueError(f"{text}: unknown storage scheme {scheme!r}; use a local path or one of "
                             + ", ".join(f"{s}://" for s in OBJECT_SCHEMES))
        if scheme.lower() in ("file", "memory"):
            return
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text}: no bucket in the URL; write {scheme}://<bucket>/<folder>")
        if run and not key.strip("/"):
            raise ValueError(f"{text}: names a whole bucket; a run is a folder inside one "
                             f"({scheme}://{bucket}/runs/<name>), so its files do not mix with the bucket's others")
        return
    head = text.split("/", 1)[0]
    named, colon, _ = head.partition(":")
    if colon and named.lower() in (*OBJECT_SCHEMES, "file"):
        raise ValueError(f"{text}: not a valid URL ('//' missing after '{named}:'?); write "
                         f"{named}://<bucket>/<folder>, or ./{text} for a local folder")
    if head.lower() in OBJECT_SCHEMES and text[len(head):].startswith("//"):
        raise ValueError(f"{text}: not a valid URL (':' missing after '{head}'?); write {head}://<bucket>/<folder>, "
                         f"or ./{text} for a local folder")


def check_rel(rel: str) -> str:
    """`rel` itself, or a ValueError unless it is a relative path inside the storage root."""
    parts = PurePosixPath(rel).parts
    if not rel or rel.startswith("/") or ".." in parts or "\\" in rel:
        raise ValueError(f"{rel!r}: not a path inside the storage root")
    return rel


class Storage:
    """Whole-object reads and writes under one root (see the module docstring)."""

    url: str
    """The root as a URL or a local path, for messages and for readers (Polars, delta-rs)."""

    def where(self, rel: str = "") -> str:
        """`rel` as a full location for messages: a path or `s3://bucket/run/rel`."""
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def child(self, rel: str) -> Storage:
        """The same storage rooted at `rel` (a subfolder)."""
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        """The object's bytes; FileNotFoundError naming it when there is none."""
        raise NotImplementedError

    def read_if_exists(self, rel: str) -> bytes | None:
        try:
            return self.read(rel)
        except FileNotFoundError:
            return None

    def write(self, rel: str, data: Data, *, fenced: bool = True) -> None:
        """Replace (or create) the object whole: a reader sees the old bytes or the new, never a part.
        `fenced=False` skips the writer check of `fence_writes` (an object store's): for a file
        that only a conditional commit after it makes part of the run (a `_commits` row's)."""
        raise NotImplementedError

    def create(self, rel: str, data: Data) -> bool:
        """Write the object only if there is none under that name (If-None-Match: *): True when
        this call created it, False when it existed already (nothing written)."""
        raise NotImplementedError

    def append(self, rel: str, data: Data, sync: bool = True) -> None:
        """Add `data` at the end of the object (created when missing). A local file is appended
        in place (`sync`: fsynced); an object store has no append, so the object is read and
        written again whole (fine for the small logs this is for: a run's metrics)."""
        self.write(rel, (self.read_if_exists(rel) or b"") + bytes(data))

    def size(self, rel: str) -> int | None:
        """The object's size in bytes (None: no object)."""
        data = self.read_if_exists(rel)
        return None if data is None else len(data)

    def list(self, prefix: str = "", after: str | None = None) -> list[Entry]:
        """Every object under `prefix` (a folder: '' for all, 'samples/' for one), sorted by path;
        `after`: only those whose path sorts after it (on an object store the listing starts
        there: cheap however many objects come before)."""
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        """Remove the object; no error when there is none."""
        raise NotImplementedError

    def delete_all(self, rels: Iterable[str]) -> None:
        for rel in rels:
            self.delete(rel)

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def upload(self, rel: str, path: Path) -> None:
        """Write the local file `path` as the object `rel`, whole (as `write`)."""
        self.write(rel, Path(path).read_bytes())

    def download(self, rel: str, path: Path) -> None:
        """The object `rel` into the local file `path`, written beside it and renamed into place:
        a kill leaves no part of a file under `path`."""
        write_atomic(Path(path), self.read(rel))

    def local_path(self, rel: str = "") -> Path | None:
        """The local file of `rel` (local storage), None on an object store: callers that need a
        file (a model folder for vLLM) copy the objects into a node-local cache instead."""
        return None


class LocalStorage(Storage):
    """A local folder (created on the first write)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def child(self, rel: str) -> LocalStorage:
        return LocalStorage(self.root / check_rel(rel))

    def local_path(self, rel: str = "") -> Path:
        return self.root / check_rel(rel) if rel else self.root

    def read(self, rel: str) -> bytes:
        path = self.root / check_rel(rel)
        try:
            return path.read_bytes()
        except IsADirectoryError:
            raise FileNotFoundError(f"{path} is a folder, not a file") from None

    def write(self, rel: str, data: Data, *, fenced: bool = True) -> None:
        write_atomic(self.root / check_rel(rel), data)

    def create(self, rel: str, data: Data) -> bool:
        path = self.root / check_rel(rel)
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_name(path)
        try:
            with disk_write(path):
                _write_synced(tmp, data, 0o644)
            os.link(tmp, path)  # fails if the name exists: the local If-None-Match
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def append(self, rel: str, data: Data, sync: bool = True) -> None:
        path = self.root / check_rel(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with disk_write(path):
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                view = memoryview(bytes(data))
                try:
                    while view:
                        view = view[os.write(fd, view):]
                    if sync:
                        os.fsync(fd)
                except OSError:
                    os.ftruncate(fd, start)  # no half record left behind (a full disk)
                    raise
            finally:
                os.close(fd)

    def size(self, rel: str) -> int | None:
        try:
            return (self.root / check_rel(rel)).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "", after: str | None = None) -> list[Entry]:
        prefix = prefix.rstrip("/")
        start = self.root / check_rel(prefix) if prefix else self.root
        found: list[Entry] = []
        for folder, dirs, files in os.walk(start):
            dirs.sort()
            base = Path(folder).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    continue
                rel = name if base == "." else f"{base}/{name}"
                try:
                    found.append(Entry(rel, os.stat(os.path.join(folder, name)).st_size))
                except FileNotFoundError:
                    continue  # removed while listing
        return sorted((e for e in found if after is None or e.rel > after), key=lambda e: e.rel)

    def delete(self, rel: str) -> None:
        (self.root / check_rel(rel)).unlink(missing_ok=True)

    def remove_dead_temps(self) -> int:
        """Delete the temporary files of writes whose process is gone (a kill mid-write); how
        many. A live process's are kept."""
        return sum(remove_dead_temps(Path(folder)) for folder, _, _ in os.walk(self.root))

    def exists(self, rel: str) -> bool:
        return (self.root / check_rel(rel)).is_file()


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running (a temporary file's writer, say)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in folder `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    """A temporary file beside `path` (same filesystem: the rename or link is atomic), named
    with the writer's pid so that a sweep tells a killed writer's from a live one's."""
    return path.parent / f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _is_buffer(data: object) -> bool:
    try:
        memoryview(data)
    except TypeError:
        return False
    return True


def _write_synced(tmp: Path, data: WriteData, mode: int | None) -> None:
    with open(tmp, "wb") as f:
        if callable(data):
            data(f)
        elif isinstance(data, str):
            f.write(data.encode("utf-8"))
        elif _is_buffer(data):
            f.write(data)  # bytes, or any buffer (a pyarrow Buffer)
        else:
            for chunk in data:
                f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)


def remove_dead_temps(folder: Path, name: str | None = None) -> int:
    """Delete from `folder` the temporary files (of the file `name`, or of any) whose writer is
    gone; how many. A live writer's are kept."""
    prefix = TEMP_PREFIX + (f"{name}." if name else "")
    try:
        temps = [e.name for e in os.scandir(folder) if e.name.startswith(prefix) and e.is_file()]
    except FileNotFoundError:
        return 0
    removed = 0
    for temp in temps:
        parts = temp.rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and not process_alive(int(parts[1])):
            (folder / temp).unlink(missing_ok=True)
            removed += 1
    return removed


def write_atomic(path: str | Path, data: WriteData, *, mode: int | None = 0o644) -> Path:
    """Write `data` (text, bytes, chunks of bytes, or a function that writes to a binary file)
    to the local file `path` so that a reader sees the old file or the whole new one, never a
    part: a temporary file beside it is written, fsynced and renamed into place, then the
    folder is fsynced. The parent folder is created; a killed writer's temporary files of
    `path` are removed first. `mode` (default 0644: run files are for everyone who can read the
    run; None: the umask's) is applied before the rename. A failed write leaves no temporary
    file and re-raises; a full disk is a NoSpaceError naming `path`. The one atomic write of
    local files (obstore 0.12's LocalStore also writes through a temporary file, but offers no
    fsync and leaves a killed writer's temporary files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(path.parent, path.name)
    tmp = _temp_name(path)
    try:
        with disk_write(path):
            _write_synced(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


class ObjectStorage(Storage):
    """An object store bucket and prefix, through obstore. Every failed request is one
    StorageError line (store/store_errors.py); with `fence_writes`, every write first
    checks that this job still writes the run."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None, *, _store: Any = None):
        from obstore.store import from_url

        self.url = url.rstrip("/")
        self.options = dict(options or {})
        if not self.url.lower().startswith("memory:"):
            self.options.setdefault("retry_config", retry_config())
        self._fence: Callable[[], None] | None = None
        self._fence_lock = threading.Lock()
        try:
            self._store = _store if _store is not None else from_url(self.url, **self.options)
        except Exception as exc:  # obstore's config errors: unknown option, bad URL (no request made yet)
            raise ValueError(f"{self.url}: cannot open the object store: {_reason(exc)}") from None

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def child(self, rel: str) -> ObjectStorage:
        return ObjectStorage(f"{self.url}/{check_rel(rel).rstrip('/')}", self.options)

    def fence_writes(self, check: Callable[[], None]) -> None:
        """Call `check` before each write, create and delete from now on: the log's test that
        no newer job has opened the run (`RunLog.check_writer`), which raises to stop this job
        before it writes over the newer one's files. One at a time (a thread of the
        job may write beside it)."""
        self._fence = check

    def _fenced(self) -> None:
        if self._fence is not None:
            with self._fence_lock:
                self._fence()

    def _call(self, rel: str, action: str, fn, *args, **kwargs):
        import obstore.exceptions as oe

        try:
            return fn(self._store, *args, **kwargs)
        except (oe.NotFoundError, FileNotFoundError) as exc:
            error = store_error(self.url, self.where(rel), action, exc)
            if isinstance(error, ValueError) or action == "writing":  # a write finds no bucket, not no object
                raise error from None
            raise FileNotFoundError(f"{self.where(rel)}: no such object") from None
        except (oe.AlreadyExistsError, oe.PreconditionError):
            raise
        except Exception as exc:
            raise store_error(self.url, self.where(rel), action, exc) from None

    def read(self, rel: str) -> bytes:
        import obstore

        result = self._call(rel, "reading", obstore.get, check_rel(rel))
        return bytes(result.bytes())

    def write(self, rel: str, data: Data, *, fenced: bool = True) -> None:
        import obstore

        if fenced:
            self._fenced()
        self._call(rel, "writing", obstore.put, check_rel(rel), _payload(data))

    def create(self, rel: str, data: Data) -> bool:
        import obstore
        import obstore.exceptions as oe

        self._fenced()
        try:
            self._call(rel, "writing", obstore.put, check_rel(rel), _payload(data), mode="create")
        except (oe.AlreadyExistsError, oe.PreconditionError):
            return False
        return True

    def upload(self, rel: str, path: Path) -> None:
        import obstore

        self._fenced()
        self._call(rel, "writing", obstore.put, check_rel(rel), Path(path))  # multipart when large

    def download(self, rel: str, path: Path) -> None:
        import obstore

        path = Path(path)
        result = self._call(rel, "reading", obstore.get, check_rel(rel))
        write_atomic(path, (bytes(chunk) for chunk in result.stream()))

    def list(self, prefix: str = "", after: str | None = None) -> list[Entry]:
        import obstore

        prefix = check_rel(prefix.rstrip("/")) if prefix.rstrip("/") else ""
        stream = self._call(prefix, "listing", obstore.list, prefix or None,
                            offset=check_rel(after) if after else None)
        found: list[Entry] = []
        try:
            for chunk in stream:
                found.extend(Entry(meta["path"], int(meta["size"])) for meta in chunk)
        except Exception as exc:  # the requests are made while iterating
            raise store_error(self.url, self.where(prefix), "listing", exc) from None
        return sorted(found, key=lambda e: e.rel)

    def delete(self, rel: str) -> None:
        import obstore

        self._fenced()
        try:
            self._call(rel, "deleting", obstore.delete, check_rel(rel))
        except FileNotFoundError:
            pass

    def exists(self, rel: str) -> bool:
        return self.size(rel) is not None

    def size(self, rel: str) -> int | None:
        import obstore

        try:
            return int(self._call(rel, "checking", obstore.head, check_rel(rel))["size"])
        except FileNotFoundError:
            return None


def _payload(data: Data) -> bytes:
    """`data` as bytes: obstore takes bytes, not every buffer (a pyarrow Buffer, a bytearray)."""
    return data if isinstance(data, bytes) else bytes(memoryview(data))


def _reason(exc: BaseException) -> str:
    """The first line of an obstore error (its debug trace follows on later lines)."""
    line = first_line(exc)
    return line if len(line) <= 300 else line[:300] + "..."
