"""Plain-Python stage code logs with :mod:`logging`; a flow shows those lines in its run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest


def test_tasks_log_lines_reach_the_flow_run_log_only_inside_run_log(
    prefect_harness: None,
) -> None:
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.common import flow_run_tags, run_log
    from tests.prefect_story import log_lines

    @flow(name="run-log-check")
    def check() -> tuple[Any, dict[str, str]]:
        with run_log():
            logging.getLogger("tasks.train").warning("backup discarded: shown in the run")
        logging.getLogger("tasks.train").warning("said outside run_log")
        return flow_run.id, flow_run_tags()

    run_id, tags = check()
    lines = log_lines(run_id)
    assert "backup discarded: shown in the run" in lines
    assert "said outside run_log" not in lines
    assert tags["prefect.flow_run_id"] == str(run_id)
    assert str(run_id) in tags["prefect.flow_run_url"] or tags["prefect.flow_run_url"] == "none"
    assert flow_run_tags() == {"prefect.flow_run_id": "none", "prefect.flow_run_url": "none"}


def test_the_shard_stage_and_the_data_flow_run_capped_workers_and_say_so(
    prefect_harness: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shard.workers` past this process's cores is capped wherever the stage runs (the
    data flow of the deployments passed the file's count straight on), and the run's own
    log says so, not only the terminal."""
    import shutil

    from prefect import flow
    from prefect.runtime import flow_run

    import flows.shard
    from flows.data import data_flow
    from tasks.params import REPO_PARAMS_PATH, apply_overrides, default_params
    from tests.prefect_story import log_lines

    monkeypatch.setattr("tasks.processes.usable_cores", lambda: 2, raising=False)
    said = "shard.workers is 64 but this process may use 2 cores: running 2 workers"

    @flow(name="capped-workers-check")
    def check() -> tuple[Any, int]:
        params = flows.shard.stage_params(default_params(shard={"workers": 64}).shard)
        return flow_run.id, params.workers

    run_id, workers = check()
    assert workers == 2 and said in log_lines(run_id)

    ran: list[int] = []
    monkeypatch.setattr(flows.shard, "run", lambda params, layout: ran.append(params.workers))
    shutil.copy(REPO_PARAMS_PATH, tmp_path / "params.yaml")
    apply_overrides(tmp_path / "params.yaml", {"shard": {"workers": 64}})
    data_flow(root=str(tmp_path), stages=["shard"])
    assert ran == [2]
