"""How every flow entry point starts: offline settings, code-derived task versions, standby
children, the stage's arguments, and its exit (a refusal as its block and exit status 2). The
workspace lock and DVC's bookkeeping are ``flows.dvc_steps``, refusals in the logs
``flows.refusal_logs``, and what the Prefect UI shows of a run ``flows.run_story``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from flows.refusal_logs import refusals_as_blocks
from flows.run_story import run_tags, stage_settings
from tasks.runtime.code_version import code_version as code_version  # task versions, re-exported
from tasks.runtime.refusals import refusing

T = TypeVar("T")


OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",  # C++ errors too: "failed call to cuInit" on a CPU-only machine
    # MLflow prints "View run at <tracking URI>/..." as a run ends on a server, credentials
    # in the URI included; the flows log their own link, redacted (tasks.runtime.tracking.redact).
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    # `mlflow server` and `mlflow ui` otherwise start a job runner and seven huey consumer
    # processes for MLflow's GenAI jobs, which Shardflow never submits (they poll, taking CPU
    # every minute they run), and leave their queue's folder in /dev/shm behind.
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    # Nothing on the terminal a user cannot act on: MLflow's download bars (a champion's
    # files, fetched to re-score it) and its INFO lines (system metrics started and
    # stopped, a model registered: the run and the flow log say what happened).
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    # MLflow's app imports a Starlette module Starlette means to drop, and Starlette warns
    # (a UserWarning, shown by default) in every process that serves or loads it.
    "PYTHONWARNINGS": "ignore:starlette.middleware.wsgi is deprecated:UserWarning",
}


def configure_environment(env: MutableMapping[str, str] = os.environ) -> None:
    """Analytics off, quiet TensorFlow, no unredacted MLflow links, Keras's and Matplotlib's
    files in the repository (:func:`tasks.runtime.layout.keep_library_files_in`), in ``env`` (this
    process's, or a command's); called by entry points before anything imports those
    libraries, never at import."""
    from tasks.runtime.layout import keep_library_files_in

    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    keep_library_files_in(env)


def prestart_stage_child(warm: Callable[[], object]) -> None:
    """What a stage's ``python -m`` entry point does first when its task runs in a child:
    the offline settings, then the child, warming up with ``warm`` while the stage goes on
    to import Prefect (:func:`tasks.runtime.processes.prestart_child`). In that order: the child
    takes
    the environment as it is at spawn."""
    from tasks.runtime.processes import prestart_child

    configure_environment()
    prestart_child(warm)


def _started_in_child(warm: Callable[[], object], fn: Callable[..., T], args: tuple) -> Any:
    """``fn(*args)`` started in the child the stage's entry point prestarted with ``warm``:
    its :class:`~tasks.runtime.processes.ChildResult`, or None when there is no such child (a
    deployment run's process, a retry) or it is gone."""
    from tasks.runtime.processes import standby_child

    child = standby_child(warm)
    if child is not None:
        try:
            return child.run(fn, *args)
        except OSError:  # the prestarted child is gone
            child.close()
    return None


def run_where_warm(
    warm: Callable[[], object],
    fn: Callable[..., T],
    *args: object,
    report: Callable[..., object] | None = None,
) -> T:
    """``fn(*args)`` in the child the stage's entry point prestarted with ``warm`` (its
    imports done or under way), each message it reports (a tuple) handed to ``report(*message)``;
    else ``fn(*args, report)`` here: a deployment run's process, or a retry."""
    return start_where_warm(warm, fn, *args, report=report).result()  # type: ignore[no-any-return]


def start_where_warm(
    warm: Callable[[], object],
    fn: Callable[..., T],
    *args: object,
    report: Callable[..., object] | None = None,
) -> Any:
    """``fn(*args)`` started now in the child the stage's entry point prestarted with
    ``warm``, for this process to go on meanwhile; its value from ``.result()``, which hands
    each message it reports (a tuple) to ``report(*message)``. Without such a child,
    ``fn(*args, report)`` runs here when ``.result()`` asks for it
    (:class:`tasks.runtime.processes.Later`)."""
    from tasks.runtime.processes import Later

    job = _started_in_child(warm, fn, args)
    if job is None:
        return Later(fn, *args, report) if report is not None else Later(fn, *args)
    if report is not None:
        job.on_report = lambda message: report(*message)
    return job


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """A stage's ``python -m`` entry point: run ``main``, then end the process at once.

    On success, what a normal exit does that matters still happens, in the interpreter's
    order: threading's exit hooks tell idle thread pools to stop (MLflow's artifact
    repositories keep one for the process's life), non-daemon threads finish, the exit
    handlers run (Prefect's log and event workers drain, logging flushes, MLflow ends its
    run) and the standard streams flush. What is skipped is the interpreter's teardown,
    freeing every module and TensorFlow's static destructors: seconds per stage process
    after its flow has finished (docs/performance.md), paid by every stage `dvc repro` runs.
    A refusal (:class:`tasks.runtime.refusals.Refused`) is printed as one short block (exit
    status 2); any other exception propagates as usual (traceback, status 1).
    """
    import atexit
    import threading

    def body() -> int:
        main()
        return 0

    refusals_as_blocks(show_first=False)
    code = refusing(body, entry_name(main))
    from tasks.runtime.latency import enabled

    if not enabled("fast_exit"):
        sys.exit(code)  # a normal exit, the interpreter's teardown included
    # What the interpreter's exit calls first (Py_FinalizeEx -> threading._shutdown): the
    # hooks of threading._register_atexit, then a join of every non-daemon thread. Joining
    # them without the hooks waited forever on a pool's idle workers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def entry_name(main: Callable[[], object]) -> str:
    """``python -m flows.validate`` for a stage module's ``main``."""
    return f"python -m {main.__module__}" if main.__module__ != "__main__" else sys.argv[0]


def parse_stage_args(choices: tuple[str, ...], prog: str) -> tuple[list[str], str]:
    """Parse ``python -m flows.X [STAGE ...] [--params FILE]``; no stage means all of them."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=f"Run stages of the {prog} flow.")
    parser.add_argument("stages", nargs="*", metavar="STAGE", help=f"any of {', '.join(choices)}")
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    args = parser.parse_args(sys.argv[1:])
    unknown = [s for s in args.stages if s not in choices]
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; choose from {list(choices)}")
    return list(args.stages or choices), args.params


def stage_main(
    name: str, choices: tuple[str, ...], run: Callable[[list[str], str], object]
) -> None:
    """What ``python -m flows.<name> [STAGE ...] [--params FILE]`` does: offline settings,
    the Prefect server (started when none answers), the arguments, then ``run(stages,
    params_path)`` under :func:`stage_run`."""
    from flows.server import require_server

    configure_environment()
    require_server()
    stages, params_path = parse_stage_args(choices, f"flows.{name}")
    with stage_run(name, params_path):  # one writer at a time, tagged with its pipeline
        run(stages, params_path)


@contextmanager
def stage_run(stage: str, params_path: str) -> Iterator[None]:
    """What a stage's ``main()`` runs its flow in: the workspace lock (one writer at a
    time), then the run's tags (taken inside the lock, so the pipeline id is the holder's),
    under :func:`stage_settings`."""
    from prefect import tags

    from flows.dvc_steps import hold_workspace  # it imports this module's offline settings

    with hold_workspace(Path("."), Path(params_path)), tags(*run_tags(stage)), stage_settings():
        yield
