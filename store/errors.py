"""Errors the CLI prints as one line (no traceback), with their exit codes (README, "Exit codes").

Bad input is a ValueError (SchemaError, pydantic's ValidationError): exit 2. A job that cannot
go on for a reason outside its input is a `JobError` (an inference engine's own error: an
`EngineFailure`, its traceback in the command's log): exit 1; a full disk is a `NoSpaceError`:
exit 4. Anything else is a bug: exit 1 with a traceback. `--debug` shows the traceback of every
error. Light: imported by curation, training and pipelines.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its name when the message is empty): what a
    one-line error quotes of a library's error."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class JobError(RuntimeError):
    """The job cannot go on (an engine or trainer rank kept dying, a missing extra); the message
    says what happened and what to do."""


class EngineFailure(JobError):
    """An inference engine raised an error of its own while it ran (not bad input, not ours):
    the message names the engine, the error's type and its first line; the error is chained."""


@contextmanager
def engine_failures(engine: str) -> Iterator[None]:
    """Turn any exception raised in the block (a call into the `engine`) into an EngineFailure."""
    try:
        yield
    except Exception as exc:
        raise EngineFailure(f"the {engine} engine failed: {type(exc).__name__}: {first_line(exc)}") from exc


class NoSpaceError(JobError):
    """A write failed because the filesystem under it is full (ENOSPC) or over quota (EDQUOT).
    The writer has removed its temporary file: what was on disk before is intact."""


def is_no_space(exc: BaseException) -> bool:
    """A full disk or quota: an OSError with ENOSPC/EDQUOT, or a library's own error that wraps
    one (safetensors raises SafetensorError "... No space left on device (os error 28)")."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in NO_SPACE_ERRNOS
    text = str(exc)
    return any(f"(os error {code})" in text for code in NO_SPACE_ERRNOS) or "No space left on device" in text


def no_space_error(path: str | Path | None) -> NoSpaceError:
    """The one-line message for a write to `path` that found no space: the folder, what is free
    there, and what to do."""
    if path is None:
        return NoSpaceError("no space left on device (a write failed with ENOSPC): free some space and rerun "
                            "the same command; what was written before is intact")
    path = Path(path)
    folder = path.parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    free = f"{shutil.disk_usage(existing).free / 2**20:,.1f} MiB free there now" if existing else "folder gone"
    return NoSpaceError(f"no space left on device in {folder} (writing {path.name}; {free}): free some space "
                        "and rerun the same command, which resumes; what was written before is intact")


@contextmanager
def disk_write(path: str | Path) -> Iterator[None]:
    """Turn a full disk inside the block (OSError ENOSPC/EDQUOT) into a NoSpaceError naming `path`
    (what the caller writes: a table part, a checkpoint, metrics.jsonl), not the temporary file."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, NoSpaceError) or is_no_space(exc):  # an inner write's: name the outer path
            raise no_space_error(path) from exc
        raise
