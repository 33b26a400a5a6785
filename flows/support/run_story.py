"""What makes a run readable in the Prefect UI: its name, its pipeline and stage tags, its log,
the settings a stage's flows run under, and a progress artifact.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.runtime.code_version import code_version as code_version  # task versions, re-exported

# Set it (any short id) to group the flow runs of several commands under one pipeline tag;
# unset, a pipeline is everything run under one workspace lock (`make run` holds one
# across the whole `dvc repro`, and its stages inherit the lock's token).
PIPELINE_ENV = "SHARDFLOW_PIPELINE_ID"


def pipeline_id() -> str | None:
    """The id every stage process of one pipeline execution shares (see ``PIPELINE_ENV``)."""
    from tasks.runtime.workspace_lock import LOCK_ENV

    token = os.environ.get(LOCK_ENV)
    return os.environ.get(PIPELINE_ENV) or (token[:8] if token else None)


def run_tags(stage: str) -> list[str]:
    """``stage:<stage>``, ``pipeline:<id>`` and, under `dvc exp run`, ``dvc-exp:<name>``:
    filter the Prefect UI by one to see every flow run of that pipeline execution."""
    tags = [f"stage:{stage}"]
    if pipeline := pipeline_id():
        tags.append(f"pipeline:{pipeline}")
    if experiment := os.environ.get("DVC_EXP_NAME"):
        tags.append(f"dvc-exp:{experiment}")
    return tags


@contextmanager
def untagged_task_runs() -> Iterator[None]:
    """Task runs started inside carry no tags; the flow runs keep theirs (:func:`run_tags`).

    Prefect asks its server for tag concurrency slots before every tagged task run. On the
    SQLite store that request often fails (SQLITE_BUSY, answered 503) and the client
    retries it seconds later: time added to a stage at random. Untagged task runs
    make no such request; a flow run's tags still group its stage and pipeline in the UI.
    """
    from prefect.context import TagsContext

    with TagsContext(current_tags=set()):
        yield


@contextmanager
def stage_settings() -> Iterator[None]:
    """Prefect settings for a stage's flows (the benchmarks run theirs under it too).

    No flow-run heartbeats: their thread sleeps in one-second steps, so every flow's end
    waits up to a second for it (half a second a flow on average, measured in every stage).
    A stage process that dies is caught without them: it leaves its lock, and DVC reruns
    the stage. Deployment runs (`make serve`) keep them.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


# Prefect's runtime override of ``prefect.runtime.deployment.id``.
RUNTIME_DEPLOYMENT_ENV = "PREFECT__RUNTIME__DEPLOYMENT__ID"


def in_deployment_run() -> bool:
    """Whether this code runs in a run a Prefect deployment started: then its parameters
    come from whoever started the run, and are confined to the repository.

    A top-level flow run (every `dvc repro` stage's) knows its deployment: Prefect's
    ``runtime.deployment.id`` asks the server again whenever there is none (a round trip a
    call, several a stage). A nested flow run asks ``runtime.deployment``, which knows its
    ancestors' deployment from the context, and so does any run where
    ``PREFECT__RUNTIME__DEPLOYMENT__ID`` stands in for a deployment (Prefect's runtime
    override, which the tests use)."""
    from prefect.context import FlowRunContext
    from prefect.runtime import deployment

    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    if (
        run is not None
        and run.parent_task_run_id is None
        and RUNTIME_DEPLOYMENT_ENV not in os.environ
    ):
        return run.deployment_id is not None
    return deployment.id is not None


def run_params_path(root: str, params_path: str) -> Path:
    """The params file a flow reads: for a deployment run, only one inside the repository.

    Deployments are served from the repository root (the working directory); direct calls
    (DVC stages, tests) name their own project root.
    """
    # here: entry points import this module first
    from tasks.runtime.run_overrides import resolve_inside

    if not in_deployment_run():
        return Path(root) / params_path
    return resolve_inside(root, params_path, Path.cwd())


def flow_run_tags() -> dict[str, str]:
    """The Prefect flow run this code runs in, as MLflow tags ("none" outside a flow)."""
    from prefect.runtime import flow_run

    run_id = str(flow_run.id) if flow_run.id else None
    url = str(flow_run.ui_url) if run_id and flow_run.ui_url else None
    return {"prefect.flow_run_id": run_id or "none", "prefect.flow_run_url": url or "none"}


@contextmanager
def run_log(logger_name: str = "tasks") -> Iterator[None]:
    """Inside, what the plain-Python ``tasks`` loggers say also goes to this Prefect run's
    log (the UI), as :func:`prefect.get_run_logger` records would; they still propagate."""

    from prefect.logging.handlers import APILogHandler

    logger, handler = logging.getLogger(logger_name), APILogHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def run_name(stage: str, *details: object) -> str:
    """``shard · 405c04ba · 3000 images``: the stage, then what it ran on."""
    return " · ".join([stage, *(str(d) for d in details if d not in (None, ""))])


def run_parameter(name: str, default: Any) -> Any:
    """A parameter of the current flow run (for ``flow_run_name`` callables)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return (context.parameters or {}).get(name, default) if context else default


def naming(stage: str, details: Callable[[], Sequence[object]]) -> Callable[[], str]:
    """A ``flow_run_name`` callable: the stage plus ``details()``, or the stage alone when
    those cannot be read yet (a first run has no manifest): naming never fails a run."""

    def name() -> str:
        try:
            return run_name(stage, *details())
        except Exception:  # missing or unreadable inputs: the stage reports them itself
            return stage

    return name


def rename_flow_run(name: str) -> None:
    """Rename the current flow run once the figures that name it exist (a shard set's
    fingerprint is known only after its shards are written)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_name(context.flow_run.id, name)


class Progress:
    """A progress artifact in the flow run's UI, moved from 0 to 100 as work completes.

    An update is sent when the figure has moved by ``step`` percent and ``interval_s`` has
    passed since the last one, and always on reaching 100: a long stage makes at most ~100
    API calls whatever its size, and a short one a few. Each update is a round trip to the
    server that the work waits for, so a short stage must not send one per item.
    """

    def __init__(
        self, key: str, description: str, *, step: float = 1.0, interval_s: float = 1.0
    ) -> None:
        from prefect.artifacts import create_progress_artifact

        self.step = step
        self.interval_s = interval_s
        self.shown = 0.0
        # Called from sync code, Prefect's dispatch returns the id, not a coroutine.
        self.artifact_id: Any = create_progress_artifact(0.0, key=key, description=description)
        self.sent_at = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        from prefect.artifacts import update_progress_artifact

        percent = 100.0 if total <= 0 else min(100.0, 100.0 * done / total)
        due = time.monotonic() - self.sent_at >= self.interval_s
        if (due and percent - self.shown >= self.step) or (percent >= 100.0 > self.shown):
            update_progress_artifact(self.artifact_id, percent)
            self.shown = percent
            self.sent_at = time.monotonic()
