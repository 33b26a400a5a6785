"""A stage whose training stopped on SIGTERM ends as a preempted process: it starts one."""

from __future__ import annotations

from pathlib import Path

from tests.unit.flows.test_stage_exit import run


def test_training_stopped_by_sigterm_exits_143_in_a_line(tmp_path: Path) -> None:
    """Training that saved its state on SIGTERM ends the stage with the status of a
    process SIGTERM ended (143), so a platform sees a preemption, not a crash."""
    done = run(tmp_path, "preempt")
    assert done.returncode == 143
    assert "Traceback" not in done.stderr
    assert "stopped by SIGTERM at epoch 2, step 3, its state saved" in done.stderr
    assert (tmp_path / "out.atexit").read_text() == "ran"
