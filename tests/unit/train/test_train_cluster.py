"""Which process records a multi-worker run, and how many local workers a stage starts:
read from ``TF_CONFIG`` and ``SHARDFLOW_TRAIN_WORKERS`` without TensorFlow."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tasks.runtime.params import ParamsError
from tasks.train.cluster import (
    TF_CONFIG_ENV,
    WORKERS_ENV,
    config_is_chief,
    local_tf_configs,
    requested_workers,
)


def tf_config(task_type: str, index: int, *, chief: bool = False) -> str:
    cluster = {"worker": ["a:1", "b:2"], **({"chief": ["c:3"]} if chief else {})}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize(
    ("config", "records"),
    [
        (None, True),  # one process: it records
        (tf_config("worker", 0), True),  # no chief task: worker 0 is the chief
        (tf_config("worker", 1), False),
        (tf_config("worker", 0, chief=True), False),  # a chief task exists
        (tf_config("chief", 0, chief=True), True),
    ],
)
def test_the_chief_is_read_from_tf_config(
    config: str | None, records: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if config is None:
        monkeypatch.delenv(TF_CONFIG_ENV, raising=False)
    else:
        monkeypatch.setenv(TF_CONFIG_ENV, config)
    assert config_is_chief() is records


def test_local_workers_come_from_the_environment_not_under_a_platform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TF_CONFIG_ENV, raising=False)
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert requested_workers() == 1
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert requested_workers() == 3
    monkeypatch.setenv(TF_CONFIG_ENV, tf_config("worker", 1))
    assert requested_workers() == 1  # the platform started this worker: launch nothing
    monkeypatch.delenv(TF_CONFIG_ENV)
    monkeypatch.setenv(WORKERS_ENV, "two")
    with pytest.raises(ParamsError, match=r"SHARDFLOW_TRAIN_WORKERS='two'"):
        requested_workers()


def test_local_cluster_configs_name_distinct_ports_and_each_worker_once() -> None:
    configs = [json.loads(config) for config in local_tf_configs(3)]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    assert all(c["cluster"]["worker"] == addresses for c in configs)


def refuse(what: str, report: Callable[..., object]) -> None:
    """A worker that fails as training does before its first collective: every worker
    refuses the same param (``refused``), or fails on I/O (``transient``)."""
    if what == "refused":
        raise ParamsError("train.batch_size=73 exceeds the 72 train records; lower it")
    raise OSError("the shard store did not answer")
