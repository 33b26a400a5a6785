"""A local S3-compatible server: moto's standalone ``moto_server`` on 127.0.0.1, a free port.

Used by the tests (tests/s3_server.py fixtures), the bench (``read.s3``) and a one-machine
team demo.

Why moto and not MinIO: MinIO's server is not installable from the package registries this
project builds from, while moto is (it is in the lock). ``moto_server`` is a separate process
that speaks the S3 REST protocol over HTTP, so boto3, s3fs and ``dvc-s3`` talk to it exactly
as they talk to AWS or MinIO (signed requests, multipart uploads, ETags); it is also the
server ``dvc-s3``'s own test-suite runs against. It runs here as its own process on a free
port, like a real server, in its own process group, and is stopped whole afterwards.

Credentials reach clients through the environment only (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``): nothing secret is written to a file. DVC
gets the endpoint with ``dvc remote modify --local`` (``.dvc/config.local``, never tracked).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MOTO_SERVER = Path(sys.executable).parent / "moto_server"


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint, its credentials and one empty bucket."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    process: subprocess.Popen[bytes] | None = field(default=None, compare=False, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs in its environment to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
        }

    def url(self, *parts: str) -> str:
        """``s3://bucket/part/part``."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])

    def client(self) -> object:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_s3_server(log_file: Path, *, timeout: float = 60.0) -> S3Server:
    """Start ``moto_server`` on a free loopback port, wait until it answers, make a bucket."""
    port = _free_port()
    log = log_file.open("wb")
    process = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped whole, never orphaned
    )
    server = S3Server(
        endpoint_url=f"http://127.0.0.1:{port}",
        bucket=f"shardflow-{uuid.uuid4().hex[:8]}",
        # moto accepts any key pair; fresh random ones show nothing depends on fixed values
        access_key=f"AK{uuid.uuid4().hex[:16].upper()}",
        secret_key=uuid.uuid4().hex,
        process=process,
    )
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            log.close()
            raise RuntimeError(f"moto_server exited {process.returncode}; see {log_file}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError as error:
            if time.monotonic() > deadline:
                stop_s3_server(server)
                message = f"moto_server not up in {timeout:.0f} s; see {log_file}"
                raise RuntimeError(message) from error
            time.sleep(0.1)
    server.client().create_bucket(Bucket=server.bucket)  # type: ignore[attr-defined]
    return server


def stop_s3_server(server: S3Server) -> None:
    if server.process is None or server.process.poll() is not None:
        return
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
