"""``make screenshots``: what a person sees after a pipeline run, taken with headless Chromium.

Needs a finished run (``make run``) and Debian's ``chromium`` (``apt-get install chromium``).
Starts what it needs and stops what it started: ``mlflow ui`` on a free port of 127.0.0.1
and, unless one answers, the local Prefect server. Writes ``docs/mlflow-runs.png`` (the
``shardflow`` experiment as the UI opens it: its runs table), ``docs/mlflow-run.png`` (the
latest training run's evaluation run: its description ends with the promotion decision) and
``docs/prefect-artifacts.png`` (the artifacts tab of the Prefect flow run recorded on the
training run). Not part of the test suite.
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
    """(experiment id, the run to show, Prefect flow run id or None): the newest training
    run's latest evaluation run (else the training run) and the training run's flow run."""
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(EXPERIMENT_NAME)
    found = (
        mlflow_client.search_runs([experiment.experiment_id], order_by=["start_time DESC"])
        if experiment
        else []
    )
    runs = [run for run in found if "mlflow.parentRunId" not in run.data.tags]  # training
    if experiment is None or not runs:
        raise SystemExit(f"no run in MLflow experiment {EXPERIMENT_NAME!r}: run `make run` first")
    training = runs[0]
    shown = training.data.tags.get("eval.latest_run_id", training.info.run_id)
    flow_run = training.data.tags.get("prefect.flow_run_id")
    return experiment.experiment_id, shown, None if flow_run == "none" else flow_run


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
        screenshot(f"http://127.0.0.1:{port}/#/experiments/{experiment}", DOCS / "mlflow-runs.png")
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
