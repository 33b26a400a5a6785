"""What cuts a stage process's latency, in one place, and the switch that turns each piece off.

- ``prestart``: a stage's ``main()`` starts the child its task runs in (:func:`prestart_child`)
  or the workers its shards are written in (:func:`prestart_pool`) before it checks the
  server, takes the lock and starts its flow, so the child's imports (TensorFlow, Keras,
  MLflow: seconds) overlap that start-up; the task takes the child
  (:func:`start_where_warm`), the pool :func:`tasks.runtime.processes.spawn_pool`.
- ``fast_exit``: a stage process (:func:`exit_now`) and a one-job child (:func:`end_child`)
  end without the interpreter's teardown, which with TensorFlow loaded takes seconds.

The third piece kept, ingest's decodes handed to the shard stage, is a contract between the
two stages (:mod:`tasks.contracts.handoff`), switched by ``ingest.handoff_mb``.

``SHARDFLOW_LATENCY_OFF`` (comma-separated names of :data:`PIECES`) turns pieces off in this
process and every process it starts (a stage's children, the stages ``dvc repro`` runs):
``python -m bench`` sets it to time each piece with and without (docs/performance.md,
"Orchestration tax, and what a stage process pays"). Unset, every piece is on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NoReturn, TypeVar

from tasks.runtime import processes

T = TypeVar("T")

OFF_ENV = "SHARDFLOW_LATENCY_OFF"
PIECES = ("prestart", "fast_exit")


def enabled(piece: str) -> bool:
    """Whether ``piece`` (one of :data:`PIECES`) is on: not named in ``SHARDFLOW_LATENCY_OFF``."""
    if piece not in PIECES:
        raise ValueError(f"{piece!r} is not a latency piece; choose from {list(PIECES)}")
    return piece not in {name.strip() for name in os.environ.get(OFF_ENV, "").split(",")}


# -- prestart ------------------------------------------------------------------------------

PoolKey = tuple[int, Callable[[], object] | None]
# Pools a stage's main() started (see prestart_pool), by (workers, warm): the next
# spawn_pool of the same shape takes one.
_prestarted: dict[PoolKey, ProcessPoolExecutor] = {}
# Children a stage's main() started, by warm-up function (see prestart_child); each
# handed out once.
_standing_by: dict[Callable[[], object], processes.StandbyChild] = {}


def prestart_pool(workers: int, *, warm: Callable[[], object] | None = None) -> None:
    """Start :func:`tasks.runtime.processes.spawn_pool`'s workers now, for the stage's first
    ``spawn_pool(workers, warm=warm)`` to take: they spawn, import and warm up while the
    stage starts its flow. A pool nobody takes must be dismissed (:func:`dismiss_prestarted`)."""
    key = (max(1, workers), warm)
    if key not in _prestarted and enabled("prestart"):
        _prestarted[key] = processes.start_pool(*key)


def take_pool(workers: int, warm: Callable[[], object] | None) -> ProcessPoolExecutor | None:
    """The pool :func:`prestart_pool` started for ``(workers, warm)``, once; else None."""
    return _prestarted.pop((max(1, workers), warm), None)


def dismiss_prestarted() -> None:
    """Shut down every prestarted pool no stage took (its idle workers end)."""
    while _prestarted:
        _prestarted.popitem()[1].shutdown(wait=True, cancel_futures=True)


def prestart_child(warm: Callable[[], object]) -> None:
    """Start a :class:`~tasks.runtime.processes.StandbyChild` warming up with ``warm`` now,
    for the stage's task to take with :func:`start_where_warm` (or :func:`standby_child`).
    It takes this process's environment as it is now: the offline settings first."""
    if warm not in _standing_by and enabled("prestart"):
        _standing_by[warm] = processes.StandbyChild(warm)


def standby_child(warm: Callable[[], object]) -> processes.StandbyChild | None:
    """The child :func:`prestart_child` started with ``warm``, once (None when there is
    none, or it was taken)."""
    return _standing_by.pop(warm, None)


def start_where_warm(
    warm: Callable[[], object],
    fn: Callable[..., T],
    *args: object,
    report: Callable[..., object] | None = None,
) -> Any:
    """``fn(*args)`` started now in the child :func:`prestart_child` started with ``warm``,
    for this process to go on meanwhile; its value from ``.result()``, which hands each
    message it reports (a tuple) to ``report(*message)``. Without such a child (a
    deployment run's process, a retry, or it is gone), ``fn(*args, report)`` runs here when
    ``.result()`` asks for it (:class:`tasks.runtime.processes.Later`)."""
    child = standby_child(warm)
    if child is not None:
        try:
            job = child.run(fn, *args)
        except OSError:  # the prestarted child is gone
            child.close()
        else:
            if report is not None:
                job.on_report = lambda message: report(*message)
            return job
    return processes.Later(fn, *args, report) if report is not None else processes.Later(fn, *args)


# -- fast exit -----------------------------------------------------------------------------


def exit_now(code: int) -> NoReturn:
    """End a stage process with exit status ``code`` once its work is done.

    What a normal exit does that matters still happens, in the interpreter's order:
    threading's exit hooks tell idle thread pools to stop (MLflow's artifact repositories
    keep one for the process's life), non-daemon threads finish, the exit handlers run
    (Prefect's log and event workers drain, logging flushes, MLflow ends its run) and the
    standard streams flush. What is skipped is the interpreter's teardown, freeing every
    module and TensorFlow's static destructors (docs/performance.md has the saving).
    """
    if not enabled("fast_exit"):
        sys.exit(code)  # a normal exit, the interpreter's teardown included
    import atexit
    import threading

    # What the interpreter's exit calls first (Py_FinalizeEx -> threading._shutdown): the
    # hooks of threading._register_atexit, then a join of every non-daemon thread. Joining
    # them without the hooks waited forever on a pool's idle workers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def end_child() -> None:
    """End a one-job child at once, with multiprocessing's own exit work done first.

    ``os._exit`` skips the interpreter's shutdown (TensorFlow's and MLflow's exit handlers
    only cost time here, and the parent waits for the child to end), and with it the
    finalizers that unregister the child's semaphores; a job that made one (tqdm's lock for
    MLflow's download bars) left the stage ending on resource_tracker's "leaked semaphore
    objects" warning. Off, the child returns to multiprocessing's normal exit.
    """
    if not enabled("fast_exit"):
        return
    from multiprocessing import util

    try:
        util._exit_function()  # type: ignore[attr-defined]  # a normal exit runs it: finalizers
    finally:
        os._exit(0)


# The pieces in the process primitives, which never import this module: a prestarted pool
# for spawn_pool, the fast exit for each child started from now on.
processes.take_prestarted = take_pool
processes.end_of_child = end_child
