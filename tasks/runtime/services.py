"""The long-running processes a clone's ``shardflow`` commands start (``serve``'s deployment
process, ``serve-model``, ``ui``), recorded so that ``shardflow stop`` stops them all.

Each is recorded under the clone's ``.shardflow/started/`` while it runs: its pid (the leader
of a process group of its own, so its children stop with it) and its start time in clock
ticks since boot (``/proc/PID/stat``), which tells it from a later process given the same
pid. Only what is recorded here is stopped: another clone's processes and ones started by hand
are never named, whatever they run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.runtime.layout import shared_root

STARTED_DIR = ".shardflow/started"
STOP_GRACE_S = 10.0  # after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class StartedProcess:
    """A process group a clone started: its leader's pid and start time, what it is and
    the command it runs."""

    pid: int
    start_ticks: int
    what: str
    command: list[str]


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of ``/proc/PID/stat``);
    None when no such process runs."""
    try:
        return stat_fields(Path(f"/proc/{pid}/stat").read_text()).start_ticks
    except OSError:
        return None


@dataclass(frozen=True)
class StatFields:
    """What ``/proc/PID/stat`` says of a process that matters here."""

    state: str
    group: int
    start_ticks: int


def stat_fields(stat: str) -> StatFields:
    """The state (field 3), process group (5) and start time (22) in a ``/proc/PID/stat``
    line; the command name (field 2) may hold spaces and parentheses: counted from its end."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return StatFields(fields[0], int(fields[2]), int(fields[19]))


def started_dir(root: str | Path = ".") -> Path:
    return shared_root(root) / STARTED_DIR


def record_started(pid: int, what: str, command: list[str], root: str | Path = ".") -> None:
    """Record ``pid`` (a process group's leader, started by this clone) until it ends."""
    ticks = start_ticks(pid)
    if ticks is None:
        return  # ended already
    folder = started_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    record = StartedProcess(pid, ticks, what, list(command))
    (folder / f"{pid}.json").write_text(json.dumps(asdict(record)))


def forget_started(pid: int, root: str | Path = ".") -> None:
    (started_dir(root) / f"{pid}.json").unlink(missing_ok=True)


def recorded(root: str | Path = ".") -> list[StartedProcess]:
    """The processes this clone recorded (some may have ended since)."""
    found = []
    for path in sorted(started_dir(root).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(StartedProcess(**json.loads(path.read_text())))
    return found


def is_running(process: StartedProcess) -> bool:
    """Whether the recorded process still runs: the same pid, started at the same tick."""
    return start_ticks(process.pid) == process.start_ticks


def stop_started(root: str | Path = ".", grace_s: float = STOP_GRACE_S) -> list[StartedProcess]:
    """SIGTERM each recorded process group still running (SIGKILL what is left after
    ``grace_s``), and forget every record; the processes stopped."""
    stopped = []
    for process in recorded(root):
        if is_running(process):
            end_group(process.pid, grace_s)
            stopped.append(process)
        forget_started(process.pid, root)
    return stopped


def end_group(pid: int, grace_s: float) -> None:
    """SIGTERM the group ``pid`` leads, wait until none of it is left, SIGKILL after
    ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            return
        time.sleep(0.1)


def group_alive(pid: int) -> bool:
    """Whether any process of the group ``pid`` leads is left, zombies aside."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_fields((proc / "stat").read_text())
            if fields.group == pid and fields.state != "Z":
                return True
    return False


def main() -> None:
    """``python -m tasks.runtime.services stop``: what ``shardflow stop`` runs before it stops
    the Prefect server (a deployment process outliving its server prints tracebacks)."""
    if sys.argv[1:] != ["stop"]:
        sys.exit("usage: python -m tasks.runtime.services stop")
    for process in stop_started():
        running = " ".join(process.command[2:4])  # after `python -m`
        print(f"stopped this clone's {process.what} (pid {process.pid}: {running})")


if __name__ == "__main__":
    main()
