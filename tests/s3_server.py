"""An S3-compatible HTTP server for the tests: moto's standalone server on 127.0.0.1.

`S3Server.start()` runs `moto_server` on a free port and waits until it answers; `env()` is
the standard AWS environment that points obstore, delta-rs and Polars at it; `bucket()` makes
a new bucket. Tests reach it over HTTP like any S3 endpoint (conditional puts included).
"""

from __future__ import annotations

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


@dataclass
class S3Server:
    port: int
    process: subprocess.Popen = field(repr=False)

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

    def env(self) -> dict[str, str]:
        """The standard AWS variables for this endpoint (test credentials: moto accepts any)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def client(self):
        """A boto3 S3 client of this endpoint: a reader that shares no code with groupforge's."""
        import boto3

        env = self.env()
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])

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
