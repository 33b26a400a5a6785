"""The shard stage: preprocess every indexed image once into TFRecord shards plus a manifest.

One module a job: :mod:`~tasks.shard.spec` (one shard's unit of work and one record's
preprocessing), :mod:`~tasks.shard.planning` (index scan, order keys, cuts),
:mod:`~tasks.shard.writing` (writing and resume), :mod:`~tasks.shard.append` (what an append
may build on), :mod:`~tasks.shard.workers` (the local worker processes),
:mod:`~tasks.shard.staging` (Dask workers without the stage's file system, through S3) and
:mod:`~tasks.shard.stage` (plan, prepare, write, finalize: manifest, record lists, data diff).
A finished rebuild replaces the shard folder whole through :mod:`tasks.shard_swap`, outside
the package: validation finishes a swap a kill cut short without importing the shard stage.
Same inputs and params give byte-identical shards and ``manifest.json`` whatever the number
of workers. What the flow and the other stages' callers use is named here.
"""

from tasks.shard.append import RebuildNeeded
from tasks.shard.planning import ShardPlan, plan_shards, shard_name
from tasks.shard.spec import ShardRecord, ShardSpec
from tasks.shard.stage import StageRun, shard_stage
from tasks.shard.staging import (
    Staging,
    StagingError,
    fetch_shard,
    staged_run,
    upload_sources,
    write_staged_batch,
)
from tasks.shard.workers import (
    LocalWorkers,
    pool_workers,
    prestart_stage_workers,
    prestart_workers,
    run_params,
    warm_worker,
    workers_from_the_start,
)
from tasks.shard.writing import WriteMany, describe_shard, write_batch, write_shard

__all__ = [
    "LocalWorkers",
    "RebuildNeeded",
    "ShardPlan",
    "ShardRecord",
    "ShardSpec",
    "StageRun",
    "Staging",
    "StagingError",
    "WriteMany",
    "describe_shard",
    "fetch_shard",
    "plan_shards",
    "pool_workers",
    "prestart_stage_workers",
    "prestart_workers",
    "run_params",
    "shard_name",
    "shard_stage",
    "staged_run",
    "upload_sources",
    "warm_worker",
    "workers_from_the_start",
    "write_batch",
    "write_shard",
    "write_staged_batch",
]
