"""What cuts a stage process's latency, in one place, and the switch that turns each piece off.

- ``prestart``: a stage's ``main()`` starts the child its task runs in (:func:`prestart_child`)
  or the workers its shards are written in (:func:`prestart_pool`) before it checks the
  server, takes the lock and starts its flow, so the child's imports (TensorFlow, Keras,
  MLflow: seconds) overlap that start-up; the task takes the child
  (:func:`start_where_warm`), the pool :func:`tasks.runtime.processes.spawn_pool`.
- ``fast_exit``: a stage process (:func:`exit_now`) and a one-job child (:func:`end_child`)
  end without the interpreter's teardown, which with TensorFlow loaded takes seconds.
- ``worker_cost``: ingest and shard spawn worker processes only for work past one measured
  break-even (:func:`worth_workers`); the same figures decide whether ingest keeps a decode
  for the shard stage (:func:`worth_handing_off`, :mod:`tasks.contracts.handoff`).

``SHARDFLOW_LATENCY_OFF`` (comma-separated names of :data:`PIECES`) turns pieces off in this
process and every process it starts (a stage's children, the stages ``dvc repro`` runs):
``python -m bench`` sets it to time each piece with and without (docs/performance.md,
"Orchestration tax, and what a stage process pays"). Unset, every piece is on.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NoReturn, TypeVar

from tasks.runtime import processes

T = TypeVar("T")

OFF_ENV = "SHARDFLOW_LATENCY_OFF"
PIECES = ("prestart", "fast_exit", "worker_cost")


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


# -- worker cost ---------------------------------------------------------------------------
#
# When spawned worker processes pay: one cost model for every stage that spawns them.
#
# Work estimated at ``W`` seconds of one core takes about ``W`` in the stage's own process, and
# ``start + W / n`` on ``n`` workers that first spawn, import and warm up in ``start`` seconds;
# the workers pay from ``W >= start * n / (n - 1)`` (:func:`break_even_s`). ``start`` is
# :data:`WORKER_START_S`, measured by the bench (section ``worker_start``, which records it
# and the break-even as ``workers.start_s`` and ``workers.break_even_s``). Each stage estimates
# ``W`` from what it knows before decoding anything: ingest from file sizes
# (:func:`check_seconds`), shard from its records' pixels (:func:`shard_seconds`). The same
# figures decide whether ingest keeps a decode for the shard stage (:func:`worth_handing_off`).

# Seconds for a pool of spawned workers to start, import their stage's modules and warm up
# (the slower of the ingest and shard pools), as `python -m bench --only worker_start`
# measures it on an idle machine: while other processes hold the cores it is longer, but the
# work itself slows alike, so the break-even holds.
WORKER_START_S = 0.4
# Unit costs of the work itself on one core, from the bench's stage figures (the measurements
# behind each are in docs/performance.md, "When workers pay"):
CHECK_SECONDS_PER_BYTE = 11e-3 / 2**20  # ingest checks a JPEG at 1/8 scale: the bytes decoded
# ... plus a fixed cost per file whatever its size (stat, open, read, hash, header, perceptual
# hash), which is what sends many small files to the workers when their bytes alone would not.
CHECK_SECONDS_PER_FILE = 0.35e-3
SHARD_SECONDS_PER_RECORD = 1e-3  # shard: per record (read, hash, encode, frame)
SHARD_SECONDS_PER_PIXEL = 2.5e-9  # shard: per source pixel decoded and resized
# A record whose decode ingest handed off (tasks.contracts.handoff) is made by ingest, which
# resizes its 1/8-scale decode (1/64 of the pixels); the shard stage decodes and resizes none
# of it, and only encodes and frames the kept pixels.
HANDED_OFF_PIXEL_FRACTION = 1 / 64
# A hand-off entry is a file of its own: ingest checksums, writes and renames it; the shard
# stage reads, checks and removes it. The bench's `handoff.entry_ms` measures that cost net of
# the decodes the entries save; the figure held here sits above it, so a small image is
# decoded twice rather than handed off at a loss. Plus its pixels, written and read back.
HANDOFF_ENTRY_S = 1.0e-3
HANDOFF_SECONDS_PER_BYTE = 3.5e-3 / 2**20


def break_even_s(workers: int) -> float:
    """Estimated work (seconds of one core) from which ``workers`` spawned workers pay."""
    if workers < 2:
        return math.inf  # one worker only adds its start-up to the same serial work
    return WORKER_START_S * workers / (workers - 1)


def worth_workers(seconds: Iterable[float], workers: int) -> bool:
    """Whether work estimated as the sum of ``seconds`` reaches :func:`break_even_s`.

    Summing stops there, so a first run over a million files estimates only its first few
    thousand.
    """
    if not enabled("worker_cost"):
        return workers >= 2  # no cost model: workers whenever more than one is asked for
    need = break_even_s(workers)
    total = 0.0
    for estimate in seconds:
        total += estimate
        if total >= need:
            return True
    return False


def check_seconds(file_bytes: int) -> float:
    """Ingest's estimate for checking one file of ``file_bytes``."""
    return CHECK_SECONDS_PER_FILE + CHECK_SECONDS_PER_BYTE * file_bytes


def shard_seconds(width: int, height: int, *, handed_off: bool = False) -> float:
    """Shard's estimate for writing the record of one ``width`` x ``height`` source image
    (``handed_off``: from the pixels ingest kept, with no decode or resize)."""
    pixels = 0 if handed_off else width * height
    return SHARD_SECONDS_PER_RECORD + SHARD_SECONDS_PER_PIXEL * pixels


def worth_handing_off(pixels: int, entry_bytes: int) -> bool:
    """Whether ingest keeping its decode of an image of ``pixels`` source pixels, in an entry
    of ``entry_bytes``, costs less than the decode it saves the shard stage
    (:mod:`tasks.contracts.handoff`).

    The data side's saving is :func:`shard_seconds`' decode less the resize ingest does
    instead; the entry's cost is a file written, read back and removed. Photos (a few MP) save
    more than their entry costs and are kept; small images save less and are decoded again
    (the break-even size is the bench's ``handoff.break_even_mp``).
    """
    saved = SHARD_SECONDS_PER_PIXEL * pixels * (1 - HANDED_OFF_PIXEL_FRACTION)
    return saved > HANDOFF_ENTRY_S + HANDOFF_SECONDS_PER_BYTE * entry_bytes
