"""The shard stage's local worker processes: how many, when they start, their warm-up."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Executor
from contextlib import ExitStack

from tasks.images import preprocessing_version
from tasks.runtime.latency import prestart_pool
from tasks.runtime.params import ShardParams
from tasks.runtime.processes import capped_workers, spawn_pool
from tasks.shard.spec import ShardSpec

# What the shard stage's command runs: a shard run, or a compaction (every generation into one).
STAGES = ("shard", "compact")


def warm_worker() -> None:
    """A shard worker's one-off start-up: the shard package's imports (done by unpickling this
    function) and a first preprocessing-version probe, before any shard is due."""
    preprocessing_version()


def pool_workers(params: ShardParams) -> int:
    """Worker processes the local runner spawns for ``params`` (0: the flow writes itself,
    with one worker or on Dask)."""
    return params.workers if params.runner == "local" and params.workers > 1 else 0


def run_params(params: ShardParams, *, compact: bool, say: bool = True) -> ShardParams:
    """The params a shard run uses: ``compact`` rebuilds (every generation folds into one)
    whatever ``shard.mode`` says; the local runner's ``shard.workers`` is capped at this
    process's cores (:func:`tasks.runtime.processes.capped_workers`: the shards are the same bytes
    whatever the count; ``say``: log when it caps them). Dask's workers are the cluster's, not
    this machine's."""
    update: dict[str, object] = {"mode": "rebuild"} if compact else {}
    if params.runner == "local":
        update["workers"] = capped_workers(params.workers, "shard.workers", say=say)
    return params.model_copy(update=update)


def workers_from_the_start(params: ShardParams) -> bool:
    """Whether the run's workers start with it: a rebuild with local workers. An append
    spawns them on its first shards."""
    return pool_workers(params) > 0 and params.mode == "rebuild"


def prestart_stage_workers(params: ShardParams, *, compact: bool) -> None:
    """What ``python -m flows.launch.shard`` starts first: the workers of the run
    its flow will make of ``params`` (:func:`run_params`), without saying why their count is
    capped: the flow says so, in its run's log too, and the terminal got it twice."""
    prestart_workers(run_params(params, compact=compact, say=False))


def prestart_workers(params: ShardParams) -> None:
    """Start a rebuild's workers before the stage's flow (see
    :func:`tasks.runtime.latency.prestart_pool`); the stage's pool takes them."""
    if workers_from_the_start(params):
        prestart_pool(params.workers, warm=warm_worker)


class LocalWorkers:
    """The local runner's worker processes (``shard.workers`` of them, spawned and warmed
    together): a rebuild starts them with the stage, so they warm up while it plans; an append
    starts them on its first shards (a resumed or empty one starts none). With one worker or
    Dask it has no pool.

    Plain processes rather than Prefect's process runner: a worker imports only the shard
    code (NumPy, Pillow, no Prefect, no TensorFlow), so it starts in a fraction of the time
    and memory, while every batch keeps its Prefect task run in the flow.
    """

    def __init__(self, params: ShardParams) -> None:
        self.params = params
        self.enabled = pool_workers(params) > 0
        self.pool: Executor | None = None
        self._stack = ExitStack()

    def __enter__(self) -> LocalWorkers:
        if workers_from_the_start(self.params):
            self._start()
        return self

    def __exit__(self, *exc: object) -> bool | None:
        return self._stack.__exit__(*exc)  # type: ignore[arg-type]

    def for_shards(self, specs: Iterable[ShardSpec]) -> Executor | None:
        """The pool to write ``specs`` in, started now if not yet; None without workers."""
        if self.pool is None and self.enabled:
            self._start()
        return self.pool

    def _start(self) -> None:
        self.pool = self._stack.enter_context(spawn_pool(self.params.workers, warm=warm_worker))
