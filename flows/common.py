"""What every flow entry point shares: offline settings, code-derived task versions, the
workspace lock around every stage, and what makes a run readable in the Prefect UI (its
name, its pipeline and stage tags, a progress artifact)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from tasks.runtime.code_version import code_version as code_version  # task versions, re-exported
from tasks.runtime.refusals import find_refusal, refusal_block, refusing

T = TypeVar("T")

# Set it (any short id) to group the flow runs of several commands under one pipeline tag;
# unset, a pipeline is everything run under one workspace lock (`make run` holds one
# across the whole `dvc repro`, and its stages inherit the lock's token).
PIPELINE_ENV = "SHARDFLOW_PIPELINE_ID"

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
    # processes for MLflow's GenAI jobs, which Shardflow never submits (about 30 s of CPU a
    # minute between them, measured), and leave their queue's folder in /dev/shm behind.
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
    freeing every module and TensorFlow's static destructors: measured here at 1-3 s per
    stage process after its flow had finished (2.6 s for evaluate), paid by every stage
    `dvc repro` runs. A refusal (:class:`tasks.runtime.refusals.Refused`) is printed as one short
    block (exit status 2); any other exception propagates as usual (traceback, status 1).
    """
    import atexit
    import threading

    def body() -> int:
        main()
        return 0

    refusals_as_blocks(show_first=False)
    code = refusing(body, entry_name(main))
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


def refusal_key(refusal: BaseException) -> str:
    """How Prefect's state messages quote a refusal: ``<type>: <message>`` (cut: they are
    repr-escaped later)."""
    return f"{type(refusal).__name__}: {str(refusal)[:24]}"


def run_what(record: logging.LogRecord) -> str:
    """What a Prefect run logger's record is about: ``flow run 'data'``, ``task run 'x'``."""
    for kind in ("task", "flow"):
        if name := getattr(record, f"{kind}_run_name", None):
            return f"{kind} run {name!r}"
    return record.name


class RefusalsAsBlocks(logging.Filter):
    """A record that carries a refusal reads as its block
    (:func:`tasks.runtime.refusals.refusal_block`),
    without the traceback; a run's final-state line that quotes one names the refusal instead
    of repeating its full text, which stays in the run's state message and the report.

    On Prefect's run loggers it shapes what the run's log (the UI, `prefect deployment run
    --watch`) and the terminal both get; on a console handler, what other loggers say
    there. Anything else passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        refusal = find_refusal(record.exc_info[1] if record.exc_info else None)
        if refusal is not None:
            record.refusal_key = key = refusal_key(refusal)
            self.seen.append(key)
            record.msg, record.args = refusal_block(run_what(record), refusal), ()
            record.exc_info, record.exc_text = None, None
            record.refusal = "block"
        elif getattr(record, "refusal", None) is None:
            text = record.getMessage()
            if text.startswith("Finished in state") and any(s in text for s in self.seen):
                state = text.split("(", 1)[0]
                record.msg, record.args = f"{state}: refused (the block above says why)", ()
                record.refusal = "state"
        return True


class QuietRefusals(RefusalsAsBlocks):
    """On the terminal, a refusal is said once: the block of the first record that carries
    it (``show_first``: a deployment run's process, where no entry point prints it) or none
    (the entry point prints it, :func:`tasks.runtime.refusals.refusing`); its other records, its
    final-state lines and repeats of its text are dropped. The record Prefect sends to its
    server keeps its block. Anything else passes as it is."""

    def __init__(self, *, show_first: bool = False) -> None:
        super().__init__()
        self.show_first = show_first
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        super().filter(record)
        kind = getattr(record, "refusal", None)
        if kind == "block":
            self.seen.append(str(record.__dict__["refusal_key"]))  # set with "block"
            show, self.shown = self.show_first and not self.shown, True
            return show
        if kind is not None:
            return False
        text = record.getMessage()
        return not any(seen in text for seen in self.seen)


def refusals_as_blocks(*, show_first: bool) -> None:
    """Refusals read as one short block in the runs' logs (:class:`RefusalsAsBlocks` on
    Prefect's flow- and task-run loggers) and once on the terminal (:class:`QuietRefusals`
    on the root logger's console handlers; ``show_first`` where no entry point prints the
    block, as in a deployment run's process). Called again, it changes nothing."""
    loggers = [logging.getLogger(f"prefect.{kind}_runs") for kind in ("flow", "task")]
    present = [f for f in loggers[0].filters if isinstance(f, RefusalsAsBlocks)]
    shared = present[0] if present else RefusalsAsBlocks()  # one memory for both loggers
    for logger in loggers:
        if shared not in logger.filters:
            logger.addFilter(shared)
    for handler in logging.getLogger().handlers:
        console = isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.stderr,
            sys.stdout,
        )
        if console and not any(isinstance(f, QuietRefusals) for f in handler.filters):
            handler.addFilter(QuietRefusals(show_first=show_first))


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


