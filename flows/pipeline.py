"""The whole pipeline as one Prefect flow: the data flow, then the training flow.

Deployment runs go through here. Per-run overrides are typed (:class:`ParamOverrides`) and
are written into ``params.yaml`` before anything runs, and every stage is checked against
and recorded in ``dvc.lock``, so the Prefect path and `dvc repro` always agree on which
data and params a model came from. A run's parameters cannot reach outside the project:
where code runs, and which directory is read and written, come from the repository only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags

from flows.data import data_flow
from flows.servers.prefect_server import require_server
from flows.support.dvc_steps import hold_workspace
from flows.support.environment import configure_environment
from flows.support.parameters import RepoPath
from flows.support.refusal_logs import refusals_as_blocks
from flows.support.run_story import pipeline_id, run_params_path
from flows.training import training_flow
from tasks.runtime.run_overrides import ParamOverrides, apply_overrides


@flow(name="pipeline", log_prints=True)
def pipeline(
    overrides: ParamOverrides | None = None,
    params_path: RepoPath = "params.yaml",
    root: RepoPath = ".",
) -> dict[str, Any]:
    """ingest -> shard -> validate | train -> evaluate; stages DVC finds current are skipped."""
    refusals_as_blocks(show_first=True)  # no entry point of ours prints a deployment's
    logger = get_run_logger()
    params_file = run_params_path(root, params_path)  # refused outside the repository
    changes = overrides.as_dict() if overrides else {}
    # One writer, start to end; every flow run below carries this execution's pipeline tag.
    with hold_workspace(Path(root), params_file), tags(f"pipeline:{pipeline_id()}"):
        if changes:
            apply_overrides(params_file, changes)  # refuses shard.runner, dask_address, ...
            logger.info("params.yaml updated with this run's overrides: %s", changes)
        data = data_flow(params_path=params_path, root=root, dvc_bookkeeping=True)
        training = training_flow(params_path=params_path, root=root, dvc_bookkeeping=True)
    return {"data": data, "training": training}


def main() -> None:
    configure_environment()
    require_server()
    pipeline()


if __name__ == "__main__":
    main()
