"""The data flow: image folders -> ingest -> shard -> validate.

``python -m flows.data [ingest|shard|validate]`` runs part of this flow; each ``dvc.yaml``
stage calls exactly that, so `dvc repro` and a Prefect deployment run the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner

from flows.common import code_version, configure_environment, parse_stage_args, run_stage
from flows.server import require_server
from tasks import ingest, manifest, schema, shard, validate
from tasks.layout import Layout
from tasks.manifest import ShardFile
from tasks.params import IngestParams, ShardParams, load_params, run_params_path

DATA_STAGES = ("ingest", "shard", "validate")


@task(name="ingest", version=code_version(ingest), cache_policy=NO_CACHE)
def ingest_task(params: IngestParams, layout: Layout) -> dict[str, Any]:
    report = ingest.run_ingest(params, layout.index, layout.ingest_report)
    create_table_artifact(
        key="ingest-summary",
        table=ingest.summary_rows(report),
        description=(
            f"{report['files_found']} files found: {report['accepted']} accepted, "
            f"{report['quarantined_count']} quarantined, {report['duplicate_count']} duplicates. "
            + "; ".join(f"{q['path']}: {q['reason']}" for q in report["quarantined"][:20])
        ),
    )
    return {
        k: report[k] for k in ("files_found", "accepted", "quarantined_count", "duplicate_count")
    }


@task(name="write-shard", version=code_version(shard, schema), cache_policy=NO_CACHE)
def write_shard_task(spec: shard.ShardSpec, shards_dir: Path) -> ShardFile:
    """One shard: an independent unit of work, byte-identical on whichever worker runs it."""
    return shard.write_shard(spec, shards_dir)


@flow(name="write-shards")
def write_shards_flow(params: ShardParams, layout: Layout) -> dict[str, Any]:
    """Plan shards, write the missing ones through this flow's task runner, then the manifest."""
    logger = get_run_logger()
    index = ingest.load_index(layout.index)
    specs = shard.plan_shards(params, index)
    del index["records"]  # the plan holds what writing needs; keep peak memory flat
    missing = shard.prepare_shards_dir(specs, layout.shards_dir)
    logger.info(
        "%d shards planned, %d to write (%s runner)", len(specs), len(missing), params.runner
    )
    written: dict[str, ShardFile] = {}
    futures = write_shard_task.map(missing, unmapped(layout.shards_dir))
    for done, future in enumerate(as_completed(futures), start=1):
        result = future.result()
        written[result.file] = result
        logger.info("shard %d/%d written: %s", done, len(missing), result.file)
    results = [written.get(s.file) or shard.describe_shard(s, layout.shards_dir) for s in specs]
    written_manifest = shard.finalize_manifest(params, index, specs, results, layout.shards_dir)
    return {
        "fingerprint": written_manifest.fingerprint,
        "records": {name: split.num_records for name, split in written_manifest.splits.items()},
        "shards": len(specs),
    }


def shard_task_runner(params: ShardParams) -> TaskRunner[Any]:
    """Local spawned processes by default; a Dask cluster when ``shard.runner: dask``."""
    if params.runner == "dask":
        if not params.dask_address:
            raise ValueError("shard.runner is 'dask' but shard.dask_address is not set in params")
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=params.dask_address)
    return ProcessPoolTaskRunner(max_workers=max(1, params.workers))


@task(name="validate", version=code_version(validate, schema, manifest), cache_policy=NO_CACHE)
def validate_task(layout: Layout) -> dict[str, Any]:
    report = validate.run_validate(
        layout.shards_dir,
        layout.validation_report,
        layout.validation_summary,
        index_path=layout.index,
    )
    create_markdown_artifact(
        key="validation-report",
        markdown=layout.validation_summary.read_text(),
        description=f"shards {(report['fingerprint'] or 'unknown')[:12]}: "
        + ("passed" if report["passed"] else "FAILED"),
    )
    validate.raise_if_failed(report)  # after the report is written, so it can be read
    return {"passed": report["passed"], "fingerprint": report["fingerprint"]}


@flow(name="data", log_prints=True)
def data_flow(
    params_path: str = "params.yaml",
    root: str = ".",
    stages: list[str] | None = None,
    dvc_bookkeeping: bool = False,
) -> dict[str, Any]:
    """Ingest, shard and validate; ``stages`` picks a subset (what one DVC stage runs).

    With ``dvc_bookkeeping`` (deployment runs) a stage that DVC reports up to date is
    skipped and a stage that ran is recorded in ``dvc.lock``.
    """
    params = load_params(run_params_path(root, params_path))  # inside the repo if deployed
    layout = Layout(Path(root))
    stages = stages or list(DATA_STAGES)
    shard_flow = write_shards_flow.with_options(task_runner=shard_task_runner(params.shard))
    steps = {
        "ingest": lambda: ingest_task(params.ingest, layout),
        "shard": lambda: shard_flow(params.shard, layout),
        "validate": lambda: validate_task(layout),
    }
    return {
        name: run_stage(name, layout.root, steps[name], dvc_bookkeeping=dvc_bookkeeping)
        for name in DATA_STAGES
        if name in stages
    }


def main() -> None:
    configure_environment()
    require_server()
    stages, params_path = parse_stage_args(DATA_STAGES, "flows.data")
    data_flow(params_path=params_path, stages=stages)


if __name__ == "__main__":
    main()
