"""Plain-Python stage code logs with :mod:`logging`; a flow shows those lines in its run."""

from __future__ import annotations

import logging
from typing import Any


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
