"""The run's writer lock: one writing job per run folder (flock on RUN/.lock, which names
its holder), re-entrant within one process."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

_HELD: dict[Path, int] = {}  # run roots whose lock this process holds, with a nesting count


class RunLockedError(RuntimeError):
    """Another process holds the run's writer lock. The message names the run and the holder."""


@contextlib.contextmanager
def writer_lock(root: Path, wait: bool = True, timeout: float | None = None,
                on_wait: Callable[[str], None] | None = None, name: str | None = None) -> Iterator[None]:
    """The exclusive writer lock (flock on ROOT/.lock), re-entrant within one process. ROOT is
    the run folder, or for a run on an object store its folder in this machine's cache; `name`:
    the run as messages name it (default ROOT).

    `wait=False`, or `timeout` seconds passing, raises RunLockedError naming the holder;
    `on_wait(message)` is called once when the lock is busy and we start waiting.
    """
    key = root.resolve()
    if _HELD.get(key):
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    root.mkdir(parents=True, exist_ok=True)
    path = root / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, name or str(root), wait, timeout, on_wait)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                  "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        _HELD[key] = 1
        try:
            yield
        finally:
            del _HELD[key]
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, name: str, wait: bool, timeout: float | None,
             on_wait: Callable[[str], None] | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        message = f"run {name} is locked by {_describe_holder(path)}"
        if not wait:
            raise RunLockedError(message)
        if deadline is not None and time.monotonic() >= deadline:
            raise RunLockedError(f"{message}; gave up after {timeout:g}s")
        if on_wait is not None and not waited:
            on_wait(message + "; waiting")
        waited = True
        time.sleep(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))


def _describe_holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
