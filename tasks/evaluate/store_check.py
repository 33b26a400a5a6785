"""Whether the tracking store still holds what the project's reports name.

`dvc repro` decides from files alone: with ``mlflow.db`` lost or replaced (or
``MLFLOW_TRACKING_URI`` pointed at another store), train and evaluate are "unchanged", the
run ends with a champion read from stale reports, and serving fails later with MLflow's own
error. `make run` checks, after `dvc repro` skipped evaluation, that the store holds the
training run ``models/run.json`` names and the evaluation run and registered version
``reports/eval_summary.json`` names, and refuses naming what is missing and the one command
that rebuilds it: training and evaluation only, the shards as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.runtime.refusals import Refused

if TYPE_CHECKING:
    from mlflow import MlflowClient

# Forced, and only these two stages (`-f` alone forces every stage upstream as well).
REBUILD = "dvc repro --single-item --force train evaluate"
TRAIN_RUN = Path("models") / "run.json"
EVAL_SUMMARY = Path("reports") / "eval_summary.json"


class StoreLostRuns(Refused):
    """The tracking store does not hold the runs or the version the reports name."""


@dataclass(frozen=True)
class Recorded:
    """What the reports say the store holds (empty strings: not recorded)."""

    train_run: str
    eval_run: str
    model_name: str
    version: str


def read_report(path: Path) -> dict[str, Any]:
    """A JSON report's object, or empty when it is missing or not one (nothing recorded)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def recorded(root: Path) -> Recorded:
    run = read_report(root / TRAIN_RUN)
    summary = read_report(root / EVAL_SUMMARY)
    promotion = summary.get("promotion") or {}
    return Recorded(
        train_run=str(run.get("run_id") or ""),
        eval_run=str(summary.get("eval_run_id") or ""),
        model_name=str(promotion.get("model_name") or ""),
        version=str(summary.get("model_version") or ""),
    )


def _has_run(client: MlflowClient, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return False
    return True


def _version_run(client: MlflowClient, name: str, version: str) -> str | None:
    """The run a registered version was made from, or None where the store lacks it."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version(name, version).run_id)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return None


def missing(client: MlflowClient, record: Recorded) -> list[str]:
    """What of ``record`` the store behind ``client`` does not hold, one line each."""
    lost = []
    if record.train_run and not _has_run(client, record.train_run):
        lost.append(f"{TRAIN_RUN}: training run {record.train_run}")
    if record.eval_run and not _has_run(client, record.eval_run):
        lost.append(f"{EVAL_SUMMARY}: evaluation run {record.eval_run}")
    if record.model_name and record.version:
        made_from = _version_run(client, record.model_name, record.version)
        if made_from != record.train_run:  # gone, or another run's in a replaced store
            lost.append(
                f"{EVAL_SUMMARY}: version {record.version} of {record.model_name!r} made "
                f"from run {record.train_run}"
            )
    return lost


def check_store(root: Path) -> None:
    """Refuse (:class:`StoreLostRuns`) when the store lost what the reports under ``root``
    name; nothing recorded yet passes. A missing SQLite file is not created to find out."""
    from tasks.runtime import tracking

    record = recorded(root)
    if not record.train_run:
        return
    uri = tracking.tracking_uri(root)
    shown = tracking.redact(uri)
    database = uri.removeprefix(tracking.SQLITE) if uri.startswith(tracking.SQLITE) else None
    if database is not None and not Path(database).exists():
        lost = [f"the tracking store {shown}: no such file"]
    else:
        lost = missing(tracking.client(root), record)
    if lost:
        raise StoreLostRuns(
            f"the tracking store ({shown}) does not hold what the project's reports name, "
            "though `dvc repro` found train and evaluate unchanged:\n  " + "\n  ".join(lost),
            fix=f"`{REBUILD}` (trains and evaluates again into this store; shards kept)",
        )
