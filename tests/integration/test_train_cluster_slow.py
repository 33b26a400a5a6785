"""A refusal on a cluster's workers, in worker processes (the fast tests:
tests/unit/train/test_train_cluster.py)."""

from __future__ import annotations

import pytest

from tasks.runtime.params import ParamsError
from tasks.train.cluster import (
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
