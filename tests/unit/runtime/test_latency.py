"""The latency seam: each piece on unless the bench's switch names it, and what each does
when off (no process is started here)."""

from __future__ import annotations

import pytest

from tasks.runtime import latency
from tasks.runtime.processes import Later


def _never_called() -> None:
    raise AssertionError("a warm-up ran")


def test_every_piece_is_on_unless_the_switch_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(latency.OFF_ENV, raising=False)
    assert all(latency.enabled(piece) for piece in latency.PIECES)
    monkeypatch.setenv(latency.OFF_ENV, "fast_exit, prestart")
    assert not latency.enabled("prestart") and not latency.enabled("fast_exit")
    with pytest.raises(ValueError, match="not a latency piece"):
        latency.enabled("prestrat")


def test_without_prestart_no_child_or_pool_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(latency.OFF_ENV, "prestart")
    latency.prestart_child(_never_called)
    latency.prestart_pool(2, warm=_never_called)
    assert latency.standby_child(_never_called) is None
    assert latency.take_pool(2, _never_called) is None


def test_with_no_child_standing_by_the_job_runs_here_when_asked() -> None:
    told: list[tuple[int, str]] = []

    def job(x: int, report: object) -> int:
        assert callable(report)
        report(1, "half")
        return x * 2

    started = latency.start_where_warm(_never_called, job, 21, report=lambda *m: told.append(m))
    assert isinstance(started, Later) and told == []  # nothing ran yet
    assert started.result() == 42 and told == [(1, "half")]


def test_without_fast_exit_a_stage_exits_normally(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch gives the interpreter's own exit (SystemExit), teardown included."""
    monkeypatch.setenv(latency.OFF_ENV, "fast_exit")
    with pytest.raises(SystemExit) as exited:
        latency.exit_now(3)
    assert exited.value.code == 3
    latency.end_child()  # returns: the child's normal exit follows