def run_dvc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``dvc ARGS`` in ``root`` (this interpreter's, offline); its result, or a RuntimeError
    naming the command and its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE_ENV},
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"`dvc {' '.join(args)}` failed in {root}: {result.stderr.strip()}")
    return result


def stage_is_current(stage: str, root: Path) -> bool:
    """True when ``dvc.lock`` already matches the stage's deps, params and outs (by content)."""
    return json.loads(run_dvc(root, "status", "--json", stage).stdout or "{}") == {}


def record_stage(stage: str, root: Path) -> None:
    """Record what the stage just produced in ``dvc.lock`` (and the DVC cache)."""
    run_dvc(root, "commit", "--force", stage)


@contextmanager
def hold_workspace(root: Path, params_path: Path | None = None) -> Iterator[None]:
    """The workspace lock of ``root`` (see tasks.runtime.workspace_lock), waiting at most
    ``workspace.lock_timeout_s`` from the params file; reentrant under a holder."""
    from tasks.runtime.workspace_lock import lock_timeout_s, workspace_lock

    timeout_s = lock_timeout_s(params_path or root / "params.yaml")
    with workspace_lock(root, timeout_s=timeout_s):
        yield


def run_stage(
    stage: str,
    root: Path,
    run: Callable[[], T],
    *,
    dvc_bookkeeping: bool,
    params_path: Path | None = None,
) -> T | None:
    """Run one stage under the workspace lock; with DVC bookkeeping, skip it when up to
    date and record it after.

    Under `dvc repro` DVC does both itself, so the stage just runs. From a Prefect
    deployment the flow asks DVC whether the stage is current (content hashes of deps,
    params and outs), so a rerun with nothing changed does no work. The lock spans the
    check, the run and the record, so no other writer slips in between.
    """
    from prefect import get_run_logger

    with hold_workspace(root, params_path):
        if dvc_bookkeeping and stage_is_current(stage, root):
            get_run_logger().info(
                "Stage %r is up to date (dvc.lock matches its deps, params and outs): skipping",
                stage,
            )
            return None
        result = run()
        if dvc_bookkeeping:
            record_stage(stage, root)
            get_run_logger().info("Stage %r recorded in dvc.lock", stage)
        return result


# -- the story in the Prefect UI -------------------------------------------------------------


def pipeline_id() -> str | None:
    """The id every stage process of one pipeline execution shares (see ``PIPELINE_ENV``)."""
    from tasks.runtime.workspace_lock import LOCK_ENV

    token = os.environ.get(LOCK_ENV)
    return os.environ.get(PIPELINE_ENV) or (token[:8] if token else None)


def run_tags(stage: str) -> list[str]:
    """``stage:<stage>``, ``pipeline:<id>`` and, under `dvc exp run`, ``dvc-exp:<name>``:
    filter the Prefect UI by one to see every flow run of that pipeline execution."""
    tags = [f"stage:{stage}"]
    if pipeline := pipeline_id():
        tags.append(f"pipeline:{pipeline}")
    if experiment := os.environ.get("DVC_EXP_NAME"):
        tags.append(f"dvc-exp:{experiment}")
    return tags


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

    with hold_workspace(Path("."), Path(params_path)), tags(*run_tags(stage)), stage_settings():
        yield


@contextmanager
def untagged_task_runs() -> Iterator[None]:
    """Task runs started inside carry no tags; the flow runs keep theirs (:func:`run_tags`).

    Prefect asks its server for tag concurrency slots before every tagged task run. On the
    SQLite store that request failed about one time in three (SQLITE_BUSY, answered 503)
    and the client retried it 2 s later: 2 s added to a stage at random. Untagged task runs
    make no such request; a flow run's tags still group its stage and pipeline in the UI.
    """
    from prefect.context import TagsContext

    with TagsContext(current_tags=set()):
        yield


