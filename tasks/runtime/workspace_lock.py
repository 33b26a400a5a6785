"""One writer at a time: the workspace lock every stage, deployment run and `make run` holds.

Two `dvc repro` runs, or a deployment run beside a `dvc repro`, would otherwise write the
same shards, model and ``dvc.lock`` at once. The lock is an ``flock`` on
``.shardflow/workspace.lock`` (the kernel drops it when its holder dies, so a killed run
never leaves a stale lock) plus ``.shardflow/workspace.lock.json`` saying who holds it.

It is reentrant across a process tree: the holder puts its token in
``$SHARDFLOW_LOCK_HELD``, so the stage processes `make run` -> `dvc repro` starts proceed
under their parent's lock instead of waiting for it forever.

``python -m tasks.runtime.workspace_lock -- CMD ...`` runs CMD holding the lock (what `make run`
does).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from tasks.runtime.atomic import write_json
from tasks.runtime.params import read_yaml
from tasks.runtime.refusals import Refused, refusal_block

LOCK_ENV = "SHARDFLOW_LOCK_HELD"
LOCK_FILE = Path(".shardflow") / "workspace.lock"
HOLDER_FILE = Path(".shardflow") / "workspace.lock.json"


class WorkspaceLocked(Refused, TimeoutError):
    """Another writer kept the workspace for longer than ``workspace.lock_timeout_s``."""

    fix = (
        "let the writer it names finish (or stop it), then rerun; workspace.lock_timeout_s "
        "in params.yaml sets how long a run waits"
    )


def lock_timeout_s(params_path: str | Path) -> float:
    """``workspace.lock_timeout_s`` from the raw params file; a clear error when it is missing."""
    path = Path(params_path)
    raw: Any = read_yaml(path.read_text()) or {}  # as the stages and DVC read it
    section = raw.get("workspace") if isinstance(raw, dict) else None
    if not isinstance(section, dict) or "lock_timeout_s" not in section:
        raise KeyError(
            f"{path}: missing workspace.lock_timeout_s (how many seconds a second writer waits "
            "for the workspace lock); add\nworkspace:\n  lock_timeout_s: 600"
        )
    value = section["lock_timeout_s"]
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{path}: workspace.lock_timeout_s must be seconds > 0, got {value!r}")
    return float(value)


def read_holder(root: str | Path = ".") -> dict[str, Any] | None:
    """Who holds (or last held) the lock: pid, command, since, token; None if unknown."""
    try:
        info = json.loads((Path(root) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown process"
    return f"pid {holder.get('pid')} ({holder.get('command')!r}, since {holder.get('since')})"


def _try_flock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_lock(path: Path) -> IO[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a+")  # never truncates; Python fds are not inherited by children


def _same_file(handle: IO[str], path: Path) -> bool:
    """False when the lock file was removed or replaced (`make clean`) after we opened it."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def held_by_ancestor(root: str | Path = ".") -> bool:
    """True when this process runs under the current holder (its token is in our env)."""
    token = os.environ.get(LOCK_ENV)
    holder = read_holder(root)
    if not token or not holder or holder.get("token") != token:
        return False
    with _open_lock(Path(root) / LOCK_FILE) as handle:
        if _try_flock(handle):  # nobody holds it: the token is stale (its holder is gone)
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return False
    return True


def _acquire(
    path: Path, root: Path, timeout_s: float, poll_s: float, out: IO[str]
) -> tuple[IO[str], float]:
    """Take the flock, waiting up to ``timeout_s``; says once whom it waits for."""
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    announced = False
    while True:
        handle = _open_lock(path)
        if _try_flock(handle):
            if _same_file(handle, path):
                return handle, time.monotonic() - start
            handle.close()  # locked a removed file: retry on the new one
            continue
        handle.close()
        holder = read_holder(root)
        if time.monotonic() >= deadline:
            raise WorkspaceLocked(
                f"workspace {root.resolve()} is still locked by {describe(holder)} after "
                f"{timeout_s:.0f} s (workspace.lock_timeout_s in params.yaml); wait for it to "
                f"finish or stop it. Lock: {path}"
            )
        if not announced:
            print(
                f"workspace {root.resolve()} is locked by {describe(holder)}; waiting up to "
                f"{timeout_s:.0f} s",
                file=out,
                flush=True,
            )
            announced = True
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


@contextmanager
def workspace_lock(
    root: str | Path = ".",
    *,
    timeout_s: float,
    command: str | None = None,
    poll_s: float = 0.5,
    out: IO[str] | None = None,
) -> Iterator[None]:
    """Hold the workspace lock of ``root`` for the block; children of the holder pass through."""
    root = Path(root)
    if held_by_ancestor(root):
        yield
        return
    out = out or sys.stderr
    handle, waited = _acquire(root / LOCK_FILE, root, timeout_s, poll_s, out)
    token = uuid.uuid4().hex
    previous = os.environ.get(LOCK_ENV)
    try:
        write_json(
            root / HOLDER_FILE,
            {
                "pid": os.getpid(),
                "command": command or shlex.join(sys.argv),
                "since": datetime.now(UTC).isoformat(timespec="seconds"),
                "token": token,
            },
        )
        if waited > poll_s:
            print(f"workspace lock acquired after {waited:.0f} s", file=out, flush=True)
        os.environ[LOCK_ENV] = token
        yield
    finally:
        if previous is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = previous
        (root / HOLDER_FILE).unlink(missing_ok=True)  # before unlocking: never erase the next
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()


def run_to_the_end(command: list[str]) -> int:
    """``command``'s exit status (128+signal when a signal ended it). SIGTERM to this
    process is passed on to it and waited for: the lock and its holder file are released
    once the command has stopped, never while it still writes (Python's default would end
    this process at once and leave the holder file behind)."""
    child = subprocess.Popen(command)

    def pass_on(signum: int, _: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        code = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.runtime.workspace_lock [--params FILE] -- CMD ...``: run CMD under the
    workspace lock."""
    import argparse

    parser = argparse.ArgumentParser(prog="tasks.runtime.workspace_lock", description=main.__doc__)
    parser.add_argument("--params", default="params.yaml", help="where lock_timeout_s is read")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    timeout_s = lock_timeout_s(args.params)
    try:
        with workspace_lock(".", timeout_s=timeout_s, command=shlex.join(command)):
            return run_to_the_end(command)
    except WorkspaceLocked as error:
        print(refusal_block(shlex.join(command), error), file=sys.stderr)
        return 75  # EX_TEMPFAIL: try again later


if __name__ == "__main__":
    sys.exit(main())
