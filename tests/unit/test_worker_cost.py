"""One cost model decides when a stage's spawned workers pay (ingest and shard alike)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from tasks import worker_cost
from tasks.worker_cost import break_even_s, check_seconds, shard_seconds, worth_workers


def test_break_even_is_the_start_up_the_workers_win_back() -> None:
    """``start + W/n == W`` at the break-even: the workers pay from there on."""
    for workers in (2, 3, 8):
        w = break_even_s(workers)
        assert w == pytest.approx(worker_cost.WORKER_START_S + w / workers)
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
    assert check_seconds(2 * 2**20) == pytest.approx(2 * check_seconds(2**20))
    assert shard_seconds(4000, 3000) > shard_seconds(128, 96) > shard_seconds(1, 1) > 0
    # a record resized from ingest's kept 1/8 decode decodes nothing
    assert shard_seconds(4000, 3000, handed_off=True) < shard_seconds(4000, 3000) / 10
