"""The shard flow's window of batches in flight (:func:`tasks.shard.window.run_in_window`),
driven by a fake runner whose batches finish in the order a test chooses."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import pytest

from tasks.shard.window import run_in_window


@dataclass
class Batch:
    """A submitted batch: its specs, and the results it gives (each spec doubled)."""

    specs: list[int]

    def results(self) -> list[int]:
        if any(spec < 0 for spec in self.specs):
            raise ValueError(f"batch {self.specs} failed")
        return [2 * spec for spec in self.specs]


@dataclass
class FakeRunner:
    """Records what is submitted, read and in flight; ``pick`` chooses which pending batch
    finishes first (the oldest unless told)."""

    pick: Callable[[list[Batch]], Batch] = lambda pending: pending[0]
    submitted: list[list[int]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    read: int = 0
    abandoned: list[list[int]] = field(default_factory=list)

    def specs(self, count: int) -> Iterator[int]:
        for spec in range(count):
            self.read += 1
            yield spec

    def submit(self, specs: list[int]) -> Batch:
        self.submitted.append(list(specs))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return Batch(specs)

    def first_done(self, pending: list[Batch]) -> Batch:
        return self.pick(pending)

    def collect(self, batch: Batch) -> list[int]:
        self.in_flight -= 1
        return batch.results()

    def on_failure(self, pending: list[Batch]) -> None:
        self.abandoned = [batch.specs for batch in pending]


def run(
    runner: FakeRunner, specs: object, *, batch_size: int, window: int
) -> Generator[int, None, None]:
    return run_in_window(
        specs,  # type: ignore[arg-type]
        batch_size=batch_size,
        window=window,
        submit=runner.submit,
        first_done=runner.first_done,
        collect=runner.collect,
        on_failure=runner.on_failure,
    )


def test_batches_of_the_size_asked_and_the_remainder_last() -> None:
    runner = FakeRunner()
    results = list(run(runner, runner.specs(7), batch_size=3, window=2))
    assert runner.submitted == [[0, 1, 2], [3, 4, 5], [6]]
    assert results == [0, 2, 4, 6, 8, 10, 12]


@pytest.mark.parametrize("window", [1, 2, 4])
def test_never_more_batches_in_flight_than_the_window(window: int) -> None:
    runner = FakeRunner()
    assert len(list(run(runner, runner.specs(20), batch_size=2, window=window))) == 20
    assert runner.most_in_flight == window


def test_specs_are_read_only_as_their_batch_is_submitted() -> None:
    runner = FakeRunner()
    results = run(runner, runner.specs(100), batch_size=2, window=2)
    assert next(results) == 0
    # two batches in flight, the first collected: the plan read as far as the window needs
    assert runner.read == 4
    assert runner.submitted == [[0, 1], [2, 3]]


def test_results_come_batch_by_batch_in_the_order_batches_finish() -> None:
    runner = FakeRunner(pick=lambda pending: pending[-1])  # the newest batch finishes first
    results = list(run(runner, runner.specs(6), batch_size=2, window=2))
    # [0,1] and [2,3] in flight: [2,3] finishes; then [0,1] and [4,5]: [4,5]; then [0,1]
    assert results == [4, 6, 8, 10, 0, 2]


def test_no_specs_submit_nothing() -> None:
    runner = FakeRunner()
    assert list(run(runner, iter([]), batch_size=3, window=2)) == []
    assert runner.submitted == []


def test_a_failed_batch_hands_the_batches_still_in_flight_over_then_raises() -> None:
    runner = FakeRunner()
    specs = [0, 1, -2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="failed"):
        list(run(runner, iter(specs), batch_size=2, window=3))
    # [0,1] collected, the remainder [6] submitted, then [-2,3] failed: two still in flight
    assert runner.abandoned == [[4, 5], [6]]


def test_a_consumer_that_stops_early_hands_the_batches_in_flight_over() -> None:
    runner = FakeRunner()
    results = run(runner, runner.specs(10), batch_size=2, window=3)
    assert next(results) == 0
    results.close()
    assert runner.abandoned == [[2, 3], [4, 5]]
