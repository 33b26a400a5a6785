"""Spawned worker processes for the CPU work of a stage, started before they are needed.

TensorFlow and ``fork`` do not mix, so workers are spawned: each starts a fresh interpreter
and imports what it runs. :func:`spawn_pool` starts every worker at once (a
``ProcessPoolExecutor`` otherwise spawns one per submit, when the first work arrives), so
that start-up overlaps with what the parent does next, planning, instead of delaying the
first result. Workers import only the TensorFlow-free, Prefect-free modules of the function
they run; the stage's orchestration stays in the parent.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While children start, hide the parent's ``__main__`` from ``spawn``.

    A spawned child first imports the parent's main module so that functions defined there
    can be unpickled: for ``python -m flows.shard`` that is the flow module, and Prefect with
    it (seconds and a hundred MB a worker). The work sent to these children lives in
    importable modules (``tasks.*``), so they skip it: the main module's spec and file are
    hidden for the moment a child is created. Work defined in ``__main__`` cannot be sent.
    """
    main = sys.modules["__main__"].__dict__
    saved: dict[str, object] = {n: main[n] for n in ("__spec__", "__file__") if n in main}
    main["__spec__"] = None
    main.pop("__file__", None)
    try:
        yield
    finally:
        main.pop("__spec__", None)
        main.update(saved)


def _started() -> None:
    """The no-op each worker runs first: its submission makes the pool spawn the worker."""


def _worker_start(parent: int, warm: Callable[[], object] | None) -> None:
    end_with_parent(parent)  # no shard is written for a stage that was killed
    if warm is not None:
        warm()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or `taskset`'s
    share), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def capped_workers(requested: int, key: str, *, say: bool = True) -> int:
    """``requested`` worker processes, at most one per usable core, and (``say``) a warning
    naming the param ``key`` when that caps it. More would only take turns on the same cores,
    each holding its own memory; what the workers compute never depends on how many there
    are, so one params.yaml serves a laptop and a large machine alike."""
    cores = usable_cores()
    if requested <= cores or not say:
        return min(requested, cores)
    log.warning(
        "%s is %d but this process may use %d cores: running %d workers",
        key,
        requested,
        cores,
        cores,
    )
    return cores


def start_pool(workers: int, warm: Callable[[], object] | None) -> ProcessPoolExecutor:
    """A pool of ``workers`` spawned processes, each starting now and running ``warm`` first."""
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_start,
        initargs=(os.getpid(), warm),
    )
    with _main_module_hidden():  # each submit here spawns one worker
        for _ in range(workers):
            pool.submit(_started)
    return pool


# Set by tasks.runtime.latency as it is imported (it imports this module, never the reverse):
# where spawn_pool takes a prestarted pool from, and what a one-job child calls as it ends,
# handed to each child as it starts (a reference the child imports).
PoolSource = Callable[[int, Callable[[], object] | None], ProcessPoolExecutor | None]
take_prestarted: PoolSource = lambda workers, warm: None  # noqa: E731  # none until latency sets it
end_of_child: Callable[[], None] | None = None


@contextmanager
def spawn_pool(
    workers: int, *, warm: Callable[[], object] | None = None
) -> Iterator[ProcessPoolExecutor]:
    """``workers`` spawned processes, all starting now; each runs ``warm`` once first.

    ``warm`` pays a worker's one-off cost (imports, a version probe) before any real work.
    A pool of this shape started by :func:`tasks.runtime.latency.prestart_pool` is taken
    instead of a new one.
    On leaving, the pool waits for work already running; on an error, work not yet started
    is cancelled first.
    """
    pool = take_prestarted(workers, warm) or start_pool(max(1, workers), warm)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


class ChildResult(Generic[T]):
    """The result of :func:`run_in_child`, collected with :meth:`result`."""

    def __init__(self, process: BaseProcess, connection: Connection) -> None:
        self._process = process
        self._connection = connection
        self.on_report: Callable[[Any], object] | None = None  # result()'s default

    def result(
        self, timeout: float | None = None, on_report: Callable[[Any], object] | None = None
    ) -> T:
        """Wait for the child's value (or its exception); the child is gone afterwards.

        ``on_report`` (default: the attribute) gets each message the job sends with
        :func:`report` while it runs (an epoch's figures, say), in order, from when the
        result is asked for (the pipe keeps those sent before); an error there is logged,
        and the job goes on.
        """
        on_report = on_report or self.on_report
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._connection.poll(left):
                    self._process.kill()  # the parent gives up: so does the child
                    raise TimeoutError(f"no result from the child process within {timeout} s")
                kind, value = self._connection.recv()
                if kind != "report":
                    break
                if on_report is not None:
                    try:
                        on_report(value)
                    except Exception:  # a report is news, not work: the job goes on
                        log.exception("handling a report from the child process failed")
        except EOFError:
            self._process.join(5)
            raise RuntimeError(
                "the child process died before sending a result (exit code "
                f"{self._process.exitcode})"
            ) from None
        finally:
            self._connection.close()
            self._process.join(5)  # it ends right after sending
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]

    def cancel(self) -> None:
        """Stop the job if it still runs: its result is no longer wanted, and it must not
        go on writing files its caller may write again (a retry)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._connection.close()


class Later(Generic[T]):
    """``fn(*args)`` run here when its result is asked for: :class:`ChildResult`'s stand-in
    where there is no child to run it."""

    def __init__(self, fn: Callable[..., T], *args: object) -> None:
        self._fn = fn
        self._args = args

    def result(self) -> T:
        return self._fn(*self._args)

    def cancel(self) -> None:
        """Nothing runs until :meth:`result` is asked for."""


def run_in_child(fn: Callable[..., T], *args: object) -> ChildResult[T]:
    """Start ``fn(*args)`` in a spawned process now; collect it with ``.result()``.

    For one-off work that needs a heavy import (TensorFlow) beside TensorFlow-free work in
    the parent. The child sends its value and ends at once: a pool worker instead exits
    through the interpreter's teardown, which with TensorFlow loaded takes long enough for the
    parent's own exit to wait on it.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main, args=(sender, fn, args, os.getpid(), end_of_child), daemon=True
    )
    with _main_module_hidden():
        process.start()
    sender.close()
    return ChildResult(process, receiver)


