"""The champion outside the lab: a fresh interpreter, and `mlflow models serve` over HTTP."""

from __future__ import annotations

import base64
import csv
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port
from tests.trained_model import MODEL_NAME, TrainedProject

pytestmark = pytest.mark.slow
MODEL_URI = f"models:/{MODEL_NAME}@champion"

FRESH_PROCESS = """
import json, sys
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
import tasks
files = sys.argv[2:]
frame = model.predict(pd.DataFrame({"image": [open(f, "rb").read() for f in files]}))
print(json.dumps({"tasks_from": tasks.__file__, "rows": frame.to_dict("records")}))
"""


def reference_rows(project: TrainedProject) -> list[dict[str, str]]:
    with project.test_predictions.open() as handle:
        return list(csv.DictReader(handle))


def clean_env(project: TrainedProject) -> dict[str, str]:
    """The tracking store only; no PYTHONPATH, so `tasks` can come only from the model."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        MLFLOW_TRACKING_URI=project.tracking_uri,
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def test_champion_loads_and_predicts_in_a_fresh_process(
    trained_project: TrainedProject, tmp_path: Path
) -> None:
    reference = reference_rows(trained_project)
    files = [str(trained_project.source_dir / row["source"]) for row in reference]
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, MODEL_URI, *files],
        cwd=tmp_path,  # not the repo: the model's own code must be importable
        env=clean_env(trained_project),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert "/code/tasks/" in answer["tasks_from"]  # the code logged with the model
    assert [row["label"] for row in answer["rows"]] == [row["predicted"] for row in reference]
    for row, expected in zip(answer["rows"], reference, strict=True):
        assert row["error"] == ""
        assert abs(row["score"] - float(expected["score"])) <= 1e-5


def post_json(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} never answered:\n{log.read_text()[-4000:]}")


def test_served_champion_answers_jpeg_and_png_bytes(
    trained_project: TrainedProject, tmp_path: Path
) -> None:
    reference = reference_rows(trained_project)
    jpeg = next(row for row in reference if row["source"].endswith(".jpg"))
    png = next(row for row in reference if row["source"].endswith(".png"))
    payload = [
        base64.b64encode((trained_project.source_dir / row["source"]).read_bytes()).decode()
        for row in (jpeg, png)
    ] + [base64.b64encode(b"this is not an image").decode(), "aGVsbG8"]  # bad base64 last
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [
                *("mlflow", "models", "serve", "-m", MODEL_URI, "--env-manager", "local"),
                *("-h", "127.0.0.1", "-p", str(port)),
            ],
            cwd=tmp_path,
            env=clean_env(trained_project),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}/ping", process, log, timeout=180)
        body = {"dataframe_split": {"columns": ["image"], "data": [[item] for item in payload]}}
        answer = post_json(f"http://127.0.0.1:{port}/invocations", body)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    rows = answer["predictions"]
    assert isinstance(rows, list) and len(rows) == 4
    for row, expected in zip(rows[:2], (jpeg, png), strict=True):
        assert row["error"] == "" and row["label"] == expected["predicted"]
        assert abs(row["score"] - float(expected["score"])) <= 1e-5
        assert row[f"p_{expected['predicted']}"] == row["score"]
    assert rows[2]["label"] == "" and rows[2]["label_index"] == -1
    assert "not an image" in rows[2]["error"]
    assert rows[3]["label_index"] == -1 and "not base64" in rows[3]["error"]
