"""Kill `dvc repro` (SIGKILL to its process group: DVC and the stage) during ingest, shard,
validate and train, at seeded random moments, then rerun it: the result is what an
uninterrupted run gives, no half-written output is accepted, and no MLflow run is left
RUNNING."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tasks.contracts.index import load_index
from tasks.contracts.manifest import MANIFEST_NAME, MEMBERSHIP_NAME, records_file_name
from tasks.contracts.numpy_reader import OFFSETS_NAME
from tasks.contracts.shard_blocks import BLOCKS_NAME
from tasks.contracts.shard_swap import rebuild_folder, trash_folder
from tasks.contracts.tfds_metadata import DATASET_INFO_NAME, FEATURES_NAME, LABELS_NAME
from tasks.train.stage import IDENTITY_NAME
from tests.e2e.conftest import Project, command_line

pytestmark = pytest.mark.slow

SEED = 20240611
# The stage's process, and when its real work has begun (so the kill can land inside it).
STAGES: dict[str, tuple[str, Callable[[Path], bool]]] = {
    "ingest": ("flows.ingest", lambda root: True),
    "shard": (
        "flows.launch.shard",  # a shard (or its temporary file) exists: writing has begun
        lambda root: any(
            ".tfrecord" in p.name for p in rebuild_folder(root / "data/shards").glob("*")
        ),
    ),
    "validate": ("flows.launch.validate", lambda root: True),
    "train": (
        "flows.launch.train",
        lambda root: (root / ".shardflow/train_backup" / IDENTITY_NAME).exists(),
    ),
}
# What the shard stage writes beside the shards (manifest last; the others before it).
SIDECARS = {
    MANIFEST_NAME,
    records_file_name(0),
    OFFSETS_NAME,
    BLOCKS_NAME,
    DATASET_INFO_NAME,
    FEATURES_NAME,
    LABELS_NAME,
    MEMBERSHIP_NAME,
}
MAX_DELAY_S = {"ingest": 3.0, "shard": 1.0, "validate": 3.0, "train": 1.5}


def stage_process(parent: psutil.Process, needle: str) -> psutil.Process | None:
    for child in parent.children(recursive=True):
        if needle in " ".join(command_line(child)):
            return child
    return None


def wait_until(condition: Callable[[], object], what: str, timeout: float = 300.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def kill_during(
    project: Project,
    stage: str,
    rng: random.Random,
    started: Callable[[Path], bool] | None = None,
    at_once: bool = False,
) -> str | None:
    """Run `dvc repro` and SIGKILL its process group a random moment into ``stage``'s work
    (``started``: once that holds; ``at_once``: no delay); return the MLflow run id the
    killed training had opened, if any."""
    needle, begun = STAGES[stage]
    started = started or begun
    log = (project.root / f"kill-{stage}.log").open("w")
    repro = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro"],
        cwd=project.root,
        env=project.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: DVC, the stage and its workers
    )
    try:
        parent = psutil.Process(repro.pid)
        wait_until(
            lambda: repro.poll() is not None or stage_process(parent, needle),
            f"stage {stage}",
        )
        assert repro.poll() is None, (project.root / f"kill-{stage}.log").read_text()
        wait_until(lambda: repro.poll() is not None or started(project.root), f"{stage} work")
        time.sleep(0.0 if at_once else rng.uniform(0.0, MAX_DELAY_S[stage]))
        freeze_inside_a_stage(repro, parent)
        identity = project.root / ".shardflow/train_backup" / IDENTITY_NAME
        run_id = (
            json.loads(identity.read_text()).get("mlflow_run_id") if identity.exists() else None
        )
        group = [parent, *parent.children(recursive=True)]
        os.killpg(repro.pid, signal.SIGKILL)
    finally:
        repro.wait(timeout=60)
        log.close()
    _, alive = psutil.wait_procs(group, timeout=60)
    assert not alive, f"still running after SIGKILL: {alive}"
    assert_no_partial_json(project.root)
    return run_id


def stage_running(parent: psutil.Process) -> bool:
    """A stage process (``python -m flows.X``) of this `dvc repro` is alive (stopped counts)."""
    for child in parent.children(recursive=True):
        try:
            if "flows." in " ".join(command_line(child)) and child.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def freeze_inside_a_stage(repro: subprocess.Popen[bytes], parent: psutil.Process) -> None:
    """SIGSTOP the process group at a moment a stage process is running.

    The kill is meant for a stage. Between stages DVC alone runs, and it rewrites dvc.lock in
    place: a SIGKILL there tears dvc.lock, which is DVC's behaviour, not a stage's. So when
    the stage has already ended at the freeze, the group runs on until the next stage has
    started (dvc.lock is written by then), and the kill lands in that one.
    """
    while True:
        os.killpg(repro.pid, signal.SIGSTOP)
        if stage_running(parent):
            return
        os.killpg(repro.pid, signal.SIGCONT)
        wait_until(lambda: repro.poll() is not None or stage_running(parent), "the next stage")
        if repro.poll() is not None:
            return


def assert_no_partial_json(root: Path) -> None:
    """Every JSON output present parses: writes are atomic, so a kill leaves old or new."""
    index = root / "data/ingest/index.json"
    if index.exists():
        load_index(index)  # JSON Lines with a record count in its header: a cut one is refused
    outputs = [
        "reports/ingest.json",
        "data/shards/manifest.json",
        "reports/validation.json",
        "models/run.json",
        "metrics/train.json",
        "reports/train_summary.json",
        "plots/train_history.json",
        "metrics/eval.json",
        "reports/eval_summary.json",
    ]
    for name in outputs:
        path = root / name
        if path.exists():
            json.loads(path.read_text())  # raises on a torn file


def test_killed_stages_rerun_to_the_uninterrupted_result(project: Project) -> None:
    rng = random.Random(SEED)
    project.set_params(train={"epochs": 3})
    killed_run_id = None
    for stage in STAGES:
        killed_run_id = kill_during(project, stage, rng) or killed_run_id

    final = project.dvc("repro")
    assert "Running stage 'evaluate'" in final.stdout
    root = project.root
    # up to date but for the source folder's listing, which runs on every repro
    assert project.dvc("status").stdout.split() == ["source:", "always", "changed"]

    # The shards are whole and validated, and nothing unlisted lies among them.
    manifest = json.loads((root / "data/shards/manifest.json").read_text())
    validation = json.loads((root / "reports/validation.json").read_text())
    assert validation["passed"] and validation["fingerprint"] == manifest["fingerprint"]
    listed = {shard["file"] for split in manifest["splits"].values() for shard in split["shards"]}
    on_disk = {p.name for p in (root / "data/shards").iterdir() if not p.name.startswith(".")}
    dali = {f"{name}.idx" for name in listed}  # uncompressed shards carry DALI indexes
    assert on_disk == listed | dali | SIDECARS
    assert not list((root / "data/shards").glob(".*.tmp-*"))
    assert not rebuild_folder(root / "data/shards").exists()
    assert not trash_folder(root / "data/shards").exists()

    # The killed training's MLflow run was resumed and finished; no run is left RUNNING.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=project.env["MLFLOW_TRACKING_URI"])
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert runs and all(r.info.status in {"FINISHED", "FAILED", "KILLED"} for r in runs), [
        (r.info.run_id, r.info.status) for r in runs
    ]
    recorded = json.loads((root / "models/run.json").read_text())["run_id"]
    assert client.get_run(recorded).info.status == "FINISHED"
    assert killed_run_id == recorded  # resumed, not abandoned for a new run

    # An uninterrupted ingest + shard from scratch gives the same shards, byte for byte.
    shards = {p.name: p.read_bytes() for p in (root / "data/shards").iterdir()}
    project.run("rm", "-rf", "data/shards", "data/ingest")
    project.dvc("repro", "shard")
    assert json.loads((root / "data/shards/manifest.json").read_text()) == manifest
    assert {p.name: p.read_bytes() for p in (root / "data/shards").iterdir()} == shards


def validation_failures(root: Path) -> dict[str, str]:
    report = json.loads((root / "reports/validation.json").read_text())
    return {c["name"]: c["message"] for c in report["checks"] if not c["passed"]}


def test_a_refused_data_change_stays_refused_until_accepted(project: Project) -> None:
    """The data gate's baseline survives a kill during shard, `dvc repro -f shard` and a
    fresh clone; `shardflow accept-data` is what lets the change through, limits unchanged."""
    from tests.unit.shard.test_append import add_images

    root = project.root
    project.dvc("repro", "validate")
    params = (root / "params.yaml").read_text()
    project.run("git", "add", "-A")  # the accepted version is committed with dvc.lock
    project.run("git", "commit", "-qm", "accepted data")
    add_images(root / "data/demo", "blob", 14, seed=5)

    # killed once the rebuild has begun writing its set (beside the accepted one, left whole)
    accepted = (root / "data/shards" / MANIFEST_NAME).read_text()
    kill_during(project, "shard", random.Random(SEED), at_once=True)
    assert (root / "data/shards" / MANIFEST_NAME).read_text() == accepted
    rerun = project.dvc("repro", check=False)
    assert rerun.returncode != 0 and "Running stage 'train'" not in rerun.stdout
    refused = validation_failures(root)
    assert list(refused) == ["data_diff"] and "new classes ['blob']" in refused["data_diff"]

    project.dvc("repro", "-f", "shard")  # what the old advice said: "rerun the shard stage"
    assert project.dvc("repro", "validate", check=False).returncode != 0
    assert validation_failures(root) == refused

    clone = root.parent / "clone"
    project.run("git", "clone", "-q", str(root), str(clone))
    shutil.copytree(root / "data/demo", clone / "data/demo")
    cloned = Project(clone, {**project.env, "PYTHONPATH": str(clone)})
    assert cloned.dvc("repro", "validate", check=False).returncode != 0
    assert validation_failures(clone) == refused

    fingerprint = json.loads((root / "data/shards/manifest.json").read_text())["fingerprint"]
    assert f"--fingerprint {fingerprint[:12]}" in refused["data_diff"]
    project.run(
        sys.executable, "-m", "flows.cli", "accept-data",
        "--fingerprint", fingerprint[:12], "--reason", "blob is a class now",
    )  # fmt: skip
    accepted = project.dvc("repro", "validate")
    assert "Running stage 'validate'" in accepted.stdout  # the edited record reruns it
    assert validation_failures(root) == {}
    record = json.loads((root / "data/accepted.json").read_text())["datasets"]["data/demo"]
    assert record["fingerprint"] == fingerprint
    assert record["acceptance"]["reason"] == "blob is a class now"
    assert record["acceptance"]["by"] == "ci"  # the git user
    assert (root / "params.yaml").read_text() == params  # the limits stay as they were
