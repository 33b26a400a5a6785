"""What the train and evaluate stages share: when a task may retry, and the Prefect link
to the MLflow run both of them write to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks import tracking
from tasks.gate import ShardsNotValidated
from tasks.layout import Layout


def retry_unless_refused(task: Any, task_run: Any, state: Any) -> bool:
    """Retry I/O failures, never a refusal: unvalidated shards stay unvalidated."""
    try:
        state.result()
    except ShardsNotValidated:
        return False
    except Exception:
        return True
    return True


def recorded_run_name(layout: Layout) -> str:
    """The MLflow run name training recorded in ``models/run.json`` (what evaluate reads)."""
    return str(json.loads(Path(layout.train_run).read_text())["run_name"])


def link_mlflow_run(layout: Layout, run_id: str, run_name: str, what: str) -> str:
    """A link artifact (``mlflow-run``) to the run's page in the MLflow UI; returns the URL."""
    from prefect.artifacts import create_link_artifact

    # run_url appends, for a local store, which store `make ui` must serve: keep it as a note.
    url, _, note = tracking.run_url(tracking.client(layout.root), run_id).partition(" ")
    create_link_artifact(
        link=url,
        link_text=f"MLflow run {run_name}",
        key="mlflow-run",
        description=f"{what} {note}".strip(),
    )
    return url
