"""The libraries' own output in a log file, not on the console: vLLM's, transformers' and torch's
log records, Python warnings, and what C++ code prints while an engine starts.

    log_libraries_to(path)   one file handler (appending; the file and its folder made at the
                             first record) on the "vllm", "transformers", "torch", "math_verify"
                             and "py.warnings" loggers, in place of their console handlers; Python warnings become
                             records; no transformers progress bars
    library_log()            the file they go to now, or None
    native_output_to_log()   file descriptor 2 into that file while a library starts (a C++
                             warning such as vLLM's "NUMA binding" is printed there, past Python's
                             logging); Python's own sys.stderr stays the console meanwhile

The CLI opens one per command (RUN/logs/<command>.log), before vLLM is imported: with
VLLM_CONFIGURE_LOGGING=0 (set here) vLLM installs no console handler of its own. Groupforge's
own lines (rich consoles) and the warnings its code raises stay on the console. Records carry
their message only: no environment variable is written.

Light: torch and transformers are imported here only when they are installed and a log is opened.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LIBRARY_LOGGERS = ("vllm", "transformers", "torch", "math_verify", "py.warnings", "groupforge")
"""The loggers whose records go to the log file (each with its descendants); "groupforge" is the
CLI's own record of what it printed as one line (an engine's traceback)."""

OWN_PACKAGES = tuple(str(Path(__file__).resolve().parents[1] / name) + os.sep
                     for name in ("store", "curation", "training", "pipelines", "groupforge"))
"""Where groupforge's own code lives: the warnings it raises stay on the console."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LibraryLogHandler(logging.FileHandler):
    """The log file's handler: it makes its folder when the first record comes (a command
    that logs nothing leaves no file), and keeps groupforge's own warnings out."""

    def __init__(self, path: Path, title: str) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.title = title
        self.setFormatter(logging.Formatter(_FORMAT))
        self.addFilter(lambda record: not _own_warning(record))

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        stream = super()._open()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        stream.write(f"---- {self.title}, pid {os.getpid()}, {started} ----\n")  # where a command's lines begin
        return stream


class OwnWarningsHandler(logging.StreamHandler):
    """Groupforge's own warnings, on sys.stderr as it is when one comes."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.addFilter(_own_warning)

    @property
    def stream(self):
        return sys.stderr


def _own_warning(record: logging.LogRecord) -> bool:
    """A Python warning raised by groupforge's code (its message starts with the file's path)."""
    return record.name == "py.warnings" and str(record.msg).startswith(OWN_PACKAGES)


def library_log() -> Path | None:
    """The file the libraries' records go to now (`log_libraries_to`), or None."""
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, LibraryLogHandler):
            return Path(handler.baseFilename)
    return None


def log_libraries_to(path: str | Path, title: str) -> Path:
    """Send the records of LIBRARY_LOGGERS to `path` (appended, under a line with `title`)
    instead of the console, and Python warnings with them; returns the file's absolute path.
    vLLM's records from INFO up, the others' from their own level (WARNING). A second call
    moves them to the new file."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # read when vLLM is imported: no console handler
    path = Path(path).absolute()
    handler = LibraryLogHandler(path, title)
    logging.captureWarnings(True)
    for name in LIBRARY_LOGGERS:
        _replace_handlers(logging.getLogger(name), handler)
    logging.getLogger("vllm").setLevel(logging.INFO)
    logging.getLogger("groupforge").setLevel(logging.INFO)
    logging.getLogger("py.warnings").addHandler(OwnWarningsHandler())
    try:  # transformers adds its console handler the first time it logs: have it do so now, then take it off
        from transformers.utils import logging as hf_logging
    except ImportError:
        pass
    else:
        hf_logging.disable_default_handler()
        hf_logging.disable_progress_bar()  # "Loading weights" bars on the console
    try:  # torch gives each logger it registers ("torch", "torch._dynamo", ...) a console handler at import
        import torch  # noqa: F401
    except ImportError:
        pass
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.startswith("torch.") and any(map(_is_console, logger.handlers)):
            _replace_handlers(logger, handler)
    _replace_handlers(logging.getLogger("torch"), handler)
    return path


def _replace_handlers(logger: logging.Logger, handler: logging.Handler) -> None:
    """`handler` in place of the logger's console handlers and of an earlier log file's (and of
    an earlier call's own-warnings handler); the logger stops propagating to the root's."""
    for old in list(logger.handlers):
        if isinstance(old, (LibraryLogHandler, OwnWarningsHandler)) or _is_console(old):
            logger.removeHandler(old)
            if isinstance(old, LibraryLogHandler) and old is not handler:
                old.close()
    logger.addHandler(handler)
    logger.propagate = False


def _is_console(handler: logging.Handler) -> bool:
    """A library's console handler: a plain StreamHandler (a FileHandler is a subclass)."""
    return type(handler) is logging.StreamHandler


@contextmanager
def native_output_to_log() -> Iterator[None]:
    """While the block runs, what C++ code writes to file descriptor 2 goes to the library log
    (when one is open); sys.stderr, which Python code and the progress bar write to, stays the
    console."""
    path = library_log()
    if path is None:
        yield
        return
    sys.stderr.flush()
    path.parent.mkdir(parents=True, exist_ok=True)
    console_fd = os.dup(2)
    console = open(console_fd, "w", encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                   errors="backslashreplace", buffering=1, closefd=False)
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    python_stderr, sys.stderr = sys.stderr, console
    try:
        yield
    finally:
        sys.stderr = python_stderr
        console.close()
        os.dup2(console_fd, 2)
        os.close(console_fd)
