"""Spawned worker processes for the CPU work of a stage, started before they are needed.

TensorFlow and ``fork`` do not mix, so workers are spawned: each starts a fresh interpreter
and imports what it runs. :func:`spawn_pool` starts every worker at once (a
``ProcessPoolExecutor`` otherwise spawns one per submit, when the first work arrives), so
that start-up overlaps with what the parent does next, planning, instead of delaying the
first result. Workers import only the TensorFlow-free, Prefect-free modules of the function
they run; the stage's orchestration stays in the parent.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


def _started() -> None:
    """The no-op each worker runs first: its submission makes the pool spawn the worker."""


@contextmanager
def spawn_pool(
    workers: int, *, warm: Callable[[], object] | None = None
) -> Iterator[ProcessPoolExecutor]:
    """``workers`` spawned processes, all starting now; each runs ``warm`` once first.

    ``warm`` pays a worker's one-off cost (imports, a version probe) before any real work.
    On leaving, the pool waits for work already running; on an error, work not yet started
    is cancelled first.
    """
    pool = ProcessPoolExecutor(
        max_workers=max(1, workers),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=warm,
    )
    for _ in range(max(1, workers)):
        pool.submit(_started)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
