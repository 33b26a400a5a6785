"""The shard stage as a flow; ``python -m flows.launch.shard`` (what `dvc repro` runs) starts a
rebuild's workers, then runs :func:`main`.

Imports only what sharding runs (the preprocessing, the schema, the index format), never
ingest: editing how ingest checks or reports files does not reshard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

import tasks.shard as shard_package
import tasks.shard.spec as shard_spec
import tasks.shard.stage as shard_stage
import tasks.shard.staging as shard_staging
import tasks.shard.workers as shard_workers
import tasks.shard.writing as shard_writing
from flows.support.entry import code_version, run_then_exit, stage_main
from flows.support.run_story import (
    Progress,
    naming,
    rename_flow_run,
    run_log,
    run_name,
    run_parameter,
    run_params_path,
    untagged_task_runs,
)
from tasks.contracts.manifest import ShardFile
from tasks.contracts.membership import archive_membership
from tasks.contracts.shard_store import s3_client
from tasks.runtime.latency import dismiss_prestarted
from tasks.runtime.layout import Layout
from tasks.runtime.params import ShardParams, load_params
from tasks.shard.window import run_in_window

# Shards per Prefect task: each task run costs a run record and state events that the
# Prefect server processes (CPU taken from the workers on a small machine), so a task
# carries a batch of shards. The workers take shards, not batches, from
# the pool (see write_shards_task), so batches need not be small to keep them evenly loaded:
# this many tasks per worker keep the progress moving, and a batch never passes the cap.
# Fewer, larger tasks whose shards go to the pool one by one keep the workers nearer the
# all-core ceiling than a task a shard (the bench's `write_photos` figures).
TASKS_PER_WORKER = 2
MAX_SHARDS_PER_TASK = 16


@task(name="write-shards", version=code_version(shard_package), cache_policy=NO_CACHE)
def write_shards_task(
    specs: list[shard_spec.ShardSpec],
    shards_dir: Path,
    pool: Executor | None = None,
    staging: shard_staging.Staging | None = None,
) -> list[ShardFile]:
    """A batch of shards: each an independent unit of work, byte-identical on whichever
    worker runs it.

    With ``pool`` (the local runner) each shard is computed in one of the stage's warm
    worker processes, whichever is free first, while this task, in a thread of the flow,
    keeps its Prefect run record; without (a Dask worker, or a single worker), right here,
    one after the other. With ``staging`` (a Dask worker without the stage's file system)
    the sources come from, and the shards go to, object storage, never ``shards_dir``.
    """
    if staging is not None:
        return shard_staging.write_staged_batch(specs, staging)
    if pool is None:
        return shard_writing.write_batch(specs, shards_dir)
    # One pool job a shard: the pool's queue holds the shards of every running task, so a
    # worker goes from one shard to the next without waiting for a task run to start.
    jobs = [pool.submit(shard_writing.write_shard, spec, shards_dir) for spec in specs]
    try:
        return [job.result() for job in jobs]
    finally:
        for job in jobs:
            job.cancel()  # after a failure: this batch's shards not yet started


def batch_size(total: int, workers: int) -> int:
    """Shards per task for ``total`` shards on ``workers`` workers (at least 1)."""
    wanted = math.ceil(total / (max(1, workers) * TASKS_PER_WORKER)) if total else 1
    return max(1, min(MAX_SHARDS_PER_TASK, wanted))


def result_details(result: dict[str, Any]) -> list[object]:
    """What names a shard run once done: the set's fingerprint and its size."""
    return [str(result["fingerprint"])[:8], f"{sum(result['records'].values())} images"]


def runner_writer(
    workers: int,
    local: shard_workers.LocalWorkers | None = None,
    staging: shard_staging.Staging | None = None,
) -> shard_writing.WriteMany:
    """A writer that sends batches of shards to the flow's task runner, a few at a time
    (each task computing in ``local``'s worker processes when it has them for these
    shards, see :func:`write_shards_task`). With ``staging``, the sources the shards need
    are uploaded first and each finished shard is downloaded into the folder the stage
    names (a rebuild's own folder, :mod:`tasks.contracts.shard_swap`; :mod:`tasks.shard.staging`).

    Specs are materialised (their records read from the index) only as they are submitted,
    and at most two batches per worker are in flight (:func:`tasks.shard.window.run_in_window`),
    so the parent's memory stays flat however many shards the plan holds. Results come back
    as batches finish; a progress artifact follows.
    """
    window = 2 * max(1, workers)

    def write_many(specs: Iterable[shard_spec.ShardSpec], folder: Path) -> Iterator[ShardFile]:
        logger = get_run_logger()
        total = len(specs) if isinstance(specs, Sized) else 0
        progress = Progress("shard-progress", f"shards written of {total or '?'} to write")
        pool = local.for_shards(specs) if local is not None else None
        client = s3_client() if staging is not None else None  # one for every transfer
        if staging is not None:
            uploaded, needed = shard_staging.upload_sources(staging, specs, client=client)
            logger.info(
                "%d of %d source images uploaded to %s (the rest were there)",
                uploaded,
                needed,
                staging.url,
            )
        size = batch_size(total, workers)
        done = 0

        def submit(batch: list[shard_spec.ShardSpec]) -> PrefectFuture[list[ShardFile]]:
            return write_shards_task.submit(batch, folder, pool, staging)

        def collect(future: PrefectFuture[list[ShardFile]]) -> list[ShardFile]:
            nonlocal done
            results = future.result()
            if staging is not None:  # into the folder, each checked against its entry
                for result in results:
                    shard_staging.fetch_shard(staging, result, folder, client=client)
            done += len(results)
            progress(done, total)
            logger.info("shard %d/%s written: %s", done, total or "?", results[-1].file)
            return results

        def wait_all(pending: list[PrefectFuture[list[ShardFile]]]) -> None:
            for future in pending:  # their uploads land before the run's staging is removed
                future.wait()

        yield from run_in_window(
            specs,
            batch_size=size,
            window=window,
            submit=submit,
            first_done=_first_done,
            collect=collect,
            on_failure=wait_all if staging is not None else None,
        )
        progress(1, 1)  # nothing missing (a resumed or empty plan) is done too

    return write_many


def _first_done(
    pending: list[PrefectFuture[list[ShardFile]]],
) -> PrefectFuture[list[ShardFile]]:
    """Wait for whichever pending batch finishes first."""
    return next(as_completed(pending))


@flow(name="write-shards", flow_run_name="write-shards")
def write_shards_flow(params: ShardParams, layout: Layout) -> dict[str, Any]:
    """The shard stage (:func:`tasks.shard.stage.shard_stage`: plan a rebuild or a new generation,
    write the missing shards, the manifest, what the run changed) writing through this
    flow's task runner; what it changed also becomes a Prefect artifact."""
    logger = get_run_logger()
    # A rebuild's workers start now (if its entry point has not started them), while it plans.
    with (
        untagged_task_runs(),
        shard_workers.LocalWorkers(params) as local,
        shard_staging.staged_run(params) as staging,
    ):
        stage = shard_stage.shard_stage(
            params,
            layout.index,
            layout.shards_dir,
            write_many=runner_writer(params.workers, local, staging),
            diff_path=layout.shard_changes,
            handoff=layout.handoff,
        )
    manifest, diff = stage.manifest, stage.diff
    assert diff is not None
    archive_membership(layout.shards_dir, layout.membership_archive, manifest.fingerprint)
    logger.info(
        "%s: generation %d, %d shards planned, %d written (%s runner, preprocessing %s)",
        stage.mode,
        stage.number,
        stage.shards,
        stage.written,
        params.runner,
        manifest.preprocessing_version,
    )
    create_markdown_artifact(
        key="shard-changes",
        markdown=layout.shard_changes.with_suffix(".md").read_text(),
        description=f"+{diff['added_total']} -{diff['removed_total']} images, "
        f"{len(manifest.generations)} generation(s)",
    )
    summary = {
        "fingerprint": manifest.fingerprint,
        "records": {name: split.num_records for name, split in manifest.splits.items()},
        "generation": stage.number,
        "generations": len(manifest.generations),
        # every file of the set left behind (an append plans only its new generation's)
        "shards": sum(len(split.shards) for split in manifest.splits.values()),
        "written": stage.written,
        "added": diff["added_total"],
    }
    logger.info(key_figures(summary, diff["removed_total"]))
    rename_flow_run(run_name("write-shards", *result_details(summary)))
    return summary


def key_figures(summary: dict[str, Any], removed: int) -> str:
    """The shard stage in one log line: which set, how big, what this run wrote."""
    splits = ", ".join(f"{name} {count}" for name, count in summary["records"].items())
    return (
        f"shards {summary['fingerprint']}: {sum(summary['records'].values())} records "
        f"({splits}) in {summary['shards']} shard files, {summary['written']} written now; "
        f"generation {summary['generation']} ({summary['generations']} in all); "
        f"+{summary['added']} -{removed} images against the previous manifest"
    )


def shard_task_runner(params: ShardParams) -> TaskRunner[Any]:
    """Threads of the flow by default (one per worker; each task computes in the stage's
    worker processes, :class:`tasks.shard.workers.LocalWorkers`); a Dask cluster on request
    (its workers reach the data through ``shard.staging_url`` when set, else a shared file
    system)."""
    if params.runner == "dask":
        if not params.dask_address:
            raise ValueError("shard.runner is 'dask' but shard.dask_address is not set in params")
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=params.dask_address)
    return ThreadPoolTaskRunner(max_workers=max(1, params.workers))


