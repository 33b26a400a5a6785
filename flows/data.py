"""The data flow: image folders -> ingest -> shard -> validate.

``python -m flows.data [ingest|shard|validate]`` runs part of this flow. Each stage lives in a
module of its own (``flows/ingest.py``, ``flows/shard.py``, ``flows/validate.py``) that imports
only the code it runs; ``dvc.yaml`` runs those modules, so a stage's deps are exactly its
code, and this flow composes the same tasks for deployment runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from prefect import flow

from flows import ingest, shard, validate
from flows.support.dvc_steps import hold_workspace, record_stage, run_stage
from flows.support.entry import run_then_exit, stage_main
from flows.support.parameters import RepoPath
from flows.support.refusal_logs import refusals_as_blocks
from flows.support.run_story import naming, run_parameter, run_params_path
from tasks.ingest.source_check import write_listing
from tasks.runtime.layout import Layout
from tasks.runtime.params import load_params

DataStage = Literal["ingest", "shard", "validate"]  # a run's `stages` are checked names
DATA_STAGES: tuple[DataStage, ...] = get_args(DataStage)


def stage_details() -> list[object]:
    """What names a data run: the stages it runs."""
    return [", ".join(run_parameter("stages", None) or DATA_STAGES)]


@flow(name="data", log_prints=True, flow_run_name=naming("data", stage_details))
def data_flow(
    params_path: RepoPath = "params.yaml",
    root: RepoPath = ".",
    stages: list[DataStage] | None = None,
    dvc_bookkeeping: bool = False,
) -> dict[str, Any]:
    """Ingest, shard and validate; ``stages`` picks a subset (what one DVC stage runs).

    With ``dvc_bookkeeping`` (deployment runs) a stage that DVC reports up to date is
    skipped and a stage that ran is recorded in ``dvc.lock``.
    """
    refusals_as_blocks(show_first=True)  # a deployment run's; a stage's entry point set its own
    params = load_params(run_params_path(root, params_path))  # inside the repo if deployed
    layout = Layout(root)
    stages = stages or list(DATA_STAGES)
    steps = {
        "ingest": lambda: ingest.ingest_task(params.ingest, layout),
        "shard": lambda: shard.run(shard.stage_params(params.shard), layout),
        "validate": lambda: validate.validate_task(layout, params),
    }
    if dvc_bookkeeping and "ingest" in stages:
        list_source(layout.root, params.ingest.source_dir)
    return {
        name: run_stage(name, layout.root, steps[name], dvc_bookkeeping=dvc_bookkeeping)
        for name in DATA_STAGES
        if name in stages
    }


def list_source(root: Path, source_dir: str) -> None:
    """The source stage's work, recorded: DVC judges ingest current against the source
    folder's listing, which only that stage rewrites (`dvc repro` runs it first)."""
    with hold_workspace(root):
        write_listing(root, source_dir)
        record_stage("source", root)


def main() -> None:
    def run(names: list[str], params: str) -> object:  # names: checked against DATA_STAGES
        return data_flow(params_path=params, stages=[s for s in DATA_STAGES if s in names])

    stage_main("data", DATA_STAGES, run)


if __name__ == "__main__":
    run_then_exit(main)
