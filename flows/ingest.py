"""The ingest stage as a flow: ``python -m flows.ingest`` (what `dvc repro` runs).

Imports only what ingest runs, so the stage's ``dvc.yaml`` deps are exactly its code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.common import code_version, configure_environment, hold_workspace, parse_stage_args
from flows.server import require_server
from tasks import images, ingest
from tasks.layout import Layout
from tasks.params import IngestParams, load_params, run_params_path


@task(name="ingest", version=code_version(ingest, images), cache_policy=NO_CACHE)
def ingest_task(params: IngestParams, layout: Layout) -> dict[str, Any]:
    report = ingest.run_ingest(params, layout.index, layout.ingest_report)
    create_table_artifact(
        key="ingest-summary",
        table=ingest.summary_rows(report),
        description=(
            f"{report['files_found']} files found: {report['accepted']} accepted, "
            f"{report['quarantined_count']} quarantined, {report['duplicate_count']} duplicates, "
            f"{report['skipped_count']} skipped. "
            + "; ".join(f"{q['path']}: {q['reason']}" for q in report["quarantined"][:20])
        ),
    )
    keys = ("files_found", "accepted", "quarantined_count", "duplicate_count", "skipped_count")
    return {k: report[k] for k in keys}


@flow(name="ingest", log_prints=True)
def ingest_flow(params_path: str = "params.yaml", root: str = ".") -> dict[str, Any]:
    """Find every input image, check it, assign splits; quarantine the rest."""
    params = load_params(run_params_path(root, params_path))
    return ingest_task(params.ingest, Layout(Path(root)))


def main() -> None:
    configure_environment()
    require_server()
    _, params_path = parse_stage_args(("ingest",), "flows.ingest")
    with hold_workspace(Path("."), Path(params_path)):  # one writer at a time
        ingest_flow(params_path=params_path)


if __name__ == "__main__":
    main()
