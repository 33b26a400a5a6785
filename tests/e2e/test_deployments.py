"""`prefect deployment run 'pipeline/local'` against a real server and a serving process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Project, api_post

pytestmark = pytest.mark.slow


@pytest.fixture
def served(project: Project) -> Iterator[Project]:
    """`python -m flows.cli.deployments` serving the three deployments from the project root."""
    log = (project.root / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "flows.cli.deployments"],
        cwd=project.root,
        env=project.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            listing = deployment_names(project.env["PREFECT_API_URL"])
            if {"pipeline/local", "data/local", "training/local"} <= listing:
                break
            assert process.poll() is None, (project.root / "serve.log").read_text()[-4000:]
            time.sleep(0.5)
        else:
            raise AssertionError(f"deployments never appeared: {sorted(listing)}")
        yield project
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def deployment_names(api_url: str) -> set[str]:
    """``flow/deployment`` of every deployment the Prefect API lists: what `prefect
    deployment ls` prints, asked over HTTP from this process (the command, an interpreter
    importing Prefect, cost more than a second of CPU a poll)."""
    flows = {flow["id"]: flow["name"] for flow in api_post(api_url, "/flows/filter", {})}
    found = api_post(api_url, "/deployments/filter", {"limit": 200})
    return {f"{flows.get(d['flow_id'])}/{d['name']}" for d in found}


def deployment_run(
    project: Project, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return project.run(
        "prefect",
        "deployment",
        "run",
        "pipeline/local",
        "--watch",
        "--watch-interval",
        "1",
        "--watch-timeout",
        "900",
        *args,
        check=check,
        timeout=960,
    )


def flow_runs(api_url: str, **flow_run_filter: Any) -> list[dict[str, Any]]:
    """Flow runs from the Prefect API (``POST /flow_runs/filter``), each with its flow name."""
    body = {"flow_runs": flow_run_filter, "limit": 200}
    runs = api_post(api_url, "/flow_runs/filter", body)
    flows = api_post(api_url, "/flows/filter", {})
    names = {flow["id"]: flow["name"] for flow in flows}
    return [{**run, "flow_name": names[run["flow_id"]]} for run in runs]


def training_runs(client: Any) -> list[Any]:
    """The tracking store's training runs (an evaluation run is a child of one)."""
    every = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return [r for r in every if "mlflow.parentRunId" not in r.data.tags]