def end_with_parent(parent: int, *, every_s: float = 0.2) -> None:
    """In a child: end it as soon as its parent ``parent`` is gone.

    A stage killed outright (SIGKILL, an OOM kill) runs no cleanup: without this its child
    would go on evaluating, registering and writing reports for a run nobody waits for,
    outside the workspace lock its dead parent held.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def _child_main(
    connection: Connection,
    fn: Callable[..., object],
    args: tuple[object, ...],
    parent: int,
    end: Callable[[], None] | None,
) -> None:
    end_with_parent(parent)
    try:
        _send_result(connection, fn, args)
    finally:
        if end is not None:
            end()


# In a child, while its job runs: where :func:`report` sends.
_reports_to: Connection | None = None


def reporting() -> bool:
    """Whether this is a job running in a child, which :func:`report` reaches the parent from."""
    return _reports_to is not None


def report(message: object) -> None:
    """Send ``message`` (picklable) from a job running in a child to its parent, whose
    :meth:`ChildResult.result` hands it to ``on_report`` at once."""
    if _reports_to is None:
        raise RuntimeError("report() is for a job running in a child (run_in_child, StandbyChild)")
    _reports_to.send(("report", message))


def _send_result(
    connection: Connection, fn: Callable[..., object], args: tuple[object, ...]
) -> None:
    global _reports_to
    _reports_to = connection
    try:
        message: tuple[str, object] = ("ok", fn(*args))
    except Exception as exc:  # sent to the parent, which raises it
        # A pickled exception loses its traceback: where it came from travels as a note.
        exc.add_note(f"in the child process {os.getpid()}:\n{traceback.format_exc()}")
        message = ("error", exc)
    _reports_to = None
    try:
        connection.send(message)
    except Exception as exc:  # an unpicklable value or exception: say what it was
        connection.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    connection.close()
    sys.stdout.flush()
    sys.stderr.flush()


class StandbyChild:
    """A spawned process that runs ``warm()`` now and then one job, sent later with
    :meth:`run`: :func:`run_in_child` for work whose arguments are not known yet, with the
    heavy import already under way.

    A stage's ``main()`` starts one first (:func:`tasks.runtime.latency.prestart_child`:
    validation's TensorFlow cross-check, whose import then overlaps the stage's start-up). A
    child that gets no job ends when the parent does: its end of the pipe closes.
    """

    def __init__(self, warm: Callable[[], object]) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(
            target=_standby_main, args=(child_end, warm, os.getpid(), end_of_child), daemon=True
        )
        with _main_module_hidden():
            self._process.start()
        child_end.close()
        self._used = False

    def run(self, fn: Callable[..., T], *args: object) -> ChildResult[T]:
        """Send ``fn(*args)`` to the child (once); collect it with ``.result()``."""
        if self._used:
            raise RuntimeError("a standby child runs one job; start another")
        self._used = True
        self._connection.send((fn, args))
        return ChildResult(self._process, self._connection)

    def close(self) -> None:
        """Dismiss a child that will get no job (it ends at once, or after its warm-up)."""
        self._used = True
        self._connection.close()
        self._process.join(0)


def _standby_main(
    connection: Connection,
    warm: Callable[[], object],
    parent: int,
    end: Callable[[], None] | None,
) -> None:
    end_with_parent(parent)
    try:
        try:
            warm()
            failed: Exception | None = None
        except Exception as exc:  # reported on the job, which would fail the same way
            failed = exc
        try:
            fn, args = connection.recv()
        except (EOFError, OSError):  # dismissed, or the parent is gone: no job
            return
        if failed is not None:
            problem = f"the child's warm-up failed: {type(failed).__name__}: {failed}"
            connection.send(("error", RuntimeError(problem)))
            return
        _send_result(connection, fn, args)
    finally:
        if end is not None:
            end()
