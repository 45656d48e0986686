"""What the Ray engine tests share: a private Ray instance per test module, in a temp folder."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pyarrow as pa

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a test's own local cluster needs no tokens


def ray_temp_dir() -> str:
    """A short temp folder for Ray's sessions and sockets: unix socket paths are limited to 107
    bytes, and pytest's (with xdist's popen-gwN) leave too little. Removed at exit."""
    path = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def sample_columns(samples: pa.Table) -> list[dict]:
    """What an engine decides, row by row (prompt order kept): tokens, log-probs, finish, seed."""
    return samples.select(["prompt_id", "sample_idx", "response_token_ids", "behavior_logprobs", "finish_reason",
                           "seed", "policy_version", "generator"]).to_pylist()
