"""What the train and evaluate stages share: when a task may retry, and the Prefect link
to the MLflow run both of them write to."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.runtime.layout import Layout
from tasks.runtime.refusals import Refused

# What a rerun as it is fails alike: every refusal (unvalidated shards stay unvalidated, a
# param the run cannot use stays unusable, a missing champion stays missing) until the user
# does what it names.
REFUSALS: tuple[type[BaseException], ...] = (Refused,)


def retry_unless(*refusals: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A task's ``retry_condition_fn``: retry I/O failures, never one of ``refusals``."""

    def retry(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except refusals:
            return False
        except Exception:
            return True
        return True

    return retry


retry_unless_refused = retry_unless(*REFUSALS)


def recorded_run_name(layout: Layout) -> str:
    """The MLflow run name training recorded in ``models/run.json`` (what evaluate reads)."""
    return str(json.loads(Path(layout.train_run).read_text())["run_name"])


def link_mlflow_run(run_url: str, run_name: str, what: str) -> str:
    """A link artifact (``mlflow-run``) to the run's page in the MLflow UI; returns the URL.

    ``run_url`` is :func:`tasks.runtime.tracking.run_url`'s: for a local store it appends which
    store `make ui` must serve, kept as a note.
    """
    from prefect.artifacts import create_link_artifact

    url, _, note = run_url.partition(" ")
    create_link_artifact(
        link=url,
        link_text=f"MLflow run {run_name}",
        key="mlflow-run",
        description=f"{what} {note}".strip(),
    )
    return url
