"""How long a stage's spawned workers take to be ready: the constant of tasks.worker_cost.

A pool of ``workers`` spawned processes is started the way each stage starts its own (the
shard pool warms up with :func:`tasks.shard.warm_worker`; an ingest worker imports
:mod:`tasks.ingest` when its first job arrives), and timed until every worker has run a job.
The slower stage's median is the start-up :data:`tasks.worker_cost.WORKER_START_S` should
hold; the break-even follows from it (:func:`tasks.worker_cost.break_even_s`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from bench.stats import median


def _ready() -> tuple[int, float]:
    """A probe job: which worker ran it, and when (wall clock, comparable across processes)."""
    now = time.time()
    time.sleep(0.01)  # long enough that one worker cannot drain the queue alone
    return os.getpid(), now


def import_ingest() -> None:
    """An ingest worker's start-up: its stage module, imported by its first job."""
    import tasks.ingest  # noqa: F401


def time_pool_start(workers: int, warm: Callable[[], object]) -> float:
    """Seconds from starting a pool to the moment its last worker ran its first job."""
    from tasks.processes import spawn_pool

    start = time.time()
    first: dict[int, float] = {}
    with spawn_pool(workers, warm=warm) as pool:
        while len(first) < workers:
            for future in [pool.submit(_ready) for _ in range(2 * workers)]:
                pid, at = future.result()
                first[pid] = min(at, first.get(pid, at))
    return max(first.values()) - start


def measure_worker_start(workers: int = 2, passes: int = 3) -> dict[str, Any]:
    """Median pool start-up per stage, the slower one, and its break-even for ``workers``."""
    from tasks.shard import warm_worker
    from tasks.worker_cost import WORKER_START_S, break_even_s

    kinds: dict[str, Callable[[], object]] = {"shard": warm_worker, "ingest": import_ingest}
    runs = {
        name: [time_pool_start(workers, warm) for _ in range(passes)]
        for name, warm in kinds.items()
    }
    start_s = max(median(times) for times in runs.values())
    return {
        "start_s": round(start_s, 3),
        "break_even_s": round(start_s * workers / (workers - 1), 3),
        "details": {
            "workers": workers,
            "passes_s": {k: [round(t, 3) for t in v] for k, v in runs.items()},
            "constant_start_s": WORKER_START_S,
            "constant_break_even_s": break_even_s(workers),
        },
    }
