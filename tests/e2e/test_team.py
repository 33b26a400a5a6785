"""The team setup for real, on 127.0.0.1: the Prefect server, two process workers (pools
``cpu`` and ``gpu``) each in an empty directory of its own, a bare git remote, an S3 server
(moto) and ``mlflow server`` with its artifacts on S3 -- the team ``shardflow team-demo``
starts (flows/demo/team_demo.py). Two ``pipeline/team`` runs are started at once."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from flows.demo.team_demo import (
    WATCH_INTERVAL_S,
    WORKER_PREFIX,
    Team,
    publish,
    start_workers,
    started_team,
)
from tasks.runtime.params import shipped_params_text
from tests.e2e.conftest import REPO, Project, api_post, command_line, make_project, run
from tests.e2e.test_tracking_server import files_holding, prefect_records

pytestmark = pytest.mark.slow


@pytest.fixture
def team(tmp_path: Path, prefect_server: str) -> Iterator[tuple[Team, Project]]:
    """The team of ``shardflow team-demo`` on the session's Prefect server, and the user's
    clone of the tiny project: images under DVC, pushed to S3 and to the git remote."""
    with started_team(tmp_path / "team", prefect_url=prefect_server) as team:
        user = tmp_path / "user"
        user.mkdir()
        proj = make_project(user, prefect_server)
        shutil.copy2(REPO / "prefect.yaml", proj.root / "prefect.yaml")
        proj.env = {**proj.env, **team.s3_env, "MLFLOW_TRACKING_URI": team.tracking_url}
        publish(team, proj.root, proj.env)
        start_workers(team)
        try:
            yield team, proj
        finally:
            kill_workers(team)


def kill_workers(team: Team) -> None:
    """SIGKILL each worker's process group, before the team stops the rest: a Prefect worker
    that has run flows outlasts the grace period ``Team.stop`` gives it after SIGTERM, 30 s
    of waiting on nothing; how a worker stops is not what these tests check."""
    for name, process, _ in team.processes:
        if name.startswith(WORKER_PREFIX) and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def watch(
    proj: Project, params: dict[str, Any], deployment: str = "pipeline/team"
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "prefect", "deployment", "run", deployment, "--watch"]
    cmd += ["--watch-interval", WATCH_INTERVAL_S]
    return subprocess.Popen(
        [*cmd, "--params", json.dumps(params)],
        cwd=proj.root,
        env=proj.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_team_pipeline_runs_come_back_through_git_dvc_and_mlflow(
    team: tuple[Team, Project], prefect_server: str, tmp_path: Path
) -> None:
    servers, proj = team
    head = proj.run("git", "rev-parse", "HEAD").stdout.strip()
    # Two runs started together: the first builds the branch head, the second names the
    # commit and trains for 1 epoch instead of 2.
    first = watch(proj, {})
    second = watch(proj, {"commit": head, "overrides": {"train": {"epochs": 1}}})
    outputs = [first.communicate(timeout=1800)[0], second.communicate(timeout=1800)[0]]
    tails = servers.log_tail("worker-cpu") + servers.log_tail("worker-gpu")
    assert first.returncode == 0 and second.returncode == 0, f"{outputs}\n{tails}"

    # Each run left its own ref; the user's branch did not move.
    listed = proj.run(sys.executable, "-m", "flows.team", "refs", "--remote", "team").stdout
    refs = listed.split()
    assert len(refs) == 2 and all(r.startswith("refs/heads/runs/") for r in refs), refs
    assert proj.run("git", "ls-remote", "team", "refs/heads/main").stdout.split()[0] == head

    # The runs queued (pipeline/team's concurrency limit of 1): one ended before the other began.
    runs = api_post(prefect_server, "/flow_runs/filter", {"limit": 100})
    pipelines = [r for r in runs if r["parent_task_run_id"] is None and r["name"] in listed]
    assert len(pipelines) == 2 and all(r["state_type"] == "COMPLETED" for r in pipelines)
    a, b = sorted(pipelines, key=lambda r: datetime.fromisoformat(r["start_time"]))
    assert datetime.fromisoformat(a["end_time"]) <= datetime.fromisoformat(b["start_time"])
    # Data runs on the cpu pool, training runs on the gpu pool, each importing its code from
    # a clone under its own worker's directory, never from the user's clone.
    seen: dict[str, list[Path]] = {"cpu": [], "gpu": []}
    for child in runs:
        pool = child.get("work_pool_name")
        if child["parent_task_run_id"] is None or pool not in seen:
            continue
        body = {"logs": {"flow_run_id": {"any_": [child["id"]]}}, "limit": 200}
        for line in api_post(prefect_server, "/logs/filter", body):
            if line["message"].startswith("code from "):
                seen[pool] += [Path(p) for p in line["message"].split()[2::2]]
    for pool, paths in seen.items():
        assert len(paths) == 4, (pool, paths)  # two runs x (flow module, project code)
        assert all(p.is_relative_to(servers.workers[pool]) for p in paths), (pool, paths)

    # A local run of the same commit, in a clone of its own: the fingerprint to compare with.
    local_root = tmp_path / "local"
    run(["git", "clone", "-q", str(servers.bare), str(local_root)], tmp_path, proj.env)
    local = Project(local_root, {**proj.env, "PYTHONPATH": str(local_root)})
    local.dvc("pull", "data/demo.dvc")
    lock = [sys.executable, "-m", "tasks.runtime.workspace_lock", "--"]
    local.run(*lock, sys.executable, "-m", "dvc", "repro", "validate")
    local_fp = json.loads((local_root / "data/shards/manifest.json").read_text())["fingerprint"]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=servers.tracking_url)
    experiments = [e.experiment_id for e in client.search_experiments()]
    for ref in refs:
        # In the user's clone: fetch the run's ref, dvc pull, and the shards are the local
        # run's, and DVC finds everything current but the listing it makes on every run.
        proj.run("git", "fetch", "-q", "team", ref)
        proj.run("git", "checkout", "-q", "--detach", "FETCH_HEAD")
        shutil.rmtree(proj.root / "data" / "shards", ignore_errors=True)
        proj.dvc("pull")
        manifest = json.loads((proj.root / "data/shards/manifest.json").read_text())
        assert manifest["fingerprint"] == local_fp
        status = proj.dvc("status", "--json").stdout
        assert json.loads(status or "{}") == {"source": ["always changed"]}, status
        # The ref sits on the built commit; the training run's lineage names the data run's
        # commit (the ref's parent) and the same shards.
        assert proj.run("git", "merge-base", "--is-ancestor", head, "HEAD").returncode == 0
        data_commit = proj.run("git", "rev-parse", "HEAD^").stdout.strip()
        found = client.search_runs(experiments, f"tags.`git.commit` = '{data_commit}'")
        assert found, f"no MLflow run of commit {data_commit} on the tracking server"
        assert {r.data.tags["data.fingerprint"] for r in found} == {local_fp}
    versions = client.search_model_versions("name = 'shardflow'")
    assert len(versions) == 2  # one registered version per run
    champion = client.get_model_version_by_alias("shardflow", "champion")
    assert champion.version in {v.version for v in versions}

    # predict/team: on the gpu pool, in a fresh clone, the source pulled from the DVC remote,
    # the champion loaded from the tracking server, the CSV kept there.
    predicting = watch(proj, {"source": "data/demo/circle"}, "predict/team")
    output = predicting.communicate(timeout=900)[0]
    assert predicting.returncode == 0, f"{output}\n{servers.log_tail('worker-gpu')}"
    from tasks.serve.batch_prediction import PREDICT_EXPERIMENT, list_sources

    predict_runs = client.search_runs(
        [client.get_experiment_by_name(PREDICT_EXPERIMENT).experiment_id]
    )
    assert len(predict_runs) == 1
    tags, metrics = predict_runs[0].data.tags, predict_runs[0].data.metrics
    assert tags["model.version"] == champion.version, tags
    assert tags["predict.source"] == "data/demo/circle", tags
    assert metrics["num_images"] == len(list_sources(proj.root / "data/demo/circle")) > 0
    listed = client.list_artifacts(predict_runs[0].info.run_id, "predictions")
    assert [Path(a.path).name for a in listed] == ["predictions.csv"]
    flow_runs = api_post(prefect_server, "/flow_runs/filter", {"limit": 200})
    predict_run = next(
        r for r in flow_runs if r["parent_task_run_id"] is None and f"'{r['name']}'" in output
    )
    assert predict_run["work_pool_name"] == "gpu"
    body = {"logs": {"flow_run_id": {"any_": [predict_run["id"]]}}, "limit": 200}
    lines = [line["message"] for line in api_post(prefect_server, "/logs/filter", body)]
    clone = Path(next(m for m in lines if m.startswith("predicting ")).split(" in ")[-1])
    assert clone.is_relative_to(servers.workers["gpu"]), lines

    # Model artifacts went through the tracking server to S3.
    assert servers.s3 is not None
    s3: Any = servers.s3.client()
    listing = s3.list_objects_v2(Bucket=servers.s3.bucket, Prefix="mlartifacts/")
    assert listing.get("KeyCount", 0) > 0

    # The S3 secret reached every process through its environment and was written down
    # nowhere: no file of the team (servers' stores and logs, the workers' clones and
    # homes, the git remote), of the user's clone, no Prefect log, artifact or run record.
    secret = servers.s3.secret_key
    assert files_holding(secret.encode(), servers.base, proj.root) == []
    assert secret not in prefect_records(prefect_server)


def test_the_demo_team_stores_artifacts_on_the_shared_s3_server_and_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The team's S3 is :func:`flows.servers.s3_server.start_s3_server`'s (one way to start moto):
    the tracking server puts artifacts in its bucket, and the team stops it on exit. The
    tracking server runs without MLflow's job runner and its huey consumers."""
    import psutil
    from mlflow import MlflowClient

    import flows.demo.team_demo
    from flows.servers.s3_server import S3Server, start_s3_server

    started: list[S3Server] = []

    def start(log_file: Path) -> S3Server:
        started.append(start_s3_server(log_file))
        return started[-1]

    monkeypatch.setattr(flows.demo.team_demo, "start_s3_server", start)
    with started_team(tmp_path, prefect_url="http://127.0.0.1:9/api") as team:
        assert len(started) == 1 and team.s3 is started[0]
        client = MlflowClient(team.tracking_url)
        run_id = client.create_run(client.create_experiment("s3")).info.run_id
        client.log_text(run_id, "hello", "note.txt")
        s3: Any = team.s3.client()
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=team.s3.bucket)["Contents"]]
        assert any(k.startswith("mlartifacts/") and k.endswith("/note.txt") for k in keys), keys
        tracking = next(p for name, p, _ in team.processes if name == "mlflow")
        below = [" ".join(command_line(c)) for c in psutil.Process(tracking.pid).children(True)]
        assert below and not [c for c in below if "mlflow.server.jobs" in c], below
    assert started[0].process is not None and started[0].process.poll() is not None


