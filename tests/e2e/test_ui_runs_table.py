"""The address `shardflow ui` prints opens on the project's runs table, not MLflow's GenAI
home: headless Chromium renders it (as `make screenshots` does) and the table shows the run."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
RUN_NAME = "runs-table-probe"


def printed_address(log: Path, process: subprocess.Popen[bytes]) -> str:
    """The address `shardflow ui` printed (its first line), once the UI answers."""
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-2000:]
        found = re.search(r"MLflow UI: (\S+)", log.read_text())
        if found:
            try:
                with urllib.request.urlopen(found[1].split("#")[0] + "health", timeout=2):
                    return found[1]
            except OSError:
                pass
        time.sleep(1)
    raise AssertionError(f"the UI never answered:\n{log.read_text()[-2000:]}")


def test_the_printed_address_shows_the_experiment_s_runs_table(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip(
            "Chromium is not installed (it is not in the lock; apt-get install chromium): "
            "the page the address opens cannot be rendered here"
        )
    from mlflow import MlflowClient

    from tasks.runtime.tracking import experiment_id

    sys.path.insert(0, str(REPO / "docs"))
    from screenshots import screenshot  # make screenshots' driver of headless Chromium

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    run = client.create_run(experiment_id(client), run_name=RUN_NAME)
    client.set_terminated(run.info.run_id)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": uri}
    log = tmp_path / "ui.log"
    with log.open("w") as handle:
        ui = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "ui", "--port", str(free_port())],
            cwd=tmp_path,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        address = printed_address(log, ui)
        assert "/#/experiments/" in address and "/runs" in address
        try:
            screenshot(address, tmp_path / "runs.png", RUN_NAME)
        except SystemExit as never_shown:
            message = f"{address} does not show the runs table: {never_shown}"
            raise AssertionError(message) from None
        assert (tmp_path / "runs.png").stat().st_size > 0
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)
