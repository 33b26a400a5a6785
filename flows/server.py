"""Start, check and stop the local Prefect server (127.0.0.1, SQLite) that `make` targets use.

``python -m flows.server ensure`` starts one in the background unless one already answers;
``python -m flows.server stop`` stops the one it started. Every flow entry point (each
`dvc repro` stage included) calls :func:`require_server`, which does the same, so a fresh
clone's `dvc repro` needs no server started beforehand and its runs show in the Prefect UI.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

PID_FILE = Path(".prefect") / "server.pid"
LOG_FILE = Path(".prefect") / "server.log"
START_LOCK = Path(".prefect") / "server.start.lock"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise RuntimeError("PREFECT_API_URL is not set (prefect.toml sets it for this repo)")
    return str(url).rstrip("/")


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_healthy(
    url: str, timeout: float = 90.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_healthy(url):
            return
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"Prefect server exited with {process.returncode}; see {LOG_FILE}")
        time.sleep(0.5)
    raise TimeoutError(f"Prefect server at {url} not healthy after {timeout:.0f} s; see {LOG_FILE}")


def start_server(
    host: str, port: int, log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Launch ``prefect server start`` detached, logging to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {}), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect = Path(sys.executable).with_name("prefect")
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [str(prefect), "server", "start", "--host", host, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )


def local_address(url: str) -> tuple[str, int] | None:
    """(host, port) the server must listen on to answer at ``url``; None if not this machine."""
    parts = urlsplit(url)
    if parts.hostname not in LOCAL_HOSTS or parts.port is None:
        return None
    return parts.hostname, parts.port


def ensure() -> str:
    """Start the local server unless one answers; one starter at a time (a file lock), so
    stages that find no server at once start one server, not several."""
    url = api_url()
    if is_healthy(url):
        print(f"Prefect server already up at {url}")
        return url
    address = local_address(url)
    if address is None:
        raise SystemExit(
            f"Prefect server at {url} is not reachable, and it is not on this machine, so it "
            "cannot be started here. Start it, or point PREFECT_API_URL at a local one."
        )
    START_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with START_LOCK.open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released on exit, or when we die
        if is_healthy(url):  # another process started it while we waited
            print(f"Prefect server already up at {url}")
            return url
        process = start_server(*address, LOG_FILE)
        PID_FILE.write_text(str(process.pid))
        wait_healthy(url, process=process)
    print(
        f"Prefect server started at {url} (UI: {url.removesuffix('/api')}, log: {LOG_FILE}; "
        "`make stop` stops it)"
    )
    return url


def stop() -> None:
    if not PID_FILE.exists():
        print("no Prefect server started by `make` is running")
        return
    pid = int(PID_FILE.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        print(f"stopped Prefect server (pid {pid})")
    except ProcessLookupError:
        print(f"Prefect server pid {pid} was not running")
    PID_FILE.unlink()


def require_server() -> None:
    """Make sure flows have a server to report to: start the local one if none answers."""
    if not is_healthy(api_url(), timeout=5.0):
        ensure()


def main() -> None:
    parser = argparse.ArgumentParser(prog="flows.server", description=__doc__)
    parser.add_argument("action", choices=["ensure", "stop", "status"])
    action = parser.parse_args().action
    if action == "ensure":
        ensure()
    elif action == "stop":
        stop()
    else:
        url = api_url()
        print(f"{url}: {'up' if is_healthy(url) else 'down'}")


if __name__ == "__main__":
    main()
