"""A tracking server end to end, reached through a URI that carries a token: train,
evaluate, register, promote, serve the champion, batch prediction; then the token is
nowhere the project writes: no file in the project, no Prefect log or artifact, nothing the
commands printed, nothing the server stored.

The server has no auth of its own: that is enough to prove nothing writes the userinfo
down (users pass credentials as MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD).
"""

from __future__ import annotations

import base64
import csv
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.support.environment import OFFLINE_ENV
from tests.e2e.conftest import Project, api_post, free_port
from tests.e2e.test_serve_model import post_json, wait_ready

pytestmark = pytest.mark.slow
MODEL_NAME = "shardflow"  # params.yaml's evaluate.model_name


@pytest.fixture
def tracking_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`mlflow server` on a free loopback port (SQLite, artifacts served from under tmp);
    yields its address and the directory holding everything it stores."""
    store = tmp_path / "mlflow_server"
    store.mkdir()
    port = free_port()
    log = tmp_path / "mlflow_server.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"),
                *("--port", str(port), "--workers", "1"),
                *("--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}"),
                *("--serve-artifacts", "--artifacts-destination", str(store / "artifacts")),
            ],
            cwd=store,
            env={**os.environ, **OFFLINE_ENV},  # as a team's is started (docs/orchestration.md)
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", process, log, timeout=180)
        yield f"127.0.0.1:{port}", store
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def files_holding(token: bytes, *roots: Path) -> list[str]:
    """Every file under ``roots`` (binary ones too: SQLite, DVC cache) that holds ``token``."""
    return [
        str(path)
        for root in roots
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink() and token in path.read_bytes()
    ]


def prefect_records(api_url: str) -> str:
    """What the Prefect server keeps of the runs: logs, artifacts, flow and task runs."""
    body = {"limit": 200}
    found = [
        api_post(api_url, path, {**body, "offset": offset})
        for path in ("/logs/filter", "/artifacts/filter", "/flow_runs/filter", "/task_runs/filter")
        for offset in range(0, 2000, 200)
    ]
    return json.dumps(found)


def test_tracking_server_end_to_end_and_no_token_written_down(
    project: Project, tracking_server: tuple[str, Path], tmp_path: Path
) -> None:
    address, server_store = tracking_server
    token = f"PLANTED_TOKEN_{uuid.uuid4().hex}"
    project.env["MLFLOW_TRACKING_URI"] = f"http://alice:{token}@{address}"
    project.set_params(train={"epochs": 1})
    printed = []

    # Train, evaluate, register and promote: the stages as `make run` runs them.
    printed.append(project.dvc("repro"))
    summary = json.loads((project.root / "reports" / "eval_summary.json").read_text())
    assert summary["promotion"]["promoted"] is True
    record = json.loads((project.root / "models" / "run.json").read_text())
    assert record["tracking_uri"] == f"http://{address}"  # git-tracked: no userinfo

    from mlflow import MlflowClient

    client = MlflowClient(f"http://{address}", f"http://{address}")
    champion = client.get_model_version_by_alias(MODEL_NAME, "champion")
    assert champion.run_id == record["run_id"]

    # The champion behind `mlflow models serve`, resolved through the server's registry.
    circles = project.root / "data" / "demo" / "circle"
    image = circles / "circle_00000.jpg"
    port = free_port()
    log = tmp_path / "serve_model.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [
                *("mlflow", "models", "serve", "-m", f"models:/{MODEL_NAME}@champion"),
                *("--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)),
            ],
            cwd=tmp_path,
            env=project.env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}/ping", process, log, timeout=300)
        data = [[base64.b64encode(image.read_bytes()).decode()]]
        body = {"dataframe_split": {"columns": ["image"], "data": data}}
        answer = post_json(f"http://127.0.0.1:{port}/invocations", body)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    [row] = answer["predictions"]  # type: ignore[misc]
    assert row["error"] == "" and row["label"] in {"circle", "square", "stripes"}

    # Batch prediction, recorded as a run of its own on the server.
    printed.append(
        project.run(
            sys.executable,
            "-m",
            "flows.predict",
            "data/demo/circle",
            "--output",
            "reports/predictions.csv",
        )
    )
    with (project.root / "reports" / "predictions.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(list(circles.iterdir()))  # the demo's broken files included
    answered = [row for row in rows if Path(row["path"]).name.startswith("circle_")]
    assert len(answered) == 14 and not any(row["error"] for row in answered)
    predict_runs = client.search_runs(
        [client.get_experiment_by_name("shardflow-predict").experiment_id]
    )
    assert [run.data.tags["model.version"] for run in predict_runs] == [champion.version]

    # The token was used (the server answered) and written down nowhere.
    secret = token.encode()
    client_home = Path(project.env["PREFECT_HOME"])
    assert files_holding(secret, project.root, client_home, server_store) == []
    assert token not in prefect_records(project.env["PREFECT_API_URL"])
    for result in printed:
        assert token not in result.stdout + result.stderr
    assert "alice" not in (project.root / "models" / "run.json").read_text()
