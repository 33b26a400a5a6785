"""Batches of shards kept in flight a window at a time: how the shard flow feeds its task
runner without holding the whole plan.

Plain callables stand for the runner (``submit`` a batch, wait for the ``first_done``,
``collect`` a finished batch's results), so the windowing is the same whichever runner the
flow uses, and is tested without one.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import TypeVar

Spec = TypeVar("Spec")
Future = TypeVar("Future")
Result = TypeVar("Result")


def run_in_window(
    specs: Iterable[Spec],
    *,
    batch_size: int,
    window: int,
    submit: Callable[[list[Spec]], Future],
    first_done: Callable[[list[Future]], Future],
    collect: Callable[[Future], list[Result]],
    on_failure: Callable[[list[Future]], object] | None = None,
) -> Generator[Result, None, None]:
    """Each batch's results, batch by batch as they finish.

    ``specs`` are read (a plan's records materialised) only as their batch is submitted, in
    batches of ``batch_size`` (the last one smaller), and at most ``window`` batches are in
    flight: the parent's memory stays flat however many specs the plan holds. When the
    window is full, the first batch to finish (``first_done``, among those pending) is
    collected before another is submitted. On any failure, a consumer closing the iterator
    included, ``on_failure`` gets the batches still in flight (to wait for them, say), then
    the failure propagates.
    """
    pending: list[Future] = []

    def finished() -> list[Result]:
        future = first_done(pending)
        pending.remove(future)
        return collect(future)

    batch: list[Spec] = []
    try:
        for spec in specs:
            batch.append(spec)
            if len(batch) == batch_size:
                pending.append(submit(batch))
                batch = []
            while len(pending) >= window:
                yield from finished()
        if batch:
            pending.append(submit(batch))
        while pending:
            yield from finished()
    except BaseException:
        if on_failure is not None:
            on_failure(pending)
        raise
