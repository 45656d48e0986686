"""`groupforge ...`: the command line; no hidden globals.

The app and what its commands share live in `pipelines.cli.app`; importing the command modules
registers their commands on it, in the order `groupforge --help` lists them.

Exit codes: 0 ok, 2 bad input (a table, file or flag is wrong: the message says which),
3 the run is locked by another job (with --no-wait), 4 a full disk, 1 anything unexpected.
"""

from __future__ import annotations

import os
import sys

from pipelines.cli import data_commands, model_commands, run_commands, toy_commands, tune_commands  # noqa: F401  (registers the commands)
from pipelines.cli.app import app, err_console

__all__ = ["app", "main"]


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the engine's INFO lines out of the tables
    os.environ.setdefault("RUST_LOG", "error")  # deltalake's Rust log: no WARN lines of its credential lookups
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
