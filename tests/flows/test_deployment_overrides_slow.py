"""Deployed flows run on a Prefect server refuse a root outside the repository and a runner
override before writing (the overrides themselves:
tests/unit/flows/test_deployment_overrides.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tasks.runtime.params import shipped_params_text
from tests.unit.flows import test_deployment_overrides as unit

pytestmark = pytest.mark.slow
repo_copy = unit.repo_copy  # the unit tests' fixture, shared


@pytest.mark.parametrize("flow_name", ["pipeline", "data", "training"])
def test_deployed_flows_refuse_a_root_outside_the_repository(
    prefect_harness: None,
    repo_copy: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flow_name: str,
) -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.data import data_flow
    from flows.pipeline import pipeline
    from flows.training import training_flow

    flows = {"pipeline": pipeline, "data": data_flow, "training": training_flow}
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "params.yaml").write_text(shipped_params_text())
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "a-deployment")
    # Refused with the run's parameters (flows.support.parameters.RepoPath), before the flow body.
    with pytest.raises(ParameterTypeError, match=re.escape(f"root='{outside}' resolves to")):
        flows[flow_name](root=str(outside))
    assert sorted(os.listdir(outside)) == ["params.yaml"]  # nothing written there


def test_pipeline_run_refuses_runner_override_before_writing(
    prefect_harness: None, repo_copy: Path
) -> None:
    from flows.pipeline import pipeline

    before = (repo_copy / "params.yaml").read_bytes()
    with pytest.raises(Exception, match=r"shard\.runner cannot be overridden"):
        pipeline(overrides={"shard": {"runner": "dask", "dask_address": "tcp://x:8786"}})
    assert (repo_copy / "params.yaml").read_bytes() == before
    # No stage ran: nothing but params.yaml (and Prefect's own home, .prefect) in the project.
    assert [name for name in os.listdir(repo_copy) if name != ".prefect"] == ["params.yaml"]
