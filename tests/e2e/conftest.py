"""End-to-end fixtures: a real Prefect server on a free loopback port, and a throwaway copy
of the project (its own git repo, DVC cache and remote, tracking store) on tiny data."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tasks.runtime.params import shipped_params_text
from tests.prefect_database import running_server, seed_home

REPO = Path(__file__).resolve().parents[2]
PROJECT_FILES = [
    "tasks",
    "flows",
    "dvc.yaml",
    "models/pretrained",  # a train stage dependency
    "data/excluded.json",  # an ingest stage dependency
    "prefect.toml",
    "pyproject.toml",
    ".dvc/config",
    ".dvcignore",
]


def command_line(process: psutil.Process) -> list[str]:
    """``process``'s command line; none for a process that has ended (a zombie or gone), which
    a child can become between listing its parent's children and reading it."""
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def prefect_server(
    tmp_path_factory: pytest.TempPathFactory, prefect_database: Path
) -> Iterator[str]:
    """A real `prefect server start` on 127.0.0.1 (SQLite in a temp PREFECT_HOME, a copy of
    the session's migrated database)."""
    home = seed_home(tmp_path_factory.mktemp("prefect_home"), prefect_database)
    with running_server(home) as url:
        yield url


def api_post(api_url: str, path: str, body: dict[str, Any]) -> Any:
    """POST to the Prefect API as its own client does: the servers keep CSRF protection on
    (prefect.toml), so a request carries a token fetched for this client first."""
    import uuid

    import httpx

    client_id = str(uuid.uuid4())
    token = httpx.get(f"{api_url}/csrf-token", params={"client": client_id}, timeout=30)
    token.raise_for_status()
    headers = {"Prefect-Csrf-Token": token.json()["token"], "Prefect-Csrf-Client": client_id}
    response = httpx.post(f"{api_url}{path}", json=body, headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()


def run(
    cmd: list[str], cwd: Path, env: dict[str, str], check: bool = True, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout[-4000:]}"
            f"\n{result.stderr[-6000:]}"
        )
    return result


class Project:
    """A copy of the project in its own git repo, configured for tiny, fast runs."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env

    def run(
        self, *cmd: str, check: bool = True, timeout: int = 600
    ) -> subprocess.CompletedProcess[str]:
        return run(list(cmd), self.root, self.env, check=check, timeout=timeout)

    def dvc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "dvc", *args, check=check)

    def set_params(self, **sections: dict[str, object]) -> None:
        path = self.root / "params.yaml"
        params = yaml.safe_load(path.read_text())
        for section, values in sections.items():
            params[section].update(values)
        path.write_text(yaml.safe_dump(params, sort_keys=False))


def make_project(tmp_path: Path, api_url: str) -> Project:
    """The project copied under ``tmp_path`` with its flows pointed at ``api_url``."""
    from tasks.ingest.demo_data import generate

    root = tmp_path / "project"
    root.mkdir()
    for name in PROJECT_FILES:
        src, dst = REPO / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    # The shipped defaults, not the working copy's edits (its own dataset, model or sizes).
    (root / "params.yaml").write_text(shipped_params_text())
    generate(
        root / "data" / "demo",
        per_class=14,
        min_size=24,
        max_size=48,
        classes=("circle", "square", "stripes"),
    )
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **{k: v for k, v in os.environ.items() if k != "SHARDFLOW_LOCK_HELD"},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(root),
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(tmp_path / "prefect_client"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    proj = Project(root, env)
    proj.set_params(
        ingest={"splits": {"train": 0.6, "val": 0.2, "test": 0.2}, "workers": 1},
        shard={"image_size": [24, 24], "target_shard_mb": 0.01, "workers": 2},
        train={"epochs": 2, "batch_size": 8, "early_stopping_patience": 0},
        evaluate={"top_k": 2},
    )
    proj.run("git", "init", "-q")
    proj.run("git", "config", "user.email", "ci@shardflow.invalid")
    proj.run("git", "config", "user.name", "ci")
    proj.dvc("remote", "modify", "local", "url", str(tmp_path / "dvc-remote"))
    (root / ".gitignore").write_text("/data/demo/\n/mlflow.db\n/.shardflow/\n/.prefect/\n")
    proj.run("git", "add", "-A")
    proj.run("git", "commit", "-qm", "project under test")
    return proj


@pytest.fixture
def project(tmp_path: Path, prefect_server: str) -> Project:
    """The project, reporting to the session's Prefect server."""
    return make_project(tmp_path, prefect_server)


@pytest.fixture
def project_without_server(tmp_path: Path, prefect_database: Path) -> Iterator[Project]:
    """The project pointed at a free local port where no Prefect server runs (yet): the first
    stage has to start one, in the project's PREFECT_HOME (holding a copy of the session's
    migrated database). Whatever server the project started is stopped afterwards."""
    proj = make_project(tmp_path, f"http://127.0.0.1:{free_port()}/api")
    seed_home(Path(proj.env["PREFECT_HOME"]), prefect_database)
    try:
        yield proj
    finally:
        proj.run(sys.executable, "-m", "flows.servers.prefect_server", "stop", check=False)