def test_pipeline_deployment_end_to_end(served: Project) -> None:
    project = served
    first = deployment_run(project, "--params", json.dumps({"overrides": {"train": {"epochs": 1}}}))
    assert "Completed" in first.stdout

    # The run's overrides landed in params.yaml, and dvc.lock records what the flow produced.
    assert "epochs: 1" in (project.root / "params.yaml").read_text()
    status = project.dvc("status").stdout  # but the source folder's listing, run every time
    assert status.split() == ["source:", "always", "changed"], status

    # The MLflow run carries the dataset fingerprint and the Prefect flow run id.
    from mlflow.tracking import MlflowClient

    manifest = json.loads((project.root / "data/shards/manifest.json").read_text())
    client = MlflowClient(tracking_uri=project.env["MLFLOW_TRACKING_URI"])
    runs = training_runs(client)  # each evaluation has a child run of its own besides
    assert len(runs) == 1
    run = runs[0]
    values = {**run.data.params, **run.data.tags}
    assert manifest["fingerprint"] in values.values()
    # ... that id is the training subflow of the deployment's flow run, as the API has it,
    created = re.search(r"UUID: ([0-9a-f-]{36})", first.stdout)
    assert created, first.stdout
    deployment_run_id = created.group(1)
    api_url = project.env["PREFECT_API_URL"]
    [deployed] = flow_runs(api_url, id={"any_": [deployment_run_id]})
    assert deployed["flow_name"] == "pipeline" and deployed["state_type"] == "COMPLETED"
    children = flow_runs(api_url, parent_flow_run_id={"any_": [deployment_run_id]})
    [training_run] = [child for child in children if child["flow_name"] == "training"]
    assert run.data.tags["prefect.flow_run_id"] == training_run["id"]
    assert training_run["id"] in run.data.tags["prefect.flow_run_url"]
    # ... and its test metrics are the evaluation's, not the per-epoch training accuracy.
    evaluation = json.loads((project.root / "metrics/eval.json").read_text())
    recorded = json.loads((project.root / "reports/eval_summary.json").read_text())
    assert recorded["run_id"] == run.info.run_id
    for key in ("accuracy", "top_k_accuracy", "macro_f1"):
        assert run.data.metrics[f"test_{key}"] == pytest.approx(evaluation[key], abs=1e-9)
    assert run.info.status == "FINISHED"

    # Nothing changed: the second run skips every stage and says so.
    second = deployment_run(project)
    assert "Completed" in second.stdout
    log = (project.root / "serve.log").read_text()
    for stage in ("ingest", "shard", "validate", "train", "evaluate"):
        assert f"Stage '{stage}' is up to date" in log
    assert len(training_runs(client)) == 1  # no new training run

    # A failing stage fails the flow run with its message, and no training starts. A
    # refusal reads as its block (what, why, fix), without a traceback, in the serving
    # process's output (once) and in the run's log; its full text is the run's state.
    served_before = len((project.root / "serve.log").read_text())
    bad = deployment_run(
        project,
        "--param",
        'overrides={"ingest": {"source_dir": "data/missing"}}',
        check=False,
    )
    assert bad.returncode != 0 or "Failed" in bad.stdout
    assert "Traceback" not in bad.stdout
    failed = re.search(r"UUID: ([0-9a-f-]{36})", bad.stdout)
    assert failed, bad.stdout
    logs = api_post(api_url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [failed[1]]}}})
    run_log = "\n".join(entry["message"] for entry in logs)
    served_log = (project.root / "serve.log").read_text()[served_before:]
    for said in (served_log, run_log):
        assert "Traceback" not in said, said
        assert "(SourceNotFound)" in said and "data/missing: source folder not found" in said
        assert "fix: set ingest.source_dir in params.yaml" in said
    assert served_log.count("Refused: ") == 1, served_log
    [failed_run] = flow_runs(api_url, id={"any_": [failed[1]]})
    assert "SourceNotFound: data/missing: source folder not found" in failed_run["state"]["message"]
    assert len(training_runs(client)) == 1


def test_predict_deployment_refuses_paths_outside_the_repository(
    served: Project, tmp_path: Path
) -> None:
    """`prefect deployment run 'predict/local'` wrote its CSV wherever `output` said and
    listed any folder on the machine through `source`. The served run now fails on its
    parameters before anything runs; nothing is written outside."""
    project = served
    outside = tmp_path / "outside"
    outside.mkdir()
    photo = project.root / "data" / "demo" / "circle" / "circle_00000.jpg"
    (outside / "photo.jpg").write_bytes(photo.read_bytes())
    (project.root / "data" / "elsewhere").symlink_to(outside, target_is_directory=True)
    before = sorted(outside.iterdir())
    for params, refused in (
        ({"output": str(outside / "leak.csv")}, "output="),
        ({"source": "data/elsewhere"}, "source='data/elsewhere' resolves to"),
        ({"output": "params.yaml"}, "a deployment run writes a .csv file"),
    ):
        result = project.run(
            *("prefect", "deployment", "run", "predict/local", "--watch", "--watch-interval", "1"),
            *("--watch-timeout", "300", "--params"),
            json.dumps({"source": "data/demo/circle", **params}),
            check=False,
            timeout=360,
        )
        assert result.returncode != 0 or "Failed" in result.stdout, result.stdout
        assert refused in (project.root / "serve.log").read_text()
    assert sorted(outside.iterdir()) == before
    assert not (project.root / "reports" / "predictions.csv").exists()
    assert "\npath" not in (project.root / "params.yaml").read_text()
