"""`shardflow forget` killed at a step: the audit entry says started, and the same command
run again finishes the job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow import MlflowClient

from flows.forget.orchestration import KILL_ENV, STEPS
from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import load_forgotten
from tasks.contracts.manifest import MEMBERSHIP_NAME
from tasks.contracts.membership import Membership
from tasks.runtime.layout import Layout
from tasks.runtime.params import shipped_params_text
from tests.unit.erasure.test_lineage import layout_project, shard_set

REPO = Path(__file__).resolve().parents[2]


def forget(root: Path, env: dict[str, str], *images: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "flows.forget.orchestration",
        *images,
        "--reason",
        "asked",
        "--exact",
    ]
    return subprocess.run(
        [*command, "--by", "ana", "--root", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_forget_killed_at_a_step_is_finished_by_the_same_command(tmp_path: Path) -> None:
    project, layout = layout_project(tmp_path)
    fingerprint = shard_set(project, layout)
    params = yaml.safe_load(shipped_params_text())
    params["ingest"]["source_dir"] = "images"
    params["evaluate"]["model_name"] = "shardflow"  # the registered model made below
    layout.params.write_text(yaml.safe_dump(params))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    run = client.create_run("0", tags={"data.fingerprint": fingerprint})
    client.create_registered_model("shardflow")
    client.create_model_version("shardflow", "runs:/x/model", run_id=run.info.run_id)
    client.set_registered_model_alias("shardflow", "champion", "1")
    sha = file_sha256(project.source / "red" / "001.png")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, KILL_ENV: "shards"}

    killed = forget(tmp_path, env, "images/red/001.png")
    assert killed.returncode == -9, killed.stderr
    (erasure,) = load_forgotten(layout.forgotten).erasures
    assert erasure.state == "started" and erasure.steps == ["models", "sources", "index"]
    assert not (project.source / "red" / "001.png").exists()
    assert client.get_registered_model("shardflow").aliases == {}  # taken at once
    with Membership(layout.shards_dir / MEMBERSHIP_NAME) as membership:
        assert membership.find(sha)  # the shards still hold it: half done

    env.pop(KILL_ENV)
    done = forget(tmp_path, env, "images/red/001.png")  # the file is gone: the entry resumes
    assert done.returncode == 0, done.stderr
    (erasure,) = load_forgotten(layout.forgotten).erasures
    assert erasure.state == "done" and erasure.steps == list(STEPS)
    assert erasure.sha256 == [sha] and erasure.versions == {"retracted": ["1"]}
    with Membership(Layout(tmp_path).shards_dir / MEMBERSHIP_NAME) as membership:
        assert membership.find(sha) == [] and membership.fingerprint != fingerprint
    assert "shardflow.retracted" in client.get_model_version("shardflow", "1").tags
    assert "001" not in layout.forgotten.read_text()
    assert not (tmp_path / ".shardflow" / "forget" / "intent.json").exists()
    assert done.stdout.startswith("forget: done: 1 image(s) (1 named")
    assert "001" not in done.stdout  # the account names no image
