"""A run on an object store that cannot go as asked, through the real CLI (`python -m
pipelines.cli run SPEC --run-dir s3://...` in processes of their own) against moto's S3 server
over HTTP: a malformed URL, a missing bucket, wrong credentials, an endpoint nobody listens on,
and a policy that refuses the run's checkpoints half way through. Each is one `error:` line
naming the URL (or the object) and the problem, its documented exit code (docs/reliability.md,
"Object-store failures"), no traceback unless --debug, nothing written; the run refused half way
keeps whole tables, and a rerun with credentials that may write resumes and finishes.

Credentials are checked by a second moto server with authentication on (`S3Server.require_auth`):
it verifies each request's SigV4 signature against the IAM user's key and applies the user's
policy, resource ARNs and Deny included.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from pathlib import Path

import pytest

from tests.helpers import FAULTS_SPEC, check_invariants, cli, cli_all, error_line, groupforge_in_process, stopped_with
from tests.s3_server import ALL_S3, S3Server

DENIED_RUN = "runs/denied"
"""The run whose checkpoints the user "no-checkpoints" may not write."""


@pytest.fixture(scope="module")
def spec(toy_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "store.toml"
    path.write_text(FAULTS_SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"'))
    return path


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A moto S3 server that checks credentials: users "admin" (every S3 action) and
    "no-checkpoints" (the same, but PutObject denied under DENIED_RUN/checkpoints/); its bucket."""
    server = S3Server.start(tmp_path_factory.mktemp("moto-auth") / "moto.log")
    try:
        bucket = server.bucket()
        denied = {"Effect": "Deny", "Action": "s3:PutObject",
                  "Resource": f"arn:aws:s3:::{bucket}/{DENIED_RUN}/checkpoints/*"}
        keys = server.require_auth({"admin": [ALL_S3], "no-checkpoints": [ALL_S3, denied]})
        yield server, bucket, keys
    finally:
        server.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def _keys(server: S3Server, bucket: str) -> list[str]:
    return [item["Key"] for item in server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_a_bad_location_or_store_is_one_line_and_nothing_is_written(spec, s3_server, auth_server, tmp_path):
    auth, bucket, keys = auth_server
    missing = f"gf-missing-{uuid.uuid4().hex[:8]}"
    closed = _closed_port()
    unreachable = {**s3_server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}",
                   "GROUPFORGE_STORE_RETRY_TIMEOUT": "3"}
    cases = [  # (run dir, environment, exit code, what the line says after the URL)
        ("s3://", None, 2, "no bucket in the URL"),
        ("s3:/bucket/run", None, 2, "not a valid URL ('//' missing after 's3:'?)"),
        ("s3:bucket/run", None, 2, "not a valid URL ('//' missing after 's3:'?)"),
        ("s3://bucket", None, 2, "names a whole bucket"),
        ("gs//bucket/run", None, 2, "not a valid URL (':' missing after 'gs'?)"),
        ("ftp://host/run", None, 2, "unknown storage scheme 'ftp'"),
        (f"s3://{missing}/runs/x", s3_server.env(), 2,
         f"the bucket '{missing}' does not exist at {s3_server.endpoint} (AWS_ENDPOINT_URL)"),
        (f"s3://{bucket}/runs/x", auth.env(("AKIAUNKNOWNKEY000000", "wrong")), 1,
         "listing refused: invalid credentials (InvalidAccessKeyId"),
        (f"s3://{bucket}/runs/x", auth.env((keys["admin"][0], "wrong secret")), 1,
         "listing refused: invalid credentials (SignatureDoesNotMatch"),
        ("s3://bucket/runs/x", unreachable, 1, f"cannot reach the object store at http://127.0.0.1:{closed}"),
    ]
    commands = [["run", spec, "--run-dir", url] for url, _, _, _ in cases]
    local_only = "this command takes a local run folder, not an object-store URL"  # typer would make it s3:/b/x
    cases += [("s3://bucket/runs/x", None, 2, local_only), ("s3://bucket/runs/y", None, 2, local_only)]
    commands += [["generate", "--model", spec.parent, "--prompts", spec, "--out", "s3://bucket/runs/x"],
                 ["migrate", "s3://bucket/runs/y"]]
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    done = cli_all([(command, {**(env or {}), "GROUPFORGE_CACHE": str(cache)})
                    for command, (_, env, _, _) in zip(commands, cases)], cwd=cwd)
    for (url, _, code, problem), proc in zip(cases, done):
        assert proc.returncode == code, (url, proc.returncode, proc.stderr[-2000:])
        line = error_line(proc)  # the only line on stderr: no traceback
        assert line.startswith(f"error: {url}") and problem in line, (url, line)
    gave_up = re.search(r"gave up after ([0-9.]+) s", error_line(done[len(commands) - 3]))
    assert gave_up and float(gave_up[1]) < 10, error_line(done[len(commands) - 3])  # bounded retries
    assert not list(cwd.iterdir()) and not cache.exists()  # no folder "s3:" or "gs", no cache
    assert missing not in [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]  # never created
    assert _keys(auth, bucket) == []


def test_debug_shows_the_traceback_of_a_store_error(spec, s3_server, tmp_path):
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}",
           "GROUPFORGE_STORE_RETRY_TIMEOUT": "1", "GROUPFORGE_CACHE": str(tmp_path / "cache")}
    crash = cli("--debug", "run", spec, "--run-dir", "s3://bucket/runs/x", env=env, cwd=tmp_path)
    assert crash.returncode == 1 and "Traceback" in crash.stderr, crash.stderr[-3000:]
    text = " ".join(crash.stderr.split())  # the traceback is drawn to the terminal's width
    assert "StoreUnreachableError: s3://bucket/runs/x/_commits: listing failed: cannot reach the object store" in text


@pytest.mark.slow
def test_access_denied_half_way_leaves_whole_tables_and_a_rerun_resumes(spec, auth_server, tmp_path):
    """The user may write the run but not its checkpoints: the run stops (exit 1) at round 1's
    first checkpoint file, naming it; the bucket then holds round 0 and round 1's tables, whole,
    and no checkpoint. A rerun with the admin's key, on another machine (an empty cache),
    resumes and finishes: every round and step once, every table whole, the checkpoints there."""
    auth, bucket, keys = auth_server
    url = f"s3://{bucket}/{DENIED_RUN}"
    denied = groupforge_in_process("run", spec, "--run-dir", url, env={**auth.env(keys["no-checkpoints"]),
                                                                        "GROUPFORGE_CACHE": str(tmp_path / "node-1")})
    line = stopped_with(denied, 1)
    assert re.match(rf"error: {re.escape(url)}/checkpoints/step-2/\S+: writing refused: access denied "
                    r"\(AccessDenied: Access Denied\)", line), line
    stopped = tmp_path / "stopped"
    kept = auth.download(bucket, DENIED_RUN, stopped)
    assert not [k for k in kept if k.startswith("checkpoints/")], kept
    check_invariants(stopped)
    assert {k.split("/")[1] for k in kept if k.startswith("samples/round=")} == {"round=1"}

    rerun = groupforge_in_process("run", spec, "--run-dir", url, env={**auth.env(keys["admin"]),
                                                                       "GROUPFORGE_CACHE": str(tmp_path / "node-2")})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    finished = tmp_path / "finished"
    keys_after = auth.download(bucket, DENIED_RUN, finished)
    check_invariants(finished)
    assert "checkpoints/step-4/trainer_state.json" in keys_after
    records = [json.loads(line) for line in (finished / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["event"] == "round"] == [0, 1, 2]
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3, 4]
