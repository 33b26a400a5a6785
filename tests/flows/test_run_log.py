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

    from flows.support.run_story import flow_run_tags, run_log
    from tests.prefect_story import log_lines

    @flow(name="run-log-check")
    def check() -> tuple[Any, dict[str, str]]:
        with run_log():
            logging.getLogger("tasks.train.stage").warning("backup discarded: shown in the run")
        logging.getLogger("tasks.train.stage").warning("said outside run_log")
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

    from prefect import flow
    from prefect.runtime import flow_run

    import flows.shard
    from flows.data import data_flow
    from tasks.runtime.params import default_params, shipped_params_text
    from tasks.runtime.run_overrides import apply_overrides
    from tests.prefect_story import log_lines

    monkeypatch.setattr("tasks.runtime.processes.usable_cores", lambda: 2, raising=False)
    said = "shard.workers is 64 but this process may use 2 cores: running 2 workers"

    @flow(name="capped-workers-check")
    def check() -> tuple[Any, int]:
        params = flows.shard.stage_params(default_params(shard={"workers": 64}).shard)
        return flow_run.id, params.workers

    run_id, workers = check()
    assert workers == 2 and said in log_lines(run_id)

    ran: list[int] = []
    monkeypatch.setattr(flows.shard, "run", lambda params, layout: ran.append(params.workers))
    (tmp_path / "params.yaml").write_text(shipped_params_text())
    apply_overrides(tmp_path / "params.yaml", {"shard": {"workers": 64}})
    data_flow(root=str(tmp_path), stages=["shard"])
    assert ran == [2]


def test_a_refusal_in_a_flow_run_is_its_block_in_the_runs_log_and_whole_in_its_state(
    prefect_harness: None, tmp_path: Path
) -> None:
    """A deployment's data flow on a missing source folder logged three tracebacks (task,
    flow, engine) into the run's log and `prefect deployment run --watch`; the log now has
    the refusal's block (what, why, fix) and no traceback, the state message its full text."""

    from flows.data import data_flow
    from tasks.runtime.params import shipped_params_text
    from tasks.runtime.run_overrides import apply_overrides
    from tests.prefect_story import log_lines

    (tmp_path / "params.yaml").write_text(shipped_params_text())
    apply_overrides(tmp_path / "params.yaml", {"ingest": {"source_dir": "data/missing"}})
    state = data_flow(root=str(tmp_path), stages=["ingest"], return_state=True)
    assert state.is_failed()
    assert "SourceNotFound: data/missing: source folder not found" in (state.message or "")
    text = "\n".join(log_lines(state.state_details.flow_run_id))
    assert "Traceback" not in text
    blocks = [line for line in text.splitlines() if line.startswith("Refused: ")]
    assert blocks and all(line.endswith("(SourceNotFound)") for line in blocks), text
    assert "  fix: set ingest.source_dir in params.yaml" in text
    assert "Finished in state Failed: refused (the block above says why)" in text
