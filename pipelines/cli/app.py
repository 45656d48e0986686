"""The typer app behind `groupforge ...` and what its commands share: the exit codes, the
consoles, the run-folder check, the writer lock, the tables and the progress bar.

Exit codes: 0 ok, 2 bad input (a table, file or flag is wrong: the message says which),
3 the run is locked by another job (with --no-wait), 4 a full disk, 1 anything unexpected.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from store.errors import EngineFailure, JobError, NoSpaceError, is_no_space, no_space_error
from store.lock import RunLockedError
from store.run_store import RunStore
from store.storage import check_location, is_object_url
from store.verify import check_run

EXIT_BAD_INPUT = 2
EXIT_LOCKED = 3
EXIT_JOB = 1
EXIT_NO_SPACE = 4
DEBUG_ENV = "GROUPFORGE_DEBUG"  # set by --debug: errors keep their tracebacks

app = typer.Typer(add_completion=False, no_args_is_help=True, help="groupforge: table-first GRPO/GSPO post-training.")
toy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The embedded toy task and model.")
app.add_typer(toy_app, name="toy")
console = Console()
err_console = Console(stderr=True)

NO_WAIT = typer.Option(False, "--no-wait", help="Exit (code 3) instead of waiting for another job's lock.")
"""The --no-wait flag of every command that takes the run's writer lock."""


def fail(message: str, code: int) -> "typer.Exit":
    """Print `message` as one error line on stderr; the exit to raise with `code`."""
    # escaped: a message may quote TOML like "[filte]", which rich would take for markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def exit_codes() -> Iterator[None]:
    """Bad input (a table, file, flag or spec: SchemaError and pydantic's ValidationError are
    ValueErrors) -> one error line, exit 2; a run locked by another job -> exit 3; a job that
    cannot go on (store.errors.JobError) -> one error line, exit 1 (an engine's own error: its
    traceback into the command's log, which the line names); a full disk -> one error line naming
    the folder, exit 4. With --debug (GROUPFORGE_DEBUG) every error keeps its traceback."""
    try:
        yield
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        if isinstance(exc, NoSpaceError) or is_no_space(exc):  # a full disk, whoever wrote
            message = str(exc) if isinstance(exc, NoSpaceError) else str(no_space_error(getattr(exc, "filename", None)))
            raise fail(message, EXIT_NO_SPACE) from None
        if isinstance(exc, (FileNotFoundError, ValueError)):
            raise fail(str(exc), EXIT_BAD_INPUT) from None
        if isinstance(exc, RunLockedError):
            raise fail(str(exc), EXIT_LOCKED) from None
        if isinstance(exc, EngineFailure):
            raise fail(f"{exc} ({_logged(exc)}--debug for the traceback)", EXIT_JOB) from None
        if isinstance(exc, JobError):
            raise fail(str(exc), EXIT_JOB) from None
        raise


def command_log_path(run: str | Path, command: str) -> Path:
    """RUN/logs/<command>.log; for a run on an object store, in this machine's work folder of the
    run (store/location.py)."""
    from store.location import RunLocation
    from store.run_files import LOGS_DIR

    return RunLocation.of(run).work / LOGS_DIR / f"{command}.log"


def command_log(run: str | Path, command: str) -> Path:
    """Send what vLLM, transformers, torch and Python warnings print during this command to
    `command_log_path` (appended; curation/library_logs.py), before vLLM is imported. Returns the file."""
    from curation.library_logs import log_libraries_to

    return log_libraries_to(command_log_path(run, command), f"groupforge {command}")


def _logged(exc: BaseException) -> str:
    """Write `exc`'s traceback to the command's log; "details: LOG; " naming it, or "" without a log."""
    from curation.library_logs import library_log

    log = library_log()
    if log is None:
        return ""
    logging.getLogger("groupforge").error("%s", exc, exc_info=exc)
    shown = log.relative_to(Path.cwd()) if log.is_relative_to(Path.cwd()) else log
    return f"details: {shown}; "


def _print_version(value: bool) -> None:
    if value:
        from groupforge import __version__

        console.print(f"groupforge {__version__}")
        raise typer.Exit()


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show the traceback of every error (also: "
                                                                 f"{DEBUG_ENV}=1)."),
             version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print groupforge's version and exit.")) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


def local_run_folder(run: str | Path) -> None:
    """Refuse an object-store URL given to a command that takes a local run folder (a `Path`
    argument, which typer has made of `s3://b/x` the path `s3:/b/x`), saying so (exit 2)."""
    text = str(run)
    scheme, colon, rest = text.partition(":/")
    if isinstance(run, Path) and colon and not rest.startswith("/") and is_object_url(f"{scheme}://{rest}"):
        raise fail(f"{scheme}://{rest}: this command takes a local run folder, not an object-store URL (`run "
                   "--run-dir`, `curate`, `inspect`, `export`, `verify` and `report` take one)", EXIT_BAD_INPUT)


def checked_run_folder(run: str | Path) -> str | Path:
    """`run` (a folder or an object-store URL), checked against its log
    (store/verify.py) before a command reads it."""
    local_run_folder(run)
    with exit_codes():
        check_location(str(run), run=True)  # a mistyped URL is named as one, not as a missing folder
    if not is_object_url(run) and not Path(run).is_dir():
        raise fail(f"run folder {run} does not exist", EXIT_BAD_INPUT)
    with exit_codes():
        check_run(run)
    return run


def writer_lock(run: str | Path | RunStore, no_wait: bool):
    """The run's writer lock, waiting (and saying so) unless --no-wait; a RunStore given writes
    under it as this job."""
    store = run if isinstance(run, RunStore) else RunStore(run)
    return store.lock(wait=not no_wait, on_wait=lambda msg: err_console.print(f"[yellow]waiting:[/] {msg}"))


def show_table(title: str, columns: list[str], rows: list[list[str]], left: tuple[str, ...] = ()) -> None:
    """A table of text cells on stdout: a rich table when the console is wide enough for every
    cell, else the same cells as plain aligned text, so a pipe or a narrow terminal never gets
    a number cut to "16,9…" (lines longer than the terminal wrap instead)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    if console.measure(table, options=console.options.update(max_width=1 << 16)).maximum <= console.width:
        console.print(table)
        return
    widths = [max(len(cell) for cell in cells) for cells in zip(columns, *rows)]
    lines = [title] + ["  ".join(cell.ljust(w) if column in left else cell.rjust(w)
                                 for cell, w, column in zip(cells, widths, columns)).rstrip()
                       for cells in [columns, *rows]]
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def progress_bar() -> Progress:
    """The progress bar of a long command, on stderr so that stdout keeps only the tables."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=False,
    )
