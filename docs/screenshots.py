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

import base64
import itertools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from flows.servers import prefect_server as server
from tasks.runtime.tracking import EXPERIMENT_NAME, RUNS_TABLE_QUERY, client, tracking_uri

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
    "--window-size=1800,1400",
]
RENDER_WAIT_S = 90.0  # how long a page may take to show what it is shot for
SETTLE_S = 3.0  # then a moment for the last requests and transitions
MLFLOW_RUNS_TABLE = RUNS_TABLE_QUERY  # the GenAI / Model training switch set to the latter
# Prefect's flow run page shows the Artifacts tab only once the run is loaded, so `?tab=`
# alone opens on Logs: the tab is clicked, by its label, once the page has rendered.
CLICK_TAB = """(() => {
  const tabs = [...document.querySelectorAll('*')].filter((el) =>
    el.textContent.trim() === LABEL && el.offsetParent !== null && el.children.length === 0);
  if (tabs.length) { tabs[0].click(); }
  return tabs.length > 0;
})()"""
SHOWS = "document.body.innerText.includes(TEXT)"


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


def screenshot(url: str, out: Path, shows: str, tab: str | None = None) -> None:
    """``url`` rendered by headless Chromium into ``out`` once the page shows the text
    ``shows``, after clicking the tab labelled ``tab`` when one is given (Chromium driven
    over the DevTools protocol)."""
    from websockets.sync.client import connect

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    port = free_port()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={port}"]
        browser = subprocess.Popen(
            [chromium, *flags, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_for(f"http://127.0.0.1:{port}/json/version")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=5) as answer:
                page = next(t for t in json.load(answer) if t["type"] == "page")
            with connect(page["webSocketDebuggerUrl"], max_size=None) as socket_:
                ids = itertools.count(1)

                def call(method: str, **params: Any) -> dict[str, Any]:
                    sent = next(ids)
                    socket_.send(json.dumps({"id": sent, "method": method, "params": params}))
                    while True:
                        message = json.loads(socket_.recv(timeout=60))
                        if message.get("id") == sent:
                            return dict(message.get("result", {}))

                def until(script: str) -> None:
                    deadline = time.monotonic() + RENDER_WAIT_S
                    while time.monotonic() < deadline:
                        done = call("Runtime.evaluate", expression=script, returnByValue=True)
                        if done.get("result", {}).get("value"):
                            return
                        time.sleep(1)
                    raise SystemExit(f"{url}: {script} never held")

                call("Page.navigate", url=url)
                if tab is not None:
                    until(CLICK_TAB.replace("LABEL", json.dumps(tab)))
                until(SHOWS.replace("TEXT", json.dumps(shows)))
                time.sleep(SETTLE_S)
                shot = call("Page.captureScreenshot", format="png")
            out.write_bytes(base64.b64decode(shot["data"]))
        finally:
            browser.terminate()
            browser.wait(timeout=30)
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
        mlflow_ui = f"http://127.0.0.1:{port}/#/experiments/{experiment}"
        screenshot(f"{mlflow_ui}{MLFLOW_RUNS_TABLE}", DOCS / "mlflow-runs.png", "small_cnn")
        screenshot(
            f"{mlflow_ui}/runs/{run_id}{MLFLOW_RUNS_TABLE}", DOCS / "mlflow-run.png", "promotion."
        )
        if flow_run is None:
            print("the MLflow run records no Prefect flow run: no Prefect screenshot")
            return
        ui_root = server.ensure().removesuffix("/api")
        screenshot(
            f"{ui_root}/runs/flow-run/{flow_run}?tab=Artifacts",
            DOCS / "prefect-artifacts.png",
            "Task runs",  # the Artifacts tab's heading of the task runs' artifacts
            tab="Artifacts",
        )
    finally:
        ui.terminate()
        ui.wait(timeout=30)
        if started_prefect:
            server.stop()


if __name__ == "__main__":
    main()
