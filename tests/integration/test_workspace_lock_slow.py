"""The workspace lock with real processes: a second writer waits, names the holder, gives up
after workspace.lock_timeout_s, proceeds once the holder is done or dead, and children of the
holder pass straight through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.runtime.workspace_lock import HOLDER_FILE, LOCK_ENV, lock_timeout_s, read_holder

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# Holds the lock (as `holder-cmd`), says so in ./ready, and keeps it until ./release exists.
HOLDER = """
import pathlib, time
from tasks.runtime.workspace_lock import workspace_lock
with workspace_lock(".", timeout_s=0, command="holder-cmd"):
    pathlib.Path("ready").write_text("1")
    while not pathlib.Path("release").exists():
        time.sleep(0.05)
"""


def write_params(root: Path, timeout_s: float) -> Path:
    path = root / f"params-{timeout_s}.yaml"
    path.write_text(f"train:\n  epochs: 1\nworkspace:\n  lock_timeout_s: {timeout_s}\n")
    return path


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    return {**base, "PYTHONPATH": str(REPO), **extra}


def locked_cmd(params: Path, *cmd: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tasks.runtime.workspace_lock",
        "--params",
        str(params),
        "--",
        *cmd,
    ]


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@pytest.fixture
def holder(tmp_path: Path):  # type: ignore[no-untyped-def]
    process = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tmp_path, env=env())
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), "holder took the lock")
        yield process
    finally:
        (tmp_path / "release").write_text("1")
        process.wait(timeout=30)


def test_second_writer_names_the_holder_and_gives_up_after_the_timeout(
    tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    params = write_params(tmp_path, 1)
    cmd = locked_cmd(params, sys.executable, "-c", "open('ran', 'w')")
    second = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True)
    assert second.returncode == 75
    assert not (tmp_path / "ran").exists()  # its command never ran
    assert f"pid {holder.pid}" in second.stderr and "holder-cmd" in second.stderr
    assert "waiting up to 1 s" in second.stderr
    said = " ".join(second.stderr.split())  # the refusal block wraps its lines
    assert "still locked" in said and "workspace.lock_timeout_s" in said
    assert read_holder(tmp_path)["pid"] == holder.pid  # type: ignore[index]


def test_second_writer_waits_then_runs_once_the_holder_releases(
    tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    params = write_params(tmp_path, 120)
    log = (tmp_path / "second.log").open("w")
    cmd = locked_cmd(params, sys.executable, "-c", "open('ran', 'w')")
    second = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=log, stderr=log)
    wait_for(lambda: "waiting" in (tmp_path / "second.log").read_text(), "second waits")
    assert not (tmp_path / "ran").exists() and second.poll() is None
    (tmp_path / "release").write_text("1")
    assert second.wait(timeout=60) == 0
    assert (tmp_path / "ran").exists()
    assert f"pid {holder.pid}" in (tmp_path / "second.log").read_text()
    assert not (tmp_path / HOLDER_FILE).exists()  # released: nobody is named as holder


def test_children_of_the_holder_pass_through(tmp_path: Path) -> None:
    """`make run` holds the lock around `dvc repro`; its stage processes must not deadlock."""
    params = write_params(tmp_path, 0.1)
    inner = locked_cmd(params, sys.executable, "-c", "open('ran', 'w')")
    outer = subprocess.run(
        locked_cmd(params, *inner), cwd=tmp_path, env=env(), capture_output=True, text=True
    )
    assert outer.returncode == 0, outer.stderr
    assert (tmp_path / "ran").exists()


def test_a_killed_holder_leaves_no_lock_behind(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tmp_path, env=env())
    wait_for(lambda: (tmp_path / "ready").exists(), "holder took the lock")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    stale = json.loads((tmp_path / HOLDER_FILE).read_text())
    params = write_params(tmp_path, 0.1)
    # Even a child that inherited the dead holder's token must take the lock itself.
    cmd = locked_cmd(
        params, sys.executable, "-c", "import json; print(open('" + str(HOLDER_FILE) + "').read())"
    )
    after = subprocess.run(
        cmd, cwd=tmp_path, env=env(**{LOCK_ENV: stale["token"]}), capture_output=True, text=True
    )
    assert after.returncode == 0, after.stderr
    now = json.loads(after.stdout)
    assert now["pid"] != stale["pid"] and now["token"] != stale["token"]


def test_missing_timeout_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  epochs: 1\n")
    with pytest.raises(KeyError, match=r"params\.yaml: missing workspace\.lock_timeout_s"):
        lock_timeout_s(path)
    path.write_text("workspace:\n  lock_timeout_s: 0\n")
    with pytest.raises(ValueError, match=r"workspace\.lock_timeout_s must be seconds"):
        lock_timeout_s(path)


def test_the_timeout_is_read_as_the_stages_read_it(tmp_path: Path) -> None:
    """`6e2` is a number to DVC and to the stages (YAML 1.2); the lock reads the file the
    same way rather than refusing it as text."""
    path = tmp_path / "params.yaml"
    path.write_text("workspace:\n  lock_timeout_s: 6e2\n")
    assert lock_timeout_s(path) == 600.0
