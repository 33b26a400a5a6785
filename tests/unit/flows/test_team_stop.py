"""Stopping the demo team (flows/demo/team_demo.py): the workers are told to stop together, so
they share one grace period instead of paying one each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flows.demo.team_demo import stop_together

# Exits 0 only once every process of its kind has been told to stop (each leaves a marker on
# SIGTERM); told alone, it outlasts the grace period and is killed.
LINGERING = """
import signal, sys, time
from pathlib import Path

here, count = Path(sys.argv[1]), int(sys.argv[2])
told = False

def on_term(*_):
    global told
    told = True
    (here / sys.argv[3]).touch()

signal.signal(signal.SIGTERM, on_term)
(here / f"ready-{sys.argv[3]}").touch()
while not (told and len(list(here.glob("told-*"))) == count):
    time.sleep(0.05)
"""


def lingering(tmp_path: Path, count: int) -> list[subprocess.Popen[bytes]]:
    script = tmp_path / "lingering.py"
    script.write_text(LINGERING)
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(count), f"told-{i}"],
            start_new_session=True,  # a group of its own, as the team starts them
        )
        for i in range(count)
    ]
    while len(list(tmp_path.glob("ready-*"))) < count:  # the handlers are in place
        for process in processes:
            assert process.poll() is None
    return processes


def test_the_workers_are_told_to_stop_together(tmp_path: Path) -> None:
    processes = lingering(tmp_path, 3)
    stop_together(processes, grace_s=60)
    assert [p.returncode for p in processes] == [0, 0, 0]  # none outlasted it, none killed


def test_one_that_outlasts_the_grace_period_is_killed(tmp_path: Path) -> None:
    processes = lingering(tmp_path, 2)
    stop_together(processes[:1], grace_s=1)
    assert processes[0].returncode == -9  # SIGKILL
    assert processes[1].poll() is None  # not this call's
    stop_together(processes[1:], grace_s=60)  # every one told now: it ends by itself
    assert processes[1].returncode == 0
