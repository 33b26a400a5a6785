"""What every flow entry point shares: offline settings, code-derived task versions, and the
workspace lock around every stage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")

OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def configure_environment() -> None:
    """Analytics off and quiet TensorFlow; called by entry points, never at import."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def code_version(*modules: ModuleType) -> str:
    """A short hash of the modules' source: a task's version changes exactly with its code."""
    digest = hashlib.sha256()
    for module in modules:
        source = getattr(module, "__file__", None)
        if source:
            digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


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


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE_ENV},
        check=False,
    )


def stage_is_current(stage: str, root: Path) -> bool:
    """True when ``dvc.lock`` already matches the stage's deps, params and outs (by content)."""
    result = _dvc(root, "status", "--json", stage)
    if result.returncode != 0:
        raise RuntimeError(f"`dvc status {stage}` failed in {root}: {result.stderr.strip()}")
    return json.loads(result.stdout or "{}") == {}


def record_stage(stage: str, root: Path) -> None:
    """Record what the stage just produced in ``dvc.lock`` (and the DVC cache)."""
    result = _dvc(root, "commit", "--force", stage)
    if result.returncode != 0:
        raise RuntimeError(f"`dvc commit {stage}` failed in {root}: {result.stderr.strip()}")


@contextmanager
def hold_workspace(root: Path, params_path: Path | None = None) -> Iterator[None]:
    """The workspace lock of ``root`` (see tasks.workspace_lock), waiting at most
    ``workspace.lock_timeout_s`` from the params file; reentrant under a holder."""
    from tasks.workspace_lock import lock_timeout_s, workspace_lock

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
