"""Two workers on 127.0.0.1 under MultiWorkerMirroredStrategy train the tiny shards with the
one training loop: identical weights on both, the single-worker accuracy, a dead worker
failing the run (no hang) and the rerun resuming.

Each worker is a spawned process with its own ``TF_CONFIG`` (tasks.train.cluster's local
launcher, as ``SHARDFLOW_TRAIN_WORKERS`` runs the stage).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import keras
import numpy as np
import pytest

from tasks.contracts.manifest import load_manifest
from tasks.evaluate.measurement import evaluate_model
from tasks.runtime.layout import Layout
from tasks.runtime.params import ParamsError, TrainParams, default_params
from tasks.train.backup import STEP_NAME, StepState
from tasks.train.cluster import Preempted, WorkerFailed, launch_local_workers
from tasks.train.loop import check_distributable
from tasks.train.stage import read_epoch_log
from tests.train_helpers import NO_AUGMENT, run

pytestmark = pytest.mark.slow


def train_stage(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The train stage's command, ``python -m flows.launch.train``, run in ``root`` with
    ``env``; its output kept, and 10 minutes at most."""
    return subprocess.run(
        [sys.executable, "-m", "flows.launch.train"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


PARAMS = default_params(
    train={"epochs": 4, "batch_size": 16, "early_stopping_patience": 0, "augment": NO_AUGMENT}
).train


class SaveFinalWeights(keras.callbacks.Callback):
    """Each worker's weights when training ends, to ``weights-<pid>.npz``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        np.savez(self.out / f"weights-{os.getpid()}.npz", *self.model.get_weights())


class DieMidEpoch(keras.callbacks.Callback):
    """SIGKILLs this worker a moment into ``epoch``: no exception, no cleanup."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.epoch:
            kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            threading.Timer(0.05, kill).start()


def sigterm_at(epoch: int, step: int) -> None:
    """In this worker: SIGTERM to itself as its training reaches ``step`` of ``epoch``."""
    from tasks.train import loop

    boundary = loop.call_boundary

    def term_then_boundary(*args: Any) -> None:
        if (args[3], args[5]) == (epoch, step):  # model, dirs, strategy, epoch, saves, step
            os.kill(os.getpid(), signal.SIGTERM)
        boundary(*args)

    loop.call_boundary = term_then_boundary  # type: ignore[assignment]


def worker(
    root: str, params_json: str, die_at: int | None, send: Callable[[object], None]
) -> dict[str, Any]:
    """What each spawned worker runs: the training core on ``root``'s shards."""
    from tasks.train.cluster import choose_strategy, is_chief

    strategy = choose_strategy()
    out = Path(root) / "weights"
    out.mkdir(exist_ok=True)
    callbacks: list[keras.callbacks.Callback] = [SaveFinalWeights(out)]
    if die_at is not None and not is_chief(strategy):
        callbacks.append(DieMidEpoch(die_at))
    return run(
        Path(root),
        TrainParams.model_validate_json(params_json),
        strategy=strategy,
        callbacks=callbacks,
    ).to_json()  # as it crosses back from the worker process


def terminated_worker(
    root: str, params_json: str, epoch: int, step: int, send: Callable[[object], None]
) -> dict[str, Any]:
    """:func:`worker`, worker 1 sending itself SIGTERM at ``step`` of ``epoch``."""
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        sigterm_at(epoch, step)
    return worker(root, params_json, None, send)


def two_workers(root: Path, *, die_at: int | None = None) -> dict[str, Any]:
    args = (str(root), PARAMS.model_dump_json(), die_at)
    return launch_local_workers(2, worker, args, grace_s=10.0)


def test_two_workers_end_with_identical_weights_and_single_worker_accuracy(
    tiny_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    summary = two_workers(tiny_shards)
    assert summary["strategy"] == "MultiWorkerMirroredStrategy"
    assert summary["num_workers"] == 2 and summary["num_replicas"] == 2
    assert summary["epochs_completed"] == PARAMS.epochs
    first, second = (np.load(path) for path in sorted((tiny_shards / "weights").glob("*.npz")))
    assert len(first.files) == len(second.files) > 0
    for name in first.files:
        np.testing.assert_array_equal(first[name], second[name])

    layout = Layout(tiny_shards)
    two = evaluate_model(layout.model_file, layout.shards_dir, tiny_shards / "eval2", top_k=1)
    single_root = tmp_path_factory.mktemp("single")
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(single_root)
    run(single_root, PARAMS)
    single_layout = Layout(single_root)
    one = evaluate_model(
        single_layout.model_file, single_layout.shards_dir, single_root / "eval1", top_k=1
    )
    assert one["accuracy"] >= 0.8  # chance is 1/3
    assert two["accuracy"] >= one["accuracy"] - 0.1  # within noise of one worker
    assert not layout.backup_dir.exists()  # the chief cleaned up after the run


def test_worker_killed_mid_epoch_fails_the_run_and_the_rerun_resumes(tiny_shards: Path) -> None:
    layout = Layout(tiny_shards)
    with pytest.raises(WorkerFailed, match=r"worker 1 \(pid \d+\) died, exit code -9.*Rerun"):
        two_workers(tiny_shards, die_at=2)
    assert not layout.model_file.exists()
    logged = [row["epoch"] for row in read_epoch_log(layout.backup_dir / "epochs.jsonl")]
    assert logged == [0, 1]
    summary = two_workers(tiny_shards)
    assert summary["resumed_from_epoch"] == 2
    assert summary["epochs_completed"] == PARAMS.epochs
    rows = json.loads(layout.train_history.read_text())
    assert [row["epoch"] for row in rows] == [1, 2, 3, 4]


def test_a_sigterm_to_one_worker_stops_both_at_the_same_saved_step(
    tiny_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Worker 1 alone gets SIGTERM at step 2 of epoch 2: both agree on that step (a flag
    reduced over the workers at each call's end), both save it and stop; the rerun resumes
    there on every worker, each replica with its own BatchNorm moving statistics, and ends
    with the model file of an uninterrupted run on two workers."""
    layout = Layout(tiny_shards)
    params = PARAMS.model_copy(update={"epochs": 2})
    args = (str(tiny_shards), params.model_dump_json(), 1, 2)
    with pytest.raises(Preempted, match=r"epoch 2, step 2.*\(workers 0, 1 saved it and stopped\)"):
        launch_local_workers(2, terminated_worker, args, grace_s=30.0)
    chief = layout.backup_dir / "main" / STEP_NAME
    other = layout.backup_dir.with_name(f"{layout.backup_dir.name}-scratch") / "worker-1"
    for path in (chief, other / "main" / STEP_NAME):
        saved = StepState.from_json(json.loads(path.read_text()))
        assert (saved.epoch, saved.step) == (1, 2)
    assert not layout.model_file.exists()
    summary = launch_local_workers(2, worker, (str(tiny_shards), params.model_dump_json(), None))
    assert summary["resumed_from_epoch"] == 1
    assert summary["epochs_completed"] == 2

    whole = tmp_path_factory.mktemp("uninterrupted")
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(whole)
    launch_local_workers(2, worker, (str(whole), params.model_dump_json(), None))
    assert layout.model_file.read_bytes() == Layout(whole).model_file.read_bytes()


def test_fewer_train_files_than_workers_is_refused_naming_the_param(tiny_shards: Path) -> None:
    manifest = load_manifest(Layout(tiny_shards).shards_dir)  # 2 train files
    three = SimpleNamespace(num_replicas_in_sync=3, extended=SimpleNamespace(_num_workers=3))
    with pytest.raises(ParamsError, match=r"2 train shard files for 3 workers.*target_shard_mb"):
        check_distributable(PARAMS.model_copy(update={"batch_size": 18}), manifest, three)
    odd = PARAMS.model_copy(update={"batch_size": 17})
    two = SimpleNamespace(num_replicas_in_sync=2, extended=SimpleNamespace(_num_workers=2))
    with pytest.raises(ParamsError, match=r"train.batch_size=17 does not split over 2 replicas"):
        check_distributable(odd, manifest, two)


def test_the_stage_launches_local_workers_and_only_the_chief_records(
    tiny_shards: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SHARDFLOW_TRAIN_WORKERS=2``: what the train stage runs (tasks.train.child.train)."""
    from mlflow import MlflowClient

    from tasks.runtime.params import Params
    from tasks.train import child as train_child
    from tasks.train.cluster import WORKERS_ENV

    monkeypatch.setenv(WORKERS_ENV, "2")
    params = default_params().model_copy(update={"train": PARAMS})
    assert isinstance(params, Params)
    reported: list[int] = []
    summary = train_child.train(
        params, Layout(tiny_shards), report=lambda epoch, _: reported.append(epoch)
    )
    assert summary["strategy"] == "MultiWorkerMirroredStrategy" and summary["chief"]
    assert reported == list(range(PARAMS.epochs))  # the chief's epoch lines, once each
    client = MlflowClient(mlflow_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert [run.info.run_id for run in runs] == [summary["run_id"]]  # one run, the chief's
    steps = [m.step for m in client.get_metric_history(summary["run_id"], "train_loss")]
    assert sorted(steps) == list(range(PARAMS.epochs))  # logged by the chief alone
    assert client.get_run(summary["run_id"]).data.tags["device.num_workers"] == "2"
    assert Layout(tiny_shards).model_file.exists()


CHIEF_SCRIPT = """
import sys
from pathlib import Path
from tasks.runtime.params import TrainParams
from tests.train_helpers import run
run(Path(sys.argv[1]), TrainParams.model_validate_json(sys.argv[2]))
"""


def test_a_platform_worker_runs_the_stage_command_and_records_nothing(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 1 of a platform's ``TF_CONFIG`` runs ``python -m flows.train`` as the chief
    would: it trains beside the chief (here the training core), with no Prefect flow, no
    MLflow run and no output of its own."""

    import yaml

    from tasks.train.cluster import local_tf_configs

    merged = default_params(train=PARAMS.model_dump(mode="json")).model_dump(mode="json")
    (tiny_shards / "params.yaml").write_text(yaml.safe_dump(merged))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    chief_config, worker_config = local_tf_configs(2)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    chief = subprocess.Popen(
        [sys.executable, "-c", CHIEF_SCRIPT, str(tiny_shards), PARAMS.model_dump_json()],
        env={**env, "TF_CONFIG": chief_config},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    worker = train_stage(tiny_shards, {**env, "TF_CONFIG": worker_config})
    chief_output = chief.communicate(timeout=600)[0]
    assert chief.returncode == 0, chief_output[-3000:]
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "flow run" not in worker.stdout + worker.stderr.lower()  # no Prefect flow
    assert not list(tiny_shards.glob("mlflow*")) and not (tiny_shards / "mlruns").exists()
    layout = Layout(tiny_shards)
    assert layout.model_file.exists() and not layout.backup_dir.exists()
    rows = json.loads(layout.train_history.read_text())
    assert [row["epoch"] for row in rows] == [1, 2, 3, 4]  # the chief's, written once


CHIEF_BEFORE_TRAINING = """
import sys
import threading
import tensorflow  # imported before it says so: the worker's wait starts with the chief there
from tasks.train.cluster import choose_strategy
print("joining", flush=True)
choose_strategy(600.0)
if sys.argv[1] == "joins and fails":
    raise SystemExit("the tracking store is down")  # as a chief's refusal or failure ends it
threading.Event().wait()  # joined, and stuck before training (the tracking store, say)
"""


@pytest.mark.parametrize("chief", ["never starts", "joins and stalls", "joins and fails"])
def test_a_worker_whose_chief_never_reaches_training_fails_naming_why(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch, chief: str
) -> None:
    """A platform worker (``python -m flows.train`` under worker 1's ``TF_CONFIG``) whose
    chief never started waited in the strategy's cluster join, and one whose chief joined but
    never reached training waited in its first collective: both for good (only the local
    launcher stops its workers). Each now fails within ``cluster.join_timeout_s``, naming
    the wait and what keeps a chief away; one whose chief ended before training says so."""

    import yaml

    from tasks.train.cluster import local_tf_configs

    # Short where the wait itself is the point; long where the chief's end must be noticed
    # first, however long a loaded machine takes to end a TensorFlow process.
    join_timeout_s = 60 if chief == "joins and fails" else 2
    merged = default_params(
        train=PARAMS.model_dump(mode="json"), cluster={"join_timeout_s": join_timeout_s}
    ).model_dump(mode="json")
    (tiny_shards / "params.yaml").write_text(yaml.safe_dump(merged))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    chief_config, worker_config = local_tf_configs(2)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    chief_process = None
    if chief != "never starts":
        chief_process = subprocess.Popen(
            [sys.executable, "-c", CHIEF_BEFORE_TRAINING, chief],
            env={**env, "TF_CONFIG": chief_config},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert chief_process.stdout is not None and chief_process.stdout.readline() == "joining\n"
    try:
        # train_stage's timeout is a hang guard: without the bound the worker waited for good
        worker = train_stage(tiny_shards, {**env, "TF_CONFIG": worker_config})
    finally:
        if chief_process is not None:
            chief_process.kill()
            chief_process.wait()
    assert worker.returncode != 0
    said = {
        "never starts": "worker-1 waited 2 s (cluster.join_timeout_s) for the workers of "
        "TF_CONFIG's cluster to join",
        "joins and stalls": "worker-1 waited 2 s (cluster.join_timeout_s) for every worker of "
        "its cluster to reach training",
        "joins and fails": "worker-1 lost a worker of its cluster before training",
    }[chief]
    assert f"ClusterIncomplete: {said}" in worker.stderr, worker.stderr[-3000:]
    assert "the chief failed or stalled before training" in worker.stderr
    assert not Layout(tiny_shards).model_file.exists()
