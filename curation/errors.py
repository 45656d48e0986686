"""Errors the CLI prints as one line (no traceback), with their exit codes (README, "Exit codes").

Bad input is a ValueError (SchemaError, pydantic's ValidationError): exit 2. A job that cannot
go on for a reason outside its input is a `JobError`: exit 1. Anything else is a bug: exit 1
with a traceback. Light: imported by curation, training and pipelines.
"""

from __future__ import annotations


class JobError(RuntimeError):
    """The job cannot go on (an engine or trainer rank kept dying, a missing extra); the message
    says what happened and what to do."""
