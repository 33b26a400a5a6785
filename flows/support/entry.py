"""How every flow entry point starts: offline settings, code-derived task versions, the
stage's arguments, and its exit (a refusal as its block and exit status 2). The
offline settings are ``flows.support.environment``, the workspace lock and DVC's bookkeeping
``flows.support.dvc_steps``, refusals in the logs ``flows.support.refusal_logs``, and what the
Prefect UI shows of a run ``flows.support.run_story``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from flows.support.dvc_steps import hold_workspace
from flows.support.environment import configure_environment
from flows.support.refusal_logs import refusals_as_blocks
from flows.support.run_story import run_tags, stage_settings
from tasks.runtime.code_version import code_version as code_version  # task versions, re-exported
from tasks.runtime.latency import exit_now
from tasks.runtime.refusals import refusing


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """A stage's ``python -m`` entry point: run ``main``, then end the process at once
    (:func:`tasks.runtime.latency.exit_now`: no interpreter teardown). A refusal
    (:class:`tasks.runtime.refusals.Refused`) is printed as one short block (exit status 2);
    an exception carrying an ``exit_status`` (training stopped by SIGTERM once it saved
    its state: 143) is printed in a line and ends the process with that status; any other
    exception propagates as usual (traceback, status 1).
    """

    def body() -> int:
        try:
            main()
        except Exception as error:
            status = getattr(error, "exit_status", None)
            if not isinstance(status, int):
                raise
            print(f"{entry_name(main)}: {error}", file=sys.stderr, flush=True)
            return status
        return 0

    refusals_as_blocks(show_first=False)
    code = refusing(body, entry_name(main))
    exit_now(code)


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
    from flows.servers.prefect_server import require_server

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
