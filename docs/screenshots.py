"""``make screenshots``: what a person sees after a pipeline run, taken with headless Chromium.

Needs a finished run (``make run``) and Debian's ``chromium`` (``apt-get install chromium``).
Starts what it needs and stops what it started: ``mlflow ui`` on a free port of 127.0.0.1
and, unless one answers, the local Prefect server. Writes ``docs/mlflow-run.png`` (the latest
run of the ``shardflow`` experiment) and ``docs/prefect-artifacts.png`` (the artifacts tab of
the Prefect flow run recorded on that MLflow run). Not part of the test suite.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from flows import server
from tasks.tracking import EXPERIMENT_NAME, client, tracking_uri

DOCS = Path("docs")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,900",
    "--virtual-time-budget=20000",  # let the single-page apps fetch and render
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


def latest_run() -> tuple[str, str, str | None]:
    """(experiment id, run id, Prefect flow run id or None) of the newest shardflow run."""
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(EXPERIMENT_NAME)
    runs = (
        mlflow_client.search_runs(
            [experiment.experiment_id], order_by=["start_time DESC"], max_results=1
        )
        if experiment
        else []
    )
    if experiment is None or not runs:
        raise SystemExit(f"no run in MLflow experiment {EXPERIMENT_NAME!r}: run `make run` first")
    flow_run = runs[0].data.tags.get("prefect.flow_run_id")
    return experiment.experiment_id, runs[0].info.run_id, None if flow_run == "none" else flow_run


def screenshot(url: str, out: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out.resolve()}"]
        subprocess.run([chromium, *flags, url], check=True, capture_output=True, timeout=120)
    print(f"{out}: {url}")


def main() -> None:
    experiment, run_id, flow_run = latest_run()
    DOCS.mkdir(exist_ok=True)
    port = free_port()
    address = ["--host", "127.0.0.1", "--port", str(port)]
    ui = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(), *address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started_prefect = server.running_url() is None
    try:
        wait_for(f"http://127.0.0.1:{port}/health")
        screenshot(
            f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{run_id}",
            DOCS / "mlflow-run.png",
        )
        if flow_run is None:
            print("the MLflow run records no Prefect flow run: no Prefect screenshot")
            return
        ui_root = server.ensure().removesuffix("/api")
        screenshot(
            f"{ui_root}/runs/flow-run/{flow_run}?tab=Artifacts", DOCS / "prefect-artifacts.png"
        )
    finally:
        ui.terminate()
        ui.wait(timeout=30)
        if started_prefect:
            server.stop()


if __name__ == "__main__":
    main()
