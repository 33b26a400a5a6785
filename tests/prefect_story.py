"""Read what the Prefect UI shows of a run through its API: flow runs by tag, their logs,
their artifacts. Shared by the flow tests that check a run tells its own story."""

from __future__ import annotations

from typing import Any


def flow_runs_tagged(tag: str) -> dict[str, Any]:
    """Flow runs carrying ``tag``, by flow name (one run per flow expected)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]))
        )
        by_flow: dict[str, Any] = {}
        for run in runs:
            name = client.read_flow(run.flow_id).name
            assert name not in by_flow, f"two {name!r} flow runs tagged {tag!r}"
            by_flow[name] = run
    return by_flow


def log_lines(flow_run_id: Any) -> list[str]:
    """Every log line of the flow run (its tasks' included), once the log worker drained."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs reach the API in batches from a background worker
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
    return [log.message for log in logs]


def artifacts(flow_run_id: Any) -> dict[str, Any]:
    """The flow run's artifacts (its tasks' included), by key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {artifact.key: artifact for artifact in found if artifact.key}


def task_run_tags(flow_run_id: Any) -> list[list[str]]:
    """The tags of each task run of the flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return [list(run.tags) for run in runs]
