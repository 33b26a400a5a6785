"""SIGTERM to a `shardflow` command that started servers stops every process it started.

A service manager, a container or a CI job stops a program with SIGTERM to that process
alone; `shardflow ui` left `mlflow ui` answering (Ctrl-C reached it through the terminal's
process group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_for(condition: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def test_sigterm_to_shardflow_ui_stops_the_mlflow_ui_it_started(tmp_path: Path) -> None:
    """SIGINT takes the same path (flows.cli.stopping_with)."""
    signum = signal.SIGTERM
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    # its own session, as a service manager starts it: only the signal sent reaches it
    cli = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    started: list[psutil.Process] = []
    try:
        assert wait_for(lambda: answers(port), timeout=180), "mlflow ui never answered"
        started = psutil.Process(cli.pid).children(recursive=True)
        assert started  # mlflow ui and its server processes
        os.kill(cli.pid, signum)
        assert cli.wait(timeout=30) == 128 + signum
        assert wait_for(lambda: not answers(port), timeout=10), "the UI still answers"
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [" ".join(p.cmdline()) for p in left]
    finally:  # nothing of this test left running, whatever it found
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
        for process in started:
            if process.is_running():
                process.kill()
