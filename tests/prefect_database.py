"""A migrated, empty Prefect server database, made once a suite by a real ``prefect server
start`` and copied into each test server's Prefect home before that server starts.

A server on a fresh home spends about half of its start (some 4-5 s of CPU) migrating an
empty SQLite database to the schema every test server ends at anyway; on a copy of a migrated
one it finds nothing to migrate and goes straight to serving. The servers themselves still
start for real, each on its own copy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from flows.servers.prefect_server import free_port, start_server, wait_healthy

DATABASE = "prefect.db"  # where `prefect server start` keeps its SQLite database in PREFECT_HOME


def migrated_database(folder: Path) -> Path:
    """The template in ``folder`` (the test session's, shared by its xdist workers), made by
    the first worker to ask: a real server's database once it answered /health."""
    template = folder / "prefect-migrated.db"
    with FileLock(folder / "prefect-migrated.db.lock"):
        if not template.exists():
            make_template(template)
    return template


@contextlib.contextmanager
def running_server(home: Path) -> Iterator[str]:
    """A real ``prefect server start`` on a free loopback port, ``home`` its Prefect home,
    healthy before its API address is yielded, stopped after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_HOME": str(home), "PREFECT_API_URL": url}
    process = start_server("127.0.0.1", port, home / "server.log", env=env)
    try:
        wait_healthy(url, timeout=120, process=process)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def make_template(template: Path) -> None:
    """Start a server on a fresh home, wait until it is healthy (migrated, its block types
    registered), stop it, and copy its database (a consistent copy: SQLite's backup)."""
    home = template.with_suffix(".home")
    with running_server(home):
        pass
    partial = template.with_suffix(".partial")
    with (
        contextlib.closing(sqlite3.connect(home / DATABASE)) as source,
        contextlib.closing(sqlite3.connect(partial)) as copy,
    ):
        source.backup(copy)
    partial.replace(template)


def seed_home(home: Path, template: Path) -> Path:
    """``home`` holding a copy of ``template`` as its server database; returns ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, home / DATABASE)
    return home
