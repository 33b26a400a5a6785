"""`dvc repro` from a fresh repo, with no Prefect server running, runs every stage (the
first one starts the local server), reruns exactly what changed, and pushes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tasks.evaluate.store_check import REBUILD, StoreLostRuns, check_store
from tests.e2e.conftest import REPO, Project, api_post, free_port
from tests.prefect_database import seed_home

pytestmark = pytest.mark.slow


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w-]+)'", output))


def recomputed_test_accuracy(root: Path) -> tuple[float, int]:
    """Accuracy of models/model.keras over the test shards, counted here, and the count."""
    import keras

    from tasks.contracts.tf_reader import read_split

    model = keras.saving.load_model(root / "models/model.keras")
    correct = total = 0
    for images, labels in read_split(root / "data/shards", "test", batch_size=16, training=False):
        predicted = np.asarray(model(images, training=False)).argmax(axis=1)
        correct += int((predicted == labels.numpy()).sum())
        total += len(predicted)
    return correct / total, total


def flow_run_names(api_url: str) -> dict[str, list[str]]:
    """Flow name -> the names of its flow runs, from the Prefect API."""
    flows = api_post(api_url, "/flows/filter", {})
    names = {flow["id"]: flow["name"] for flow in flows}
    runs: dict[str, list[str]] = {}
    for run in api_post(api_url, "/flow_runs/filter", {"limit": 200}):
        runs.setdefault(names[run["flow_id"]], []).append(run["name"])
    return runs


def test_dvc_repro_end_to_end(
    project_without_server: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = project_without_server
    api_url = project.env["PREFECT_API_URL"]
    first = project.dvc("repro")
    every = {"source", "ingest", "shard", "validate", "train", "evaluate"}
    assert ran_stages(first.stdout) == every
    # The first stage started the server (one, not one per stage); the runs are in its UI.
    assert first.stdout.count("Prefect server started at") == 1, first.stdout
    assert f"UI: {api_url.removesuffix('/api')}" in first.stdout
    runs = flow_run_names(api_url)  # one flow run per stage module (+ the shard writer)
    stage_flows = {"ingest", "shard", "write-shards", "validate", "train", "evaluate"}
    assert set(runs) == stage_flows and all(len(names) == 1 for names in runs.values()), runs

    ingest = json.loads((project.root / "reports/ingest.json").read_text())
    assert (
        ingest["accepted"] + ingest["quarantined_count"] + ingest["duplicate_count"]
        == (ingest["files_found"])
    )
    reasons = " ".join(q["reason"] for q in ingest["quarantined"])
    for reason in ("empty file", "not an image", "truncated", "absurd dimensions", "conflicting"):
        assert reason in reasons
    validation = json.loads((project.root / "reports/validation.json").read_text())
    manifest = json.loads((project.root / "data/shards/manifest.json").read_text())
    # Each flow run is named after its data: the shard set's fingerprint, the MLflow run.
    images = sum(split["num_records"] for split in manifest["splits"].values())
    assert runs["shard"] == [f"shard · {manifest['fingerprint'][:8]} · {images} images"]
    assert runs["validate"] == [f"validate · {manifest['fingerprint'][:8]}"]
    run_name = json.loads((project.root / "models/run.json").read_text())["run_name"]
    assert runs["train"] == [f"train · {run_name}"]
    assert runs["evaluate"] == [f"evaluate · {run_name}"]
    assert validation["passed"] and validation["fingerprint"] == manifest["fingerprint"]
    # The reported test accuracy is the model's on the test shards, and the one MLflow holds.
    evaluation = json.loads((project.root / "metrics/eval.json").read_text())
    accuracy, count = recomputed_test_accuracy(project.root)
    assert count == manifest["splits"]["test"]["num_records"]
    assert evaluation["accuracy"] == pytest.approx(accuracy, abs=1e-9)
    from mlflow.tracking import MlflowClient

    run_id = json.loads((project.root / "models/run.json").read_text())["run_id"]
    run = MlflowClient(tracking_uri=project.env["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert run.data.metrics["test_accuracy"] == pytest.approx(evaluation["accuracy"], abs=1e-9)
    assert run.info.status == "FINISHED"

    # Nothing changed: no stage runs but the source folder's listing, and DVC reports the
    # pipeline up to date but for that always-changed listing.
    second = project.dvc("repro")
    assert ran_stages(second.stdout) == {"source"}
    assert project.dvc("status").stdout.split() == ["source:", "always", "changed"]

    # DVC never hashes the source folder: a FIFO and a link to /dev/zero in it hang neither
    # `dvc status` nor the listing, which changes, so ingest (which quarantines them) would
    # rerun; removed again, the listing is the one ingest ran on and nothing would rerun.
    demo = project.root / "data" / "demo"
    os.mkfifo(demo / "circle" / "pipe.png")
    (demo / "circle" / "zero.png").symlink_to("/dev/zero")
    project.run(sys.executable, "-m", "dvc", "status", timeout=120)
    project.run(sys.executable, "-m", "dvc", "repro", "--single-item", "source", timeout=120)
    assert "source_listing.json" in project.dvc("status", "ingest").stdout
    os.remove(demo / "circle" / "pipe.png")
    os.remove(demo / "circle" / "zero.png")
    project.dvc("repro", "--single-item", "source")
    assert "up to date" in project.dvc("status", "ingest").stdout

    # A lost tracking store is found from the reports' runs, and the one command its refusal
    # names reruns train and evaluate only (dry here: a full rebuild trains again for minutes
    # on shared cores; training into the store it finds is the train stage's own behaviour).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project.env["MLFLOW_TRACKING_URI"])
    (project.root / "mlflow.db").rename(project.root / "lost.db")
    with pytest.raises(StoreLostRuns) as refused:
        check_store(project.root)
    assert refused.value.fix is not None and REBUILD in refused.value.fix
    planned = project.dvc(*shlex.split(REBUILD)[1:], "--dry")
    assert ran_stages(planned.stdout) == {"train", "evaluate"}
    (project.root / "lost.db").rename(project.root / "mlflow.db")

    # A training param reruns train and evaluate only: the shards are not rebuilt.
    project.set_params(train={"learning_rate": 0.005})
    third = project.dvc("repro")
    assert ran_stages(third.stdout) == {"source", "train", "evaluate"}

    # A shard param reshards, revalidates and retrains, but does not re-ingest.
    project.set_params(shard={"encoding": "png"})
    fourth = project.dvc("repro")
    assert ran_stages(fourth.stdout) == {"source", "shard", "validate", "train", "evaluate"}

    # Shards travel through the local DVC remote.
    project.dvc("push")
    shards = project.root / "data/shards"
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    project.run("rm", "-rf", str(shards), str(project.root / ".dvc/cache"))
    project.dvc("pull")
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before


def test_concurrent_starters_start_one_server(tmp_path: Path, prefect_database: Path) -> None:
    """Two stages that find no server at once start one server between them, not two."""
    url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": url,
        "PREFECT_HOME": str(seed_home(tmp_path / "prefect_home", prefect_database)),
    }
    ensure = [sys.executable, "-m", "flows.servers.prefect_server", "ensure"]
    starters = [
        subprocess.Popen(ensure, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=300)[0] for process in starters]
        assert [process.returncode for process in starters] == [0, 0], outputs
        said = " ".join(outputs)
        assert said.count("Prefect server started at") == 1, outputs
        assert said.count("Prefect server already up") == 1, outputs
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        for process in starters:
            if process.poll() is None:
                process.kill()
        stop = [sys.executable, "-m", "flows.servers.prefect_server", "stop"]
        subprocess.run(stop, cwd=tmp_path, env=env, check=False)


def test_stages_wait_for_the_workspace_lock_and_pass_under_their_holder(
    project: Project,
) -> None:
    """A stage beside another writer waits, names it, and gives up after lock_timeout_s; a
    stage under the lock's holder (`make run` wraps `dvc repro` so) runs without waiting."""
    project.set_params(workspace={"lock_timeout_s": 2})
    locked = [sys.executable, "-m", "tasks.runtime.workspace_lock", "--"]
    wait_for_release = "import os, time\nwhile not os.path.exists('release'): time.sleep(0.05)"
    holder = subprocess.Popen(
        [*locked, sys.executable, "-c", wait_for_release], cwd=project.root, env=project.env
    )
    holder_file = project.root / ".shardflow/workspace.lock.json"
    try:
        deadline = time.monotonic() + 60
        while not holder_file.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "no lock taken"
            time.sleep(0.05)
        blocked = project.dvc("repro", "ingest", check=False)
    finally:
        (project.root / "release").write_text("1")
        holder.wait(timeout=60)
    said = " ".join((blocked.stdout + blocked.stderr).split())  # the block wraps its lines
    assert blocked.returncode != 0
    assert f"pid {holder.pid}" in said and "still locked" in said, said[-3000:]
    assert not (project.root / "data/ingest/index.json").exists()

    under_holder = project.run(*locked, sys.executable, "-m", "dvc", "repro", "ingest")
    assert ran_stages(under_holder.stdout) == {"source", "ingest"}
    assert (project.root / "data/ingest/index.json").exists()
