"""DVC's comparison commands on a Shardflow repo: `dvc metrics diff` and `dvc plots diff`
between commits, and `dvc exp run -S` experiments that `dvc exp show` lists with their
params, metrics and MLflow run, each run logged to the repository's MLflow store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Project

pytestmark = pytest.mark.slow


def commit_all(project: Project, message: str) -> None:
    project.run("git", "add", "-A")
    project.run("git", "commit", "-qm", message)


def exp_rows(project: Project) -> dict[str, dict[str, Any]]:
    """`dvc exp show --json`, flattened: experiment name -> {params, metrics} of its files."""
    shown = json.loads(project.dvc("exp", "show", "--json").stdout)
    rows: dict[str, dict[str, Any]] = {}
    for baseline in shown:
        for exp in baseline.get("experiments") or []:
            for revision in exp["revs"]:
                data = revision["data"]
                rows[revision["name"]] = {
                    "params": {f: v["data"] for f, v in (data.get("params") or {}).items()},
                    "metrics": {f: v["data"] for f, v in (data.get("metrics") or {}).items()},
                }
    return rows


def test_metrics_and_plots_diff_between_commits_and_experiments_show(project: Project) -> None:
    # A queued experiment's stages run in a copy under .dvc/tmp/exps: no store is pinned
    # here, so each run must find the repository's mlflow.db by itself ($DVC_ROOT).
    del project.env["MLFLOW_TRACKING_URI"]
    project.set_params(train={"epochs": 1})
    # A queued experiment's copy holds what git and DVC track: the images go under DVC.
    project.dvc("add", "data/demo")
    project.dvc("repro")
    # metrics/, plots/ and reports/ are committed like dvc.lock (the project's own
    # .gitignore, copied here, keeps only the cached outputs out of git).
    (project.root / ".gitignore").write_text((Path(__file__).parents[2] / ".gitignore").read_text())
    commit_all(project, "baseline")
    tracked = project.run("git", "ls-files").stdout.split()
    for path in ("metrics/eval.json", "plots/train_history.json", "reports/eval_summary.json"):
        assert path in tracked
    assert "models/model.keras" not in tracked

    train = json.loads((project.root / "metrics/train.json").read_text())
    assert train["epochs_completed"] == 1 and isinstance(train["final"]["val_loss"], float)
    summary = json.loads((project.root / "reports/eval_summary.json").read_text())
    assert summary["promotion"]["promoted"] is True and summary["model_version"] == "1"

    project.set_params(train={"epochs": 2})
    project.dvc("repro")
    commit_all(project, "two epochs")

    diff = json.loads(project.dvc("metrics", "diff", "HEAD~1", "HEAD", "--all", "--json").stdout)
    assert diff["metrics/train.json"]["epochs_completed"] == {"old": 1, "new": 2, "diff": 1}
    assert set(diff["metrics/eval.json"]) >= {"accuracy", "macro_f1", "top_k_accuracy"}

    rendered = project.root.parent / "dvc_plots"  # outside the repo: the queue stashes it
    plots = json.loads(
        project.dvc("plots", "diff", "HEAD~1", "HEAD", "--json", "-o", str(rendered)).stdout
    )["data"]
    loss = plots["loss"][0]["content"]["data"]["values"]
    epochs_by_rev: dict[str, set[int]] = {}
    for row in loss:
        epochs_by_rev.setdefault(row["rev"], set()).add(int(row["epoch"]))
    assert sorted(epochs_by_rev.values(), key=len) == [{1}, {1, 2}]
    confusion = plots["confusion"][0]["content"]["data"]["values"]
    test_records = json.loads((project.root / "data/shards/manifest.json").read_text())["splits"][
        "test"
    ]["num_records"]
    assert len([row for row in confusion if row["rev"] == "HEAD"]) == test_records
    recall = {
        row["class"]: row["recall"]
        for row in plots["recall"][0]["content"]["data"]["values"]
        if row["rev"] == "HEAD"
    }
    per_class = json.loads((project.root / "plots/eval/per_class.json").read_text())
    assert {row["class"]: row["recall"] for row in per_class} == recall  # HEAD's, one per class
    assert "plots/eval/confusion_matrix.png" in plots
    project.dvc("plots", "show", "-o", str(rendered))
    assert (rendered / "index.html").stat().st_size > 0

    # One experiment run in the workspace and one queued (run in a copy), with different
    # params: each is listed with its params, its numeric metrics and the MLflow run that
    # tracked it.
    project.dvc("exp", "run", "-n", "lr-high", "-S", "train.learning_rate=0.01")
    project.dvc("exp", "run", "--queue", "-n", "one-epoch", "-S", "train.epochs=1")
    project.dvc("queue", "start", "--jobs", "1")
    try:
        project.dvc("queue", "logs", "--follow", "one-epoch")  # returns when it has run
    finally:
        project.dvc("queue", "stop", check=False)
    rows = exp_rows(project)
    assert {"lr-high", "one-epoch"} <= set(rows), rows.keys()
    assert rows["lr-high"]["params"]["params.yaml"]["train"]["learning_rate"] == 0.01
    assert rows["lr-high"]["params"]["params.yaml"]["train"]["epochs"] == 2
    assert rows["one-epoch"]["params"]["params.yaml"]["train"]["epochs"] == 1
    assert rows["one-epoch"]["metrics"]["metrics/train.json"]["epochs_completed"] == 1

    from mlflow import MlflowClient

    store = f"sqlite:///{project.root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store)
    run_ids = set()
    for name in ("lr-high", "one-epoch"):
        row = rows[name]
        assert isinstance(row["metrics"]["metrics/eval.json"]["accuracy"], float)
        run_id = row["params"]["models/run.json"]["run_id"]
        run = client.get_run(run_id)  # in the repository's store, the queued run too
        assert run.data.tags["dvc.experiment"] == name
        assert run.data.params["train.learning_rate"] == str(
            row["params"]["params.yaml"]["train"]["learning_rate"]
        )
        assert run.data.metrics["test_accuracy"] == pytest.approx(
            row["metrics"]["metrics/eval.json"]["accuracy"], abs=1e-9
        )
        run_ids.add(run_id)
    assert len(run_ids) == 2
    # Experiments never move production: the champion is a main-line version, and an
    # experiment's version holds `challenger`, its decision saying so.
    assert client.get_model_version_by_alias("shardflow", "champion").run_id not in run_ids
    challenger = client.get_model_version_by_alias("shardflow", "challenger")
    assert challenger.run_id in run_ids
    assert challenger.tags["promotion.experiment"] in {"lr-high", "one-epoch"}
    assert challenger.tags["promotion.promoted"] == "false"
    assert not list((project.root / ".dvc" / "tmp").rglob("mlflow.db"))
    # The workspace is untouched by the experiments' params.
    assert yaml.safe_load((project.root / "params.yaml").read_text())["train"]["epochs"] == 2
