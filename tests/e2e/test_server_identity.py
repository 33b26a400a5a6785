"""Clones on one machine: each uses its own Prefect server, stops only its own, and never
serves deployments where another clone serves them (real servers, free loopback ports)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import REPO, Project, api_post, make_project
from tests.prefect_database import seed_home

pytestmark = pytest.mark.slow


def clone_env() -> dict[str, str]:
    """As a user's shell has it: no PREFECT_* variable names a server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return {**env, "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def in_clone(root: Path, *args: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=root,
        env={**clone_env(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def server(root: Path, action: str) -> str:
    return in_clone(root, "-m", "flows.servers.prefect_server", action)


def recorded(root: Path) -> str:
    return str(json.loads((root / ".prefect/server.json").read_text())["url"])


def home_of(url: str) -> Path:
    return Path(httpx.get(f"{url}/admin/settings", timeout=10).json()["home"])


def flow_names(url: str) -> set[str]:
    return {flow["name"] for flow in api_post(url, "/flows/filter", {})}


def is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def clones(tmp_path: Path, prefect_database: Path) -> Iterator[tuple[Path, Path]]:
    """Clone A (the project's Prefect and DVC config, and a migrated server database in its
    .prefect/) and, made later by the test, B."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    for name in ("prefect.toml", "dvc.yaml"):
        shutil.copy2(REPO / name, a / name)
    seed_home(a / ".prefect", prefect_database)
    try:
        yield a, b
    finally:
        for root in (b, a):
            if root.exists():
                subprocess.run(
                    [sys.executable, "-m", "flows.servers.prefect_server", "stop"],
                    cwd=root,
                    env=clone_env(),
                    check=False,
                    timeout=60,
                )


def test_each_clone_uses_its_own_server_and_stops_only_its_own(
    clones: tuple[Path, Path], prefect_database: Path
) -> None:
    a, b = clones
    said = server(a, "ensure")
    url_a = recorded(a)
    assert f"Prefect server started at {url_a}" in said
    assert home_of(url_a) == a / ".prefect"

    # B is a copy of A made while A's server runs (`cp -r`, .prefect/ included): B's record
    # names A's port, where A's server answers. B must not use it, nor stop it.
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("*.db*"))
    seed_home(b / ".prefect", prefect_database)  # an empty one: B's server starts sooner
    said = server(b, "stop")
    assert "no Prefect server started by this clone" in said
    assert f"{url_a} answers with the server of the clone {a}" in said
    assert is_up(url_a)

    # B's first flow (a stage calls require_server first) starts B's server and reports there.
    probe = (
        "from flows.servers.prefect_server import require_server\nrequire_server()\n"
        "from prefect import flow\n@flow(name='probe')\ndef probe() -> None: pass\nprobe()\n"
    )
    said = in_clone(b, "-c", probe)
    url_b = recorded(b)
    assert url_b != url_a and f"Prefect server started at {url_b}" in said
    assert f"the server of the clone {a}" in said
    assert home_of(url_b) == b / ".prefect"
    assert "probe" in flow_names(url_b) and "probe" not in flow_names(url_a)

    # What B's stages and B's `prefect ...` commands typed at its root use: B's server.
    used = (
        "from flows.servers.prefect_server import require_server as r; r(); "
        "import os; print(os.environ['PREFECT_API_URL'])"
    )
    assert in_clone(b, "-c", used).strip() == url_b
    configured = "from prefect.settings import PREFECT_API_URL as u; print(u.value())"
    assert in_clone(b, "-c", configured).strip() == url_b
    assert in_clone(a, "-c", configured).strip() == url_a
    assert in_clone(a, "-c", used).strip() == url_a

    # `stop` in B stops B's server only.
    assert f"stopped this clone's Prefect server at {url_b}" in server(b, "stop")
    assert not is_up(url_b) and is_up(url_a)
    assert "no Prefect server started by this clone" in server(b, "stop")
    assert is_up(url_a)

    # Named by the user, A's server is used as named (and said to be A's), never stopped by B.
    ensure = in_clone(b, "-m", "flows.servers.prefect_server", "ensure", PREFECT_API_URL=url_a)
    assert f"already up at {url_a} (named by you: the server of the clone {a}" in ensure
    stop = in_clone(b, "-m", "flows.servers.prefect_server", "stop", PREFECT_API_URL=url_a)
    assert f"{url_a} answers with the server of the clone {a}" in stop and is_up(url_a)


def deployments(api_url: str, name: str) -> list[dict[str, Any]]:
    found = api_post(api_url, "/deployments/filter", {"deployments": {"name": {"any_": [name]}}})
    return [d for d in found if d["name"] == name]


def clone_tag(project: Project) -> str:
    return f"clone:{socket.gethostname()}:{project.root}"


def served_by(api_url: str, project: Project, *, ready: bool) -> bool:
    """Whether all four `*/local` deployments carry the project's tag (and are polled)."""
    found = deployments(api_url, "local")
    return len(found) == 4 and all(
        clone_tag(project) in d["tags"] and (d["status"] == "READY" or not ready) for d in found
    )


@contextmanager
def serving(project: Project, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m flows.cli.deployments` in the project, stopped afterwards."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.cli.deployments"],
            cwd=project.root,
            env=project.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        finally:
            process.terminate()
            # the runner's shutdown took over 60 s on a loaded 2-core VM (load average 7)
            process.wait(timeout=180)


def wait_until(condition: Callable[[], bool], process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while not condition():
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(1)


def test_a_clone_refuses_to_serve_where_another_clone_serves(
    tmp_path: Path, prefect_server: str
) -> None:
    """Both clones named one shared server (PREFECT_API_URL): while A serves its
    deployments, B refuses, naming A, and A's deployments stay A's; once A stops, B serves
    (A's deployments are still READY for a minute: B asks A's serving process instead)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a: Project = make_project(tmp_path / "a", prefect_server)
    b: Project = make_project(tmp_path / "b", prefect_server)
    log_a, log_b = tmp_path / "serve-a.log", tmp_path / "serve-b.log"
    with serving(a, log_a) as process:
        wait_until(lambda: served_by(prefect_server, a, ready=True), process, log_a)
        refused = b.run(sys.executable, "-m", "flows.cli.deployments", check=False, timeout=180)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0, said[-3000:]
    assert "refusing to serve" in said and "'pipeline/local' by " in said
    assert str(a.root) in said, said[-3000:]
    assert served_by(prefect_server, a, ready=False)

    with serving(b, log_b) as process:
        wait_until(lambda: served_by(prefect_server, b, ready=False), process, log_b)
    assert f"pipeline/local: taking over from {socket.gethostname()}:{a.root}" in log_b.read_text()