def test_team_deploy_takes_the_pool_names_from_options_variables_or_defaults(
    prefect_server: str, tmp_path: Path
) -> None:
    """prefect.yaml's pool names are rendered from SHARDFLOW_CPU_POOL / SHARDFLOW_GPU_POOL:
    ``python -m flows.team deploy`` sets them from its options, else from the variables,
    else ``cpu`` / ``gpu``; no tracked file is edited."""
    root = tmp_path / "clone"
    for name in ("flows", "tasks"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "prefect.yaml", root / "prefect.yaml")
    (root / "params.yaml").write_text(shipped_params_text())
    before = (root / "prefect.yaml").read_bytes()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SHARDFLOW_")},
        "PYTHONPATH": str(root),
        "PREFECT_API_URL": prefect_server,
        "PREFECT_HOME": str(tmp_path / "prefect_client"),
    }
    existing = {pool["name"] for pool in api_post(prefect_server, "/work_pools/filter", {})}
    for pool in {"cpu", "gpu", "team-cpu-a", "team-gpu-b"} - existing:
        api_post(prefect_server, "/work_pools/", {"name": pool, "type": "process"})

    def deployed(*options: str, **variables: str) -> dict[str, str]:
        cmd = [sys.executable, "-m", "flows.team", "deploy", *options]
        run(cmd, root, {**env, **variables})
        found = api_post(prefect_server, "/deployments/filter", {"limit": 100})
        flows = {f["id"]: f["name"] for f in api_post(prefect_server, "/flows/filter", {})}
        return {
            f"{flows[d['flow_id']]}/{d['name']}": d["work_pool_name"]
            for d in found
            if d["name"] == "team"
        }

    chosen = deployed("--cpu-pool", "team-cpu-a", SHARDFLOW_GPU_POOL="team-gpu-b")
    assert chosen == {
        "pipeline/team": "team-cpu-a",
        "data/team": "team-cpu-a",
        "training/team": "team-gpu-b",
        "predict/team": "team-gpu-b",
    }
    assert deployed() == {
        "pipeline/team": "cpu",
        "data/team": "cpu",
        "training/team": "gpu",
        "predict/team": "gpu",
    }
    assert (root / "prefect.yaml").read_bytes() == before
