"""How a flow knows whether a deployment started its run
(:func:`flows.support.run_story.in_deployment_run`), which confines its paths to the repository."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from flows.support.run_story import in_deployment_run


@pytest.fixture
def server_asks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The flow runs Prefect's ``runtime.deployment`` reads from the server, recorded."""
    import prefect.runtime.deployment as runtime_deployment

    asked: list[Any] = []
    read = runtime_deployment._get_flow_run

    async def recorded(run_id: Any) -> Any:
        asked.append(run_id)
        return await read(run_id)

    monkeypatch.setattr(runtime_deployment, "_get_flow_run", recorded)
    return asked


def test_a_stage_flow_run_knows_it_is_not_deployed_without_asking_the_server(
    prefect_harness: None, server_asks: list[Any]
) -> None:
    """Every `dvc repro` stage is a top-level flow run: Prefect's runtime asked the server for
    its flow run again on each call (about 40 ms); the run's own record says it."""
    from prefect import flow

    @flow
    def stage() -> list[bool]:
        return [in_deployment_run() for _ in range(3)]

    @flow
    def pipeline() -> list[bool]:
        return stage()

    assert stage() == [False, False, False]
    assert server_asks == []
    assert pipeline() == [False, False, False]  # nested: the runtime looks further up


def test_prefects_runtime_override_still_stands_in_for_a_deployment(
    prefect_harness: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PREFECT__RUNTIME__DEPLOYMENT__ID`` (how the deployment tests make a run deployed)."""
    from prefect import flow

    from flows.support.run_story import RUNTIME_DEPLOYMENT_ENV

    @flow
    def stage() -> bool:
        return in_deployment_run()

    monkeypatch.setenv(RUNTIME_DEPLOYMENT_ENV, "a-deployment")
    assert stage() is True


def test_a_deployed_top_level_run_is_a_deployment_run(
    monkeypatch: pytest.MonkeyPatch, server_asks: list[Any]
) -> None:
    from prefect.client.schemas.objects import FlowRun
    from prefect.context import FlowRunContext

    run = FlowRun(flow_id=uuid.uuid4(), deployment_id=uuid.uuid4())
    context = SimpleNamespace(flow_run=run)
    monkeypatch.setattr(FlowRunContext, "get", classmethod(lambda cls: context))
    assert in_deployment_run() is True
    assert server_asks == []
