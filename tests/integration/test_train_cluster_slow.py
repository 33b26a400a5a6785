"""A refusal on a cluster's workers, in worker processes (the fast tests:
tests/unit/train/test_train_cluster.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.runtime.params import ParamsError
from tasks.train.cluster import (
    CLUSTER_STARTS,
    PORT_TAKEN,
    TF_CONFIG_ENV,
    WorkerFailed,
    launch_local_workers,
)
from tests.unit.train.test_train_cluster import refuse

pytestmark = pytest.mark.slow


def test_a_refusal_on_the_workers_fails_the_run_with_it_and_an_io_error_says_rerun() -> None:
    """The launcher said "Rerun the train stage" of every failure, a refusal of the params
    included, which a rerun repeats: a refusal now comes back as itself (not retried)."""
    with pytest.raises(ParamsError, match=r"^train\.batch_size=73 exceeds") as refused:
        launch_local_workers(2, refuse, ("refused",), grace_s=60.0)
    assert "Rerun" not in str(refused.value)
    with pytest.raises(WorkerFailed, match=r"worker \d failed: OSError: the shard store.*Rerun"):
        launch_local_workers(2, refuse, ("transient",), grace_s=60.0)


def port_taken_first(folder: str, starts: int, report: Callable[..., object]) -> str:
    """Worker 1 fails as TensorFlow does when another process took its port, on its first
    ``starts`` starts, and the chief then fails as its collectives do without a peer; once
    worker 1 binds, the chief answers with its port."""
    config = json.loads(os.environ[TF_CONFIG_ENV])
    index, cluster = config["task"]["index"], config["cluster"]["worker"]
    with (Path(folder) / f"worker-{index}.ports").open("a") as seen:
        seen.write(cluster[index] + "\n")
    seen_by_1 = Path(folder) / "worker-1.ports"
    if index == 1:
        if len(seen_by_1.read_text().split()) <= starts:
            raise RuntimeError(f"UnknownError: {PORT_TAKEN}")
        return cluster[1]
    while not seen_by_1.exists() or cluster[1] not in seen_by_1.read_text().split():
        time.sleep(0.05)  # this start's worker 1 is up (the test's timeout bounds the wait)
    if len(seen_by_1.read_text().split()) <= starts:
        raise RuntimeError("UnavailableError: Collective ops is aborted: task 1 is unhealthy")
    return cluster[0]


def test_a_port_taken_before_a_worker_binds_it_starts_the_cluster_again(tmp_path: Path) -> None:
    """The ports are free when picked and bound seconds later: a worker that finds its port
    taken starts the cluster again on other ports, up to CLUSTER_STARTS times, then fails."""
    chief = launch_local_workers(2, port_taken_first, (str(tmp_path), 1), grace_s=60.0)
    ports = [(tmp_path / f"worker-{i}.ports").read_text().split() for i in (0, 1)]
    assert [len(p) for p in ports] == [2, 2] and chief == ports[0][-1]
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(WorkerFailed, match=f"worker 1 failed: RuntimeError: .*{PORT_TAKEN}"):
        launch_local_workers(2, port_taken_first, (str(again), 9), grace_s=60.0)
    assert len((again / "worker-1.ports").read_text().split()) == CLUSTER_STARTS
