"""An S3-compatible HTTP server for the tests: moto's standalone server on 127.0.0.1.

`S3Server.start()` runs `moto_server` on a free port and waits until it answers; `env()` is
the standard AWS environment that points obstore, delta-rs and Polars at it; `bucket()` makes
a new bucket. Tests reach it over HTTP like any S3 endpoint (conditional puts included).

By default the server accepts any credentials. `require_auth(users)` makes it an S3 that checks
them, as AWS does: it creates IAM users with their policies and access keys (through moto's IAM
API, while the server still lets every request in), then turns on moto's authentication
(`/moto-api/reset-auth`): from then on every request's SigV4 signature is checked against the
user's secret key, and the user's policies (actions and resource ARNs, Deny over Allow) decide.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ALL_S3 = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
"""A policy statement that allows every S3 action on every bucket."""


@dataclass
class S3Server:
    port: int
    process: subprocess.Popen = field(repr=False)
    credentials: tuple[str, str] = ("testing", "testing")
    """(access key id, secret key) of `env()`, `client()` and `download()`."""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, log: Path | None = None) -> S3Server:
        port = _free_port()
        moto = Path(sys.executable).parent / "moto_server"
        out = open(log, "wb") if log else subprocess.DEVNULL
        process = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out)
        server = cls(port, process)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(server.endpoint, timeout=1).close()
                return server
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def env(self, credentials: tuple[str, str] | None = None) -> dict[str, str]:
        """The standard AWS variables for this endpoint, with `credentials` (default: this
        server's; before `require_auth`, test credentials that moto accepts)."""
        key, secret = credentials or self.credentials
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key,
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def client(self, service: str = "s3"):
        """A boto3 client of this endpoint (S3: a reader that shares no code with groupforge's)."""
        import boto3

        env = self.env()
        return boto3.client(service, endpoint_url=self.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])

    def require_auth(self, users: dict[str, list[dict]]) -> dict[str, tuple[str, str]]:
        """Create an IAM user per entry of `users` (name -> its policy statements) with an access
        key, then make the server authenticate and authorize every request (see the module
        docstring). The first user's key becomes this server's `credentials`. Returns each
        user's (access key id, secret key)."""
        iam, keys = self.client("iam"), {}
        for name, statements in users.items():
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy",
                                PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}))
            key = iam.create_access_key(UserName=name)["AccessKey"]
            keys[name] = (key["AccessKeyId"], key["SecretAccessKey"])
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})  # authenticate after 0 more requests
        urllib.request.urlopen(request, timeout=10).close()
        self.credentials = next(iter(keys.values()))
        return keys

    def bucket(self, name: str | None = None) -> str:
        """A new empty bucket; its name."""
        name = name or f"gf-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def download(self, bucket: str, prefix: str, dest: Path) -> list[str]:
        """Every object under `bucket/prefix/` into the folder `dest` (with boto3); their keys
        relative to the prefix."""
        client, keys = self.client(), []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
            for item in page.get("Contents", []):
                rel = item["Key"][len(prefix.rstrip("/")) + 1:]
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(dest / rel))
                keys.append(rel)
        return sorted(keys)


def aws_env_applied(server: S3Server) -> dict[str, str | None]:
    """Put the server's AWS variables into os.environ; returns what was there, for restoring."""
    before = {key: os.environ.get(key) for key in server.env()}
    os.environ.update(server.env())
    return before


def restore_env(before: dict[str, str | None]) -> None:
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
