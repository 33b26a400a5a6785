"""The process environment every Shardflow process and the commands it starts run with:
analytics and telemetry off, quiet TensorFlow and MLflow, library files kept in the repository.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",  # C++ errors too: "failed call to cuInit" on a CPU-only machine
    # MLflow prints "View run at <tracking URI>/..." as a run ends on a server, credentials
    # in the URI included; the flows log their own link, redacted (tasks.runtime.tracking.redact).
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    # `mlflow server` and `mlflow ui` otherwise start a job runner and seven huey consumer
    # processes for MLflow's GenAI jobs, which Shardflow never submits (they poll, taking CPU
    # every minute they run), and leave their queue's folder in /dev/shm behind.
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    # Nothing on the terminal a user cannot act on: MLflow's download bars (a champion's
    # files, fetched to re-score it) and its INFO lines (system metrics started and
    # stopped, a model registered: the run and the flow log say what happened).
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    # MLflow's app imports a Starlette module Starlette means to drop, and Starlette warns
    # (a UserWarning, shown by default) in every process that serves or loads it.
    "PYTHONWARNINGS": "ignore:starlette.middleware.wsgi is deprecated:UserWarning",
}


def configure_environment(env: MutableMapping[str, str] = os.environ) -> None:
    """Analytics off, quiet TensorFlow, no unredacted MLflow links, Keras's and Matplotlib's
    files in the repository (:func:`tasks.runtime.layout.keep_library_files_in`), in ``env`` (this
    process's, or a command's); called by entry points before anything imports those
    libraries, never at import."""
    from tasks.runtime.layout import keep_library_files_in

    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    keep_library_files_in(env)
