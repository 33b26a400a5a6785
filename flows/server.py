"""Start, check and stop the local Prefect server (127.0.0.1, SQLite) that `make` targets use.

``python -m flows.server ensure`` starts one in the background unless one already answers;
``python -m flows.server stop`` stops the one it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PID_FILE = Path(".prefect") / "server.pid"
LOG_FILE = Path(".prefect") / "server.log"


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


def ensure() -> str:
    url = api_url()
    if is_healthy(url):
        print(f"Prefect server already up at {url}")
        return url
    from prefect.settings import PREFECT_SERVER_API_HOST, PREFECT_SERVER_API_PORT

    process = start_server(
        PREFECT_SERVER_API_HOST.value(), PREFECT_SERVER_API_PORT.value(), LOG_FILE
    )
    PID_FILE.write_text(str(process.pid))
    wait_healthy(url, process=process)
    print(f"Prefect server started at {url} (UI: {url.removesuffix('/api')}, log: {LOG_FILE})")
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
    """Fail fast, with the fix, when flows would talk to a server that is not there."""
    url = api_url()
    if not is_healthy(url, timeout=5.0):
        raise SystemExit(
            f"Prefect server at {url} is not reachable. Start one with `make serve` "
            "(or `python -m flows.server ensure`), or point PREFECT_API_URL elsewhere."
        )


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
