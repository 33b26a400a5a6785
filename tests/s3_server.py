"""Pytest fixtures for a real S3 server (moto, started by flows/servers/s3_server.py; why moto:
there).

``s3_server`` gives each test a fresh bucket on one session-wide server, with the endpoint and
credentials exported to the test's environment (pass ``server.env`` on to subprocesses).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from flows.servers.s3_server import S3Server, start_s3_server, stop_s3_server

__all__ = ["S3Server", "add_dvc_remote", "s3_server", "s3_server_session", "use_dvc_remote"]


def add_dvc_remote(dvc: Callable[..., Any], server: S3Server, *, name: str = "s3") -> None:
    """Make an S3 remote the project's default (``dvc`` runs ``dvc ARGS`` in the project):
    the URL goes to the tracked ``.dvc/config``, the endpoint to the untracked
    ``.dvc/config.local``; the keys stay in the environment (``server.env``)."""
    dvc("remote", "add", "-d", name, server.url("dvc"))
    use_dvc_remote(dvc, server, name=name)


def use_dvc_remote(dvc: Callable[..., Any], server: S3Server, *, name: str = "s3") -> None:
    """What each clone's owner types once: the endpoint, in ``.dvc/config.local``."""
    dvc("remote", "modify", "--local", name, "endpointurl", server.endpoint_url)


@pytest.fixture(scope="session")
def s3_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the session (started once, ~2 s); tests get their own bucket."""
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto_server.log")
    try:
        yield server
    finally:
        stop_s3_server(server)


@pytest.fixture
def s3_server(s3_server_session: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """A fresh bucket on the session's S3 server, with endpoint and credentials exported to
    this process's environment (``S3Server.env``; pass it on to subprocesses)."""
    server = S3Server(
        endpoint_url=s3_server_session.endpoint_url,
        bucket=f"shardflow-{uuid.uuid4().hex[:8]}",
        access_key=s3_server_session.access_key,
        secret_key=s3_server_session.secret_key,
    )
    server.client().create_bucket(Bucket=server.bucket)  # type: ignore[attr-defined]
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return server
