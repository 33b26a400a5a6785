"""Shard writing through Prefect task runners: local processes and a Dask cluster agree."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tasks.layout import Layout
from tasks.params import ShardParams, default_params

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
    from tasks.shard import run_shard

    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 2}
    ).shard
    layout = Layout(tmp_path / "flow")
    result = run_flow(layout, tiny_index, params)
    inline = run_shard(params, tiny_index, tmp_path / "inline")
    assert int(str(result["written"])) == int(str(result["shards"])) > 3
    assert result["fingerprint"] == inline.fingerprint
    assert shard_bytes(layout.shards_dir) == shard_bytes(tmp_path / "inline")


def test_dask_runner_needs_an_address() -> None:
    from flows.shard import shard_task_runner

    with pytest.raises(ValueError, match="dask_address"):
        shard_task_runner(default_params().shard.model_copy(update={"runner": "dask"}))