def stage_params(params: ShardParams, *, compact: bool = False) -> ShardParams:
    """The params a run of the stage (its DVC stage, the data flow) uses
    (:func:`tasks.shard.workers.run_params`), and in this run's log why they differ from the file's
    (workers capped at this machine's cores)."""
    with run_log():
        return shard_workers.run_params(params, compact=compact)


def run(params: ShardParams, layout: Layout) -> dict[str, Any]:
    """The shard stage through its task runner: the one write path production takes."""
    try:
        return write_shards_flow.with_options(task_runner=shard_task_runner(params))(params, layout)
    finally:
        dismiss_prestarted()  # workers started for this run that it did not take


def mode_details() -> list[object]:
    """What names a shard run before it starts: rebuild, append or compact."""
    if run_parameter("compact", False):
        return ["compact"]
    root = run_parameter("root", ".")
    params = load_params(run_params_path(root, run_parameter("params_path", "params.yaml")))
    return [params.shard.mode]


@flow(name="shard", log_prints=True, flow_run_name=naming("shard", mode_details))
def shard_flow(
    params_path: str = "params.yaml", root: str = ".", compact: bool = False
) -> dict[str, Any]:
    """Preprocess every indexed image once into TFRecord shards plus a manifest.

    ``compact`` rebuilds whatever ``shard.mode`` says: every generation folds into one
    (what `make compact` runs).
    """
    params = load_params(run_params_path(root, params_path))
    result = run(stage_params(params.shard, compact=compact), Layout(root))
    rename_flow_run(run_name("shard", *result_details(result)))
    return result


def main() -> None:
    """The stage: its pool takes the workers :mod:`flows.launch.shard` started, else starts
    its own."""
    stage_main(
        "shard",
        shard_workers.STAGES,
        lambda stages, params: shard_flow(params_path=params, compact=stages == ["compact"]),
    )


if __name__ == "__main__":
    run_then_exit(main)
