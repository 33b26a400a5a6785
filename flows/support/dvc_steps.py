"""A stage's DVC bookkeeping and the workspace lock around it: whether DVC finds the stage current,
recording what it produced in ``dvc.lock``, the lock every stage holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from flows.support.environment import OFFLINE_ENV
from tasks.runtime.code_version import code_version as code_version  # task versions, re-exported

T = TypeVar("T")


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
