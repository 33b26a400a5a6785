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

from tests.e2e.conftest import Project, command_line, free_port
from tests.trained_model import TrainedProject

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


def shardflow(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``shardflow COMMAND`` in its own session, as a service manager starts it: only the
    signal sent reaches it."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *command],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def alive(processes: list[psutil.Process]) -> list[str]:
    """The command lines of ``processes`` still running (a zombie has ended)."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(" ".join(command_line(process)))
        except psutil.NoSuchProcess:
            continue
    return running


def test_a_child_that_has_ended_is_read_as_having_no_command_line() -> None:
    """A child that exits between the listing of its parent's children and the reading of its
    command line is a zombie until reaped: psutil refuses to read it, and the helpers that look
    for a stage read it as no command line instead of failing the test that waits."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        process = psutil.Process(child.pid)
        assert wait_for(lambda: process.status() == psutil.STATUS_ZOMBIE, timeout=30)
        with pytest.raises(psutil.ZombieProcess):
            process.cmdline()
        assert command_line(process) == []
        assert alive([process]) == []
    finally:
        child.wait()
    assert command_line(process) == []  # reaped: gone


def sigterm_stops_all(cli: subprocess.Popen[bytes], started: list[psutil.Process]) -> None:
    """SIGTERM to ``cli`` alone: it exits 128+SIGTERM within seconds, and nothing it started
    (``started``) is left."""
    os.kill(cli.pid, signal.SIGTERM)
    assert cli.wait(timeout=30) == 128 + signal.SIGTERM
    assert wait_for(lambda: not alive(started), timeout=5), alive(started)


def cleanup(cli: subprocess.Popen[bytes], started: list[psutil.Process]) -> None:
    """Nothing of a test left running, whatever it found."""
    if cli.poll() is None:
        os.killpg(cli.pid, signal.SIGKILL)
    for process in started:
        if process.is_running():
            process.kill()


def test_sigterm_to_shardflow_ui_stops_the_mlflow_ui_it_started(tmp_path: Path) -> None:
    """SIGINT takes the same path (flows.cli.shardflow.stopping_with)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    cli = shardflow(["ui", "--port", str(port)], tmp_path, env)
    started: list[psutil.Process] = []
    try:
        assert wait_for(lambda: answers(port), timeout=180), "mlflow ui never answered"
        started = psutil.Process(cli.pid).children(recursive=True)
        assert started  # mlflow ui and its server processes
        sigterm_stops_all(cli, started)
        assert wait_for(lambda: not answers(port), timeout=10), "the UI still answers"
    finally:
        cleanup(cli, started)


def test_sigterm_to_shardflow_serve_model_stops_the_model_server(
    trained_project: TrainedProject,
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": trained_project.tracking_uri,
    }
    cli = shardflow(["serve-model", "--port", str(port)], trained_project.root, env)
    started: list[psutil.Process] = []
    try:
        assert wait_for(lambda: answers(port), timeout=180), "the model server never answered"
        started = psutil.Process(cli.pid).children(recursive=True)
        assert started  # tasks.serve.server and its uvicorn
        sigterm_stops_all(cli, started)
        assert not answers(port), "the model server still answers"
    finally:
        cleanup(cli, started)


def test_sigterm_to_shardflow_serve_stops_serving_and_removes_its_record(
    project: Project,
) -> None:
    """The deployments' runner stops and `.prefect/serving.json` goes, also when SIGTERM
    comes as serving begins; the Prefect server, which `shardflow serve` did not start
    here (the project names one), still answers."""
    from flows.servers.prefect_server import wait_healthy

    record = project.root / ".prefect" / "serving.json"
    cli = shardflow(["serve"], project.root, project.env)
    started: list[psutil.Process] = []
    try:
        assert wait_for(record.exists, timeout=180), "the deployments were never served"
        started = psutil.Process(cli.pid).children(recursive=True)
        assert any("flows.cli.deployments" in " ".join(command_line(p)) for p in started)
        sigterm_stops_all(cli, started)
        assert not record.exists()
        wait_healthy(project.env["PREFECT_API_URL"], timeout=10)
    finally:
        cleanup(cli, started)


def test_sigterm_to_shardflow_run_stops_its_stages_and_records_none_half_done(
    project_without_server: Project,
) -> None:
    """SIGTERM while a stage runs: the stage stops, `dvc.lock` records no stage that did
    not finish, the workspace lock is free, and the clone's Prefect server, which `run`
    started detached (as Ctrl-C leaves it), still answers."""
    from flows.servers.prefect_server import wait_healthy

    project = project_without_server
    cli = shardflow(["run"], project.root, project.env)
    started: list[psutil.Process] = []
    try:

        def a_stage_runs() -> str | None:
            for process in psutil.Process(cli.pid).children(recursive=True):
                with_stage = [a for a in command_line(process) if a.startswith("flows.")]
                if with_stage and with_stage[0] != "flows.servers.prefect_server":
                    return with_stage[0].removeprefix("flows.")
            return None

        assert wait_for(a_stage_runs, timeout=240), "no stage started"
        stage = a_stage_runs()
        started = psutil.Process(cli.pid).children(recursive=True)
        sigterm_stops_all(cli, started)
        lock = project.root / "dvc.lock"
        recorded = lock.read_text() if lock.exists() else ""
        assert f"\n  {stage}:" not in recorded, (stage, recorded)
        assert not (project.root / ".shardflow" / "workspace.lock.json").exists()
        wait_healthy(project.env["PREFECT_API_URL"], timeout=10)
        assert project.dvc("status", check=False).returncode == 0  # no lock of DVC's left
    finally:
        cleanup(cli, started)


def clone_processes(root: Path) -> list[str]:
    """The command lines of the processes running in the clone ``root`` (their working
    directory), zombies aside."""
    found = []
    for process in psutil.process_iter():
        try:
            if Path(process.cwd()) == root and process.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(process.cmdline()))
        except (psutil.Error, OSError):
            continue
    return found


def test_shardflow_stop_stops_what_this_clone_started_and_nothing_else(tmp_path: Path) -> None:
    """`shardflow ui` in two clones and a server started by hand in the first: `shardflow
    stop` in the first stops its UI (and the `shardflow ui` that ran it); the hand-started
    server and the other clone's UI keep answering."""
    clones = [tmp_path / "ours", tmp_path / "theirs"]
    ports = [free_port(), free_port()]
    clis, by_hand = [], None
    try:
        for clone, port in zip(clones, ports, strict=True):
            clone.mkdir()
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "MLFLOW_TRACKING_URI": f"sqlite:///{clone / 'mlflow.db'}",
            }
            clis.append(shardflow(["ui", "--port", str(port)], clone, env))
        hand_port = free_port()
        by_hand = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(hand_port), "--bind", "127.0.0.1"],
            cwd=clones[0],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in (*ports, hand_port):
            assert wait_for(lambda port=port: answers(port), timeout=180), f"{port} never answered"

        stop_env = {**os.environ, "PYTHONPATH": str(REPO)}
        stopped = subprocess.run(
            [sys.executable, "-m", "flows.cli", "stop"],
            cwd=clones[0],
            env=stop_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped this clone's ui" in stopped.stdout
        clis[0].wait(timeout=30)
        assert wait_for(lambda: clone_processes(clones[0]) == [" ".join(by_hand.args)], 10), (
            clone_processes(clones[0])
        )
        assert not answers(ports[0]) and answers(hand_port) and answers(ports[1])
        assert clis[1].poll() is None and "mlflow ui" in " ".join(clone_processes(clones[1]))
    finally:
        for cli in clis:
            if cli.poll() is None:
                os.killpg(cli.pid, signal.SIGTERM)
                cli.wait(timeout=60)
        if by_hand is not None:
            by_hand.kill()
            by_hand.wait()
