"""Shard writing through Prefect task runners: local processes and a Dask cluster agree."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from tasks.runtime.layout import Layout
from tasks.runtime.params import ShardParams, default_params

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def shard_bytes(shards_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(shards_dir.iterdir())
        if not p.name.startswith(".")
    }


def run_flow(layout: Layout, index: Path, params: ShardParams) -> dict[str, object]:
    from flows.shard import shard_task_runner, write_shards_flow

    layout.index.parent.mkdir(parents=True, exist_ok=True)
    layout.index.write_bytes(index.read_bytes())
    flow = write_shards_flow.with_options(task_runner=shard_task_runner(params))
    return flow(params, layout)


def test_dask_runner_writes_the_same_bytes_as_local_processes(
    prefect_harness: None, tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distributed import LocalCluster

    base = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 2}
    ).shard
    local = Layout(tmp_path / "local")
    local_result = run_flow(local, tiny_index, base)

    # Dask workers import the project's modules: give them the repo on their path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with LocalCluster(
        n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None, processes=True
    ) as cluster:
        dask_params = base.model_copy(
            update={"runner": "dask", "dask_address": cluster.scheduler_address}
        )
        distributed = Layout(tmp_path / "dask")
        dask_result = run_flow(distributed, tiny_index, dask_params)

    assert local_result["shards"] == dask_result["shards"] and int(str(local_result["shards"])) > 3
    assert dask_result["fingerprint"] == local_result["fingerprint"]
    assert shard_bytes(distributed.shards_dir) == shard_bytes(local.shards_dir)


def test_flow_at_two_workers_writes_what_the_inline_stage_writes(
    prefect_harness: None, tiny_index: Path, tmp_path: Path
) -> None:
    """The flow's process-pool runner and the inline writer: same shards, same manifest."""
    from tasks.shard.stage import shard_stage

    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 2}
    ).shard
    layout = Layout(tmp_path / "flow")
    result = run_flow(layout, tiny_index, params)
    inline = shard_stage(params, tiny_index, tmp_path / "inline").manifest
    assert int(str(result["written"])) == int(str(result["shards"])) > 3
    assert result["fingerprint"] == inline.fingerprint
    assert shard_bytes(layout.shards_dir) == shard_bytes(tmp_path / "inline")


def test_the_summary_counts_the_shard_files_of_the_set_after_an_append(
    prefect_harness: None, tiny_index: Path, tmp_path: Path
) -> None:
    """The log line and result name the set's files: an append that added nothing said its
    whole set was "in 0 shard files"."""
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1}
    ).shard
    layout = Layout(tmp_path)
    built = run_flow(layout, tiny_index, params)
    appended = run_flow(layout, tiny_index, params.model_copy(update={"mode": "append"}))
    files = len(list(layout.shards_dir.glob("*.tfrecord-*[0-9]")))
    assert appended["written"] == 0 and appended["fingerprint"] == built["fingerprint"]
    assert built["shards"] == appended["shards"] == files > 3


def test_dask_runner_needs_an_address() -> None:
    from flows.shard import shard_task_runner

    with pytest.raises(ValueError, match="dask_address"):
        shard_task_runner(default_params().shard.model_copy(update={"runner": "dask"}))


def test_the_stage_takes_the_workers_its_entry_point_started(
    prefect_harness: None, tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m flows.shard` starts a rebuild's workers before importing Prefect: the run
    takes them (no second spawn) and writes the same bytes; a run that has no use for them
    (one worker) leaves none behind."""
    import tasks.shard.workers as shard
    from flows import shard as shard_flow
    from tasks.runtime import latency, processes

    spawned: list[int] = []
    real = processes.start_pool
    monkeypatch.setattr(processes, "start_pool", lambda n, warm: spawned.append(n) or real(n, warm))
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 2}
    ).shard

    def stage_run(name: str, run_params: ShardParams) -> Layout:
        layout = Layout(tmp_path / name)
        layout.index.parent.mkdir(parents=True, exist_ok=True)
        layout.index.write_bytes(tiny_index.read_bytes())
        shard_flow.run(run_params, layout)
        return layout

    shard.prestart_workers(params)
    assert spawned == [2]
    taken = stage_run("taken", params)
    assert spawned == [2] and not latency._prestarted
    plain = stage_run("plain", params)  # nothing prestarted: the run spawns its own
    assert spawned == [2, 2]
    assert shard_bytes(taken.shards_dir) == shard_bytes(plain.shards_dir)

    shard.prestart_workers(params)
    stage_run("one-worker", params.model_copy(update={"workers": 1}))
    assert spawned == [2, 2, 2] and not latency._prestarted


def test_a_batch_goes_to_the_pool_a_shard_at_a_time(tiny_index: Path, tmp_path: Path) -> None:
    """Each shard of a task's batch is its own pool job, so idle workers take the next shard
    of any running task; a failed shard cancels the batch's shards not yet started."""
    from concurrent.futures import Future

    from flows.shard import write_shards_task
    from tasks.shard.planning import plan_shards
    from tasks.shard.writing import write_shard

    params = default_params(shard={"image_size": [16, 16], "target_shard_mb": 0.002}).shard
    plan = plan_shards(params, tiny_index)
    specs = [plan[i] for i in range(3)]

    class Pool:  # runs each job at once; or fails the second and leaves the third pending
        def __init__(self, fail_second: bool) -> None:
            self.fail_second = fail_second
            self.jobs: list[tuple[Any, str, Future[Any]]] = []

        def submit(self, fn: Any, *args: Any) -> Future[Any]:
            future: Future[Any] = Future()
            self.jobs.append((fn, args[0].file, future))
            if not self.fail_second or len(self.jobs) == 1:
                future.set_result(fn(*args))
            elif len(self.jobs) == 2:
                future.set_exception(ValueError("shard failed"))
            return future

    pool = Pool(fail_second=False)
    results = write_shards_task.fn(specs, tmp_path / "ok", pool)
    assert [(fn, file) for fn, file, _ in pool.jobs] == [(write_shard, s.file) for s in specs]
    assert [r.file for r in results] == [spec.file for spec in specs]

    failing = Pool(fail_second=True)
    with pytest.raises(ValueError, match="shard failed"):
        write_shards_task.fn(specs, tmp_path / "failed", failing)
    assert len(failing.jobs) == 3 and failing.jobs[2][2].cancelled()
