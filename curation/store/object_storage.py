"""The object-store backend of `curation.store.storage.Storage`: a bucket and prefix reached with
obstore (S3 and S3-compatible servers, GCS, Azure), opened by `open_storage` for an `s3://`,
`gs://` or `az://` URL. Writes are whole objects (a multipart upload for a large local file);
`create` is a put with If-None-Match; every failed request is one StorageError line naming the
object (curation/store/store_errors.py); retries are bounded (`retry_config`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from curation.errors import first_line
from curation.store.storage import Data, Entry, Storage, check_rel, write_atomic
from curation.store.store_errors import retry_config, store_error


class ObjectStorage(Storage):
    """An object store bucket and prefix, through obstore. Every failed request is one
    StorageError line (curation/store/store_errors.py); with `fence_writes`, every write first
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
        """Call `check` before each write, create and delete from now on: the log's "open"
        row of this job and its test that no newer job has opened the run (`RunLog.fence`), which raises to stop
        this job before it writes over the newer one's files. One at a time (a thread of the
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

    def write(self, rel: str, data: Data) -> None:
        import obstore

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
