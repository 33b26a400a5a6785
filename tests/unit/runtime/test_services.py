"""The processes a clone records for `shardflow stop`: only a recorded process still running
under its recorded start time is stopped (no process is started or signalled here)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from tasks.runtime import services


def test_a_stat_line_is_read_from_the_end_of_its_command_name() -> None:
    rest = " ".join(["S", "1", "4242", *["0"] * 16, "987654", "0"])
    fields = services.stat_fields(f"4243 (a) (b) name) {rest}")
    assert (fields.state, fields.group, fields.start_ticks) == ("S", 4242, 987654)


def test_stop_ends_only_recorded_processes_still_running_and_forgets_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended: list[int] = []
    monkeypatch.setattr(services, "end_group", lambda pid, grace_s: ended.append(pid))
    monkeypatch.delenv("DVC_ROOT", raising=False)
    me = os.getpid()
    services.record_started(me, "ui", ["python", "-m", "mlflow", "ui"], tmp_path)
    [record] = services.recorded(tmp_path)
    assert record.start_ticks == services.start_ticks(me) and services.is_running(record)

    stopped = services.stop_started(tmp_path)
    assert [p.pid for p in stopped] == ended == [me]
    assert services.recorded(tmp_path) == []

    # the same pid, started at another time: a later process given a reused pid
    reused = services.StartedProcess(me, record.start_ticks + 1, "ui", record.command)
    (services.started_dir(tmp_path) / f"{me}.json").write_text(json.dumps(asdict(reused)))
    ended.clear()
    assert services.stop_started(tmp_path) == [] and ended == []
    assert services.recorded(tmp_path) == []
