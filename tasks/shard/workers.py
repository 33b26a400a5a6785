"""The shard stage's local worker processes: how many, when they start, their warm-up."""

from __future__ import annotations

from tasks.images import preprocessing_version
from tasks.params import ShardParams
from tasks.processes import prestart_pool


def warm_worker() -> None:
    """A shard worker's one-off start-up: the shard package's imports (done by unpickling this
    function) and a first preprocessing-version probe, before any shard is due."""
    preprocessing_version()


def pool_workers(params: ShardParams) -> int:
    """Worker processes the local runner spawns for ``params`` (0: the flow writes itself,
    with one worker or on Dask)."""
    return params.workers if params.runner == "local" and params.workers > 1 else 0


def run_params(params: ShardParams, *, compact: bool) -> ShardParams:
    """The params a shard run uses: ``compact`` rebuilds (every generation folds into one)
    whatever ``shard.mode`` says."""
    return params.model_copy(update={"mode": "rebuild"}) if compact else params


def workers_from_the_start(params: ShardParams) -> bool:
    """Whether the run's workers start with it: a rebuild with local workers. An append
    spawns workers only once its new shards prove worth them."""
    return pool_workers(params) > 0 and params.mode == "rebuild"


def prestart_workers(params: ShardParams) -> None:
    """Start a rebuild's workers before the stage's own imports (see
    :func:`tasks.processes.prestart_pool`); the stage's pool takes them."""
    if workers_from_the_start(params):
        prestart_pool(params.workers, warm=warm_worker)
