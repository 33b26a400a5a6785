"""The latency seam: each piece on unless the bench's switch names it, and what each does
when off (no process is started here); one cost model decides when a stage's spawned
workers pay (ingest and shard alike)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from tasks.runtime import latency
from tasks.runtime.latency import (
    break_even_s,
    check_seconds,
    shard_seconds,
    worth_handing_off,
    worth_workers,
)
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


def test_break_even_is_the_start_up_the_workers_win_back() -> None:
    """``start + W/n == W`` at the break-even: the workers pay from there on."""
    for workers in (2, 3, 8):
        w = break_even_s(workers)
        assert w == pytest.approx(latency.WORKER_START_S + w / workers)
    assert break_even_s(1) == math.inf and break_even_s(0) == math.inf


def test_worth_workers_from_the_break_even_on() -> None:
    need = break_even_s(2)
    assert worth_workers([need / 2, need / 2], 2)
    assert not worth_workers([need / 2, need / 2 * 0.99], 2)
    assert not worth_workers([1e9], 1)  # one worker never pays
    assert not worth_workers([], 2)


def test_summing_stops_at_the_break_even() -> None:
    """A first run over a million files estimates only until the answer is known."""
    seen: list[int] = []

    def estimates() -> Iterator[float]:
        for i in range(10**6):
            seen.append(i)
            yield break_even_s(2) / 4

    assert worth_workers(estimates(), 2)
    assert len(seen) == 4


def test_estimates_grow_with_the_work() -> None:
    # a file costs its bytes plus what every file costs, whatever its size
    assert check_seconds(3 * 2**20) - check_seconds(2 * 2**20) == pytest.approx(
        check_seconds(2 * 2**20) - check_seconds(2**20)
    )
    assert check_seconds(0) > 0
    assert shard_seconds(4000, 3000) > shard_seconds(128, 96) > shard_seconds(1, 1) > 0
    # a record resized from ingest's kept 1/8 decode decodes nothing
    assert shard_seconds(4000, 3000, handed_off=True) < shard_seconds(4000, 3000) / 10


def test_a_decode_is_handed_off_where_it_saves_more_than_its_entry_costs() -> None:
    """Camera photos (2 and 12 MP, their 1/8 decodes as entries) are kept, thumbnails are
    not; a larger entry for the same pixels needs more saving."""
    assert worth_handing_off(4000 * 3000, 500 * 375 * 3)
    assert worth_handing_off(1600 * 1200, 200 * 150 * 3)
    assert not worth_handing_off(300 * 200, 300 * 200 * 3)  # a PNG, kept whole
    assert not worth_handing_off(120 * 90, 120 * 90 * 3)
    pixels = 1000 * 750
    assert worth_handing_off(pixels, 1000)
    assert not worth_handing_off(pixels, 2**20)


def test_many_small_files_are_worth_workers() -> None:
    """10,000 thumbnails of 4 KB: their bytes alone (40 MB) estimate less than the
    break-even, yet checking them takes one core seconds (measured: 4.3 s, 3.4 s on two
    workers), most of it per file."""
    assert worth_workers((check_seconds(4000) for _ in range(10_000)), 2)
    assert not worth_workers((check_seconds(4000) for _ in range(100)), 2)