@contextmanager
def stage_settings() -> Iterator[None]:
    """Prefect settings for a stage's flows (the benchmarks run theirs under it too).

    No flow-run heartbeats: their thread sleeps in one-second steps, so every flow's end
    waits up to a second for it (half a second a flow on average, measured in every stage).
    A stage process that dies is caught without them: it leaves its lock, and DVC reruns
    the stage. Deployment runs (`make serve`) keep them.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


# Prefect's runtime override of ``prefect.runtime.deployment.id``.
RUNTIME_DEPLOYMENT_ENV = "PREFECT__RUNTIME__DEPLOYMENT__ID"


def in_deployment_run() -> bool:
    """Whether this code runs in a run a Prefect deployment started: then its parameters
    come from whoever started the run, and are confined to the repository.

    A top-level flow run (every `dvc repro` stage's) knows its deployment: Prefect's
    ``runtime.deployment.id`` asked the server again whenever there was none (about 40 ms a
    call, several a stage). A nested flow run asks ``runtime.deployment``, which knows its
    ancestors' deployment from the context, and so does any run where
    ``PREFECT__RUNTIME__DEPLOYMENT__ID`` stands in for a deployment (Prefect's runtime
    override, which the tests use)."""
    from prefect.context import FlowRunContext
    from prefect.runtime import deployment

    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    if (
        run is not None
        and run.parent_task_run_id is None
        and RUNTIME_DEPLOYMENT_ENV not in os.environ
    ):
        return run.deployment_id is not None
    return deployment.id is not None


def run_params_path(root: str, params_path: str) -> Path:
    """The params file a flow reads: for a deployment run, only one inside the repository.

    Deployments are served from the repository root (the working directory); direct calls
    (DVC stages, tests) name their own project root.
    """
    from tasks.runtime.params import resolve_inside  # here: entry points import this module first

    if not in_deployment_run():
        return Path(root) / params_path
    return resolve_inside(root, params_path, Path.cwd())


def flow_run_tags() -> dict[str, str]:
    """The Prefect flow run this code runs in, as MLflow tags ("none" outside a flow)."""
    from prefect.runtime import flow_run

    run_id = str(flow_run.id) if flow_run.id else None
    url = str(flow_run.ui_url) if run_id and flow_run.ui_url else None
    return {"prefect.flow_run_id": run_id or "none", "prefect.flow_run_url": url or "none"}


@contextmanager
def run_log(logger_name: str = "tasks") -> Iterator[None]:
    """Inside, what the plain-Python ``tasks`` loggers say also goes to this Prefect run's
    log (the UI), as :func:`prefect.get_run_logger` records would; they still propagate."""
    import logging

    from prefect.logging.handlers import APILogHandler

    logger, handler = logging.getLogger(logger_name), APILogHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def run_name(stage: str, *details: object) -> str:
    """``shard · 405c04ba · 3000 images``: the stage, then what it ran on."""
    return " · ".join([stage, *(str(d) for d in details if d not in (None, ""))])


def run_parameter(name: str, default: Any) -> Any:
    """A parameter of the current flow run (for ``flow_run_name`` callables)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return (context.parameters or {}).get(name, default) if context else default


def naming(stage: str, details: Callable[[], Sequence[object]]) -> Callable[[], str]:
    """A ``flow_run_name`` callable: the stage plus ``details()``, or the stage alone when
    those cannot be read yet (a first run has no manifest): naming never fails a run."""

    def name() -> str:
        try:
            return run_name(stage, *details())
        except Exception:  # missing or unreadable inputs: the stage reports them itself
            return stage

    return name


def rename_flow_run(name: str) -> None:
    """Rename the current flow run once the figures that name it exist (a shard set's
    fingerprint is known only after its shards are written)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_name(context.flow_run.id, name)


class Progress:
    """A progress artifact in the flow run's UI, moved from 0 to 100 as work completes.

    An update is sent when the figure has moved by ``step`` percent and ``interval_s`` has
    passed since the last one, and always on reaching 100: a long stage makes at most ~100
    API calls whatever its size, and a short one a few. Each update is a round trip to the
    server that the work waits for (about 20 ms on 2 cores): a 3,000-image ingest sent 47
    of them, 1 s of its 2.1 s.
    """

    def __init__(
        self, key: str, description: str, *, step: float = 1.0, interval_s: float = 1.0
    ) -> None:
        from prefect.artifacts import create_progress_artifact

        self.step = step
        self.interval_s = interval_s
        self.shown = 0.0
        # Called from sync code, Prefect's dispatch returns the id, not a coroutine.
        self.artifact_id: Any = create_progress_artifact(0.0, key=key, description=description)
        self.sent_at = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        from prefect.artifacts import update_progress_artifact

        percent = 100.0 if total <= 0 else min(100.0, 100.0 * done / total)
        due = time.monotonic() - self.sent_at >= self.interval_s
        if (due and percent - self.shown >= self.step) or (percent >= 100.0 > self.shown):
            update_progress_artifact(self.artifact_id, percent)
            self.shown = percent
            self.sent_at = time.monotonic()
