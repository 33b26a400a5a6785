"""The training flow end to end on tiny validated shards, under a temporary Prefect server."""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from flows.training import training_flow
from tasks.evaluate import stage as tasks_evaluate
from tasks.evaluate.registry import logged_model_id
from tasks.evaluate.tracking import PER_CLASS_TABLE
from tasks.runtime import latency, tracking
from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.runtime.tracking import CHAMPION
from tasks.train import child as train_child
from tasks.train.stage import cpu_isa
from tests.prefect_story import artifacts, flow_runs_tagged, log_lines

# Every test here runs its flows on the session's Prefect server (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]
EPOCHS = 3
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tiny_shards: Path, mlflow_uri: str) -> Path:
    params = {
        "train": {
            "epochs": EPOCHS,
            "batch_size": 16,
            "learning_rate": 0.003,
            "early_stopping_patience": 0,
            "xla": True,  # asked for, and refused by Keras under op determinism
        },
        "evaluate": {"top_k": 2, "model_name": "tiny"},
    }
    merged = default_params(**params).model_dump(mode="json")  # the repo's params.yaml + these
    (tiny_shards / "params.yaml").write_text(yaml.safe_dump(merged))
    return tiny_shards


def test_flow_trains_evaluates_tracks_and_promotes(
    project: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    result = training_flow(root=str(project))
    layout = Layout(project)

    run_id = json.loads(layout.train_run.read_text())["run_id"]
    client = MlflowClient(mlflow_uri, mlflow_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(EPOCHS))  # one point per epoch
    # the training split's figures say so; the runs table shows no bare `accuracy`
    assert len(client.get_metric_history(run_id, "train_accuracy")) == EPOCHS
    assert "accuracy" not in run.data.metrics and "loss" not in run.data.metrics
    assert client.get_metric_history(run_id, "images_per_sec")
    # The input-bound probe lands on the run and in the train summary with the same figure
    # (metrics/train.json holds the figures compared across experiments only).
    probe = json.loads(layout.train_summary.read_text())["input_bound"]
    assert probe["step_ms_reader"] > 0 and probe["step_ms_in_memory"] > 0
    assert run.data.metrics["input_bound_ratio"] == pytest.approx(probe["input_bound_ratio"])
    # The figures of the epoch the model file holds, beside the last epoch's val_accuracy.
    trained = json.loads(layout.train_metrics.read_text())
    assert run.data.metrics["model_epoch"] == trained["model_epoch"]
    assert run.data.metrics["model_val_accuracy"] == pytest.approx(trained["model"]["val_accuracy"])
    assert run.data.params["train.epochs"] == str(EPOCHS)
    # The tag says how the step ran, not what params.yaml asked for.
    assert (
        run.data.params["train.xla"] == "True" and run.data.params["train.deterministic"] == "True"
    )
    assert run.data.tags["device.xla"] == "false"
    # Which CPU kernels made the weights: another instruction-set tier gives other last bits.
    assert run.data.tags["device.cpu_isa"] == cpu_isa()
    assert json.loads(layout.train_summary.read_text())["xla"] is False
    # Evaluation has a run of its own, a child of the training run, with its params.
    recorded = json.loads(layout.eval_summary.read_text())  # beside the numeric metrics
    evaluation_run = client.get_run(recorded["eval_run_id"])
    assert evaluation_run.data.tags["mlflow.parentRunId"] == run_id
    assert evaluation_run.data.params["evaluate.top_k"] == "2"
    assert evaluation_run.info.status == "FINISHED"

    evaluation = json.loads(layout.eval_metrics.read_text())
    assert run.data.metrics["test_accuracy"] == evaluation["accuracy"]
    assert evaluation["accuracy"] >= 0.8
    assert evaluation["num_test_records"] == 30
    assert recorded["test_fingerprint"] == run.data.tags["data.fingerprint"]
    assert recorded["promotion"]["promoted"] is True  # the first version becomes champion
    assert recorded["run_id"] == run_id and recorded["model_version"] == "1"
    assert evaluation_run.data.tags["promotion.decision"] == "promoted"
    champion = client.get_model_version_by_alias("tiny", CHAMPION)
    assert champion.run_id == run_id
    artifacts = {a.path for a in client.list_artifacts(evaluation_run.info.run_id, "eval")}
    assert "eval/confusion_matrix.png" in artifacts and "eval/misclassified.png" in artifacts

    # MLflow 3: the test split is an input beside train, and the test metrics are linked to
    # the registered model and to that dataset, so the model's page shows them.
    contexts = {
        tag.value: dataset_input.dataset
        for each in (run, evaluation_run)
        for dataset_input in each.inputs.dataset_inputs
        for tag in dataset_input.tags
        if tag.key == "mlflow.data.context"
    }
    assert set(contexts) == {"train", "test"}  # train on the training run, test on its child
    logged_model = client.get_logged_model(logged_model_id(client, run_id, "tiny", "1"))
    on_model = {m.key: m for m in logged_model.metrics or []}
    assert on_model["test_accuracy"].value == evaluation["accuracy"]
    assert on_model["test_macro_f1"].value == evaluation["macro_f1"]
    assert on_model["test_accuracy"].dataset_name == contexts["test"].name
    assert on_model["test_accuracy"].dataset_digest == contexts["test"].digest
    # The per-class table is an MLflow table, one row per class, the figures evaluation wrote.
    table = client.load_table(experiment_id=run.info.experiment_id, artifact_file=PER_CLASS_TABLE)
    per_class = json.loads((layout.eval_dir / "per_class.json").read_text())
    assert table["class"].tolist() == [row["class"] for row in per_class]
    assert table["recall"].tolist() == [row["recall"] for row in per_class]
    # System metrics were sampled into the run while it trained.
    assert client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    # The first run has no champion to compare with, and says so.
    assert "no champion yet" in run.data.tags["mlflow.note.content"]

    model = keras.saving.load_model(layout.model_file)
    images = np.zeros((7, 16, 16, 3), dtype=np.uint8)
    assert model.predict(images, verbose=0).shape == (7, 3)
    assert result["evaluate"]["promotion"]["promoted"] is True


def test_stage_entry_points_run_one_stage_each_and_tell_their_story(
    project: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the dvc.yaml stages run: `python -m flows.launch.train`, then `python -m
    flows.launch.evaluate`, each task in the child its command started.

    Through the Prefect API: both runs share the pipeline tag and are named after the MLflow
    run; the train run logs every epoch line (reported from its child), its progress artifact
    reaches 100 and a link artifact leads to the MLflow run's page."""
    from flows import evaluate, train
    from flows.launch import evaluate as launch_evaluate
    from flows.launch import train as launch_train

    layout = Layout(project)
    monkeypatch.chdir(project)
    monkeypatch.setenv("SHARDFLOW_PIPELINE_ID", "train-story")
    monkeypatch.setattr("sys.argv", ["flows.train"])
    launch_train.prestart()  # what `python -m flows.launch.train` does first
    trainer = latency._standing_by[train_child.warm_up]
    train.main()
    assert layout.model_file.exists() and not layout.eval_metrics.exists()
    # The training ran in that child (its epochs reported back, below), which is gone.
    assert latency.standby_child(train_child.warm_up) is None
    assert not trainer._process.is_alive()  # type: ignore[attr-defined]
    monkeypatch.setattr("sys.argv", ["flows.evaluate"])
    launch_evaluate.prestart()  # what `python -m flows.launch.evaluate` does first
    child = latency._standing_by[tasks_evaluate.warm_up]
    evaluate.main()
    assert json.loads(layout.eval_summary.read_text())["model_version"] == "1"
    # The evaluation ran in that child, which is gone: nothing is left standing by.
    assert latency.standby_child(tasks_evaluate.warm_up) is None
    assert not child._process.is_alive()  # type: ignore[attr-defined]

    record = json.loads(layout.train_run.read_text())
    runs = flow_runs_tagged("pipeline:train-story")
    assert set(runs) == {"train", "evaluate"}
    assert runs["train"].name == f"train · {record['run_name']}"
    assert runs["evaluate"].name == f"evaluate · {record['run_name']}"
    assert record["run_name"].endswith(record["fingerprint"][:8])
    assert "stage:train" in runs["train"].tags and "stage:evaluate" in runs["evaluate"].tags

    client = MlflowClient(mlflow_uri, mlflow_uri)
    loss, val_accuracy = (
        sorted(client.get_metric_history(record["run_id"], key), key=lambda m: m.step)
        for key in ("train_loss", "val_accuracy")
    )
    lines = log_lines(runs["train"].id)
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == EPOCHS == len(loss)
    for number, line in enumerate(epochs, start=1):  # the same figures MLflow recorded
        assert line.startswith(f"epoch {number}/{EPOCHS}: loss {loss[number - 1].value:.4f}")
        assert f"val_accuracy {val_accuracy[number - 1].value:.4f}" in line
    assert any(line.startswith(f"trained {record['run_name']}: {EPOCHS} epochs") for line in lines)

    train_artifacts = artifacts(runs["train"].id)
    assert train_artifacts["train-progress"].data == 100
    assert artifacts(runs["evaluate"].id)["evaluate-progress"].data == 100
    page = f"#/experiments/{record['experiment_id']}/runs/{record['run_id']}"
    page += tracking.RUNS_TABLE_QUERY
    for run in runs.values():
        link = artifacts(run.id)["mlflow-run"]
        assert link.type == "markdown"  # how Prefect stores a link artifact: [text](url)
        assert link.data == f"[MLflow run {record['run_name']}]({tracking.MLFLOW_UI_URL}/{page})"
    evaluated = json.loads(layout.eval_metrics.read_text())
    assert any(
        f"accuracy {evaluated['accuracy']:.4f}" in line and "promoted to champion" in line
        for line in log_lines(runs["evaluate"].id)
    )


def test_a_stage_that_plots_and_imports_keras_writes_nothing_into_the_users_home(
    project: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`python -m flows.train` (what `dvc repro` runs) trains with Keras and plots its history
    with Matplotlib: Keras wrote ~/.keras/keras.json and Matplotlib its font cache into
    ~/.cache/matplotlib (and read ~/.config/matplotlib/matplotlibrc). Their files now go
    to the repository's .shardflow/, and the home stays as it was."""
    import os

    from prefect.settings import PREFECT_API_URL

    from tests.integration.test_train_multiworker import train_stage

    # Prefect's home is the clone's .prefect/, by the repository's prefect.toml.
    (project / "prefect.toml").write_text((REPO / "prefect.toml").read_text())
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "HOME": str(home), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    for name in ("KERAS_HOME", "MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        env.pop(name, None)  # each library's default: a folder in the home
    done = train_stage(project, env)
    assert done.returncode == 0, done.stderr[-4000:]
    layout = Layout(project)
    assert layout.model_file.exists() and layout.train_plot.exists()
    assert sorted(str(path.relative_to(home)) for path in home.rglob("*")) == []
    assert (project / ".shardflow" / "keras" / "keras.json").is_file()
    assert list((project / ".shardflow" / "matplotlib").glob("fontlist-*.json"))


def test_summary_of_skipped_stages_reads_the_recorded_run(tmp_path: Path) -> None:
    """A deployment run that skips train/evaluate still tells the story of the current model."""
    from flows.training import _recorded, summary_markdown

    layout = Layout(tmp_path)
    recorded_files = (layout.train_metrics, layout.train_summary, layout.train_run)
    assert _recorded(*recorded_files) is None
    for folder in (layout.train_metrics.parent, layout.train_summary.parent, layout.model_dir):
        folder.mkdir(parents=True)
    train = {  # the numbers DVC shows as metrics ...
        "epochs_completed": 3,
        "resumed_from_epoch": 0,
        "images_per_sec": 100.0,
        "num_replicas": 1,
        "input_bound": {"input_bound_ratio": 1.01},
        "final": {"val_accuracy": 0.75},
    }
    layout.train_metrics.write_text(json.dumps(train))
    # ... and the strings beside them
    summary = {"precision_policy": "float32", "fingerprint": "f" * 64}
    layout.train_summary.write_text(json.dumps(summary))
    layout.train_run.write_text(json.dumps({"run_id": None, "fingerprint": "f" * 64}))
    recorded = _recorded(*recorded_files)
    assert recorded is not None and recorded["epochs_completed"] == 3
    text = summary_markdown(recorded, None, layout, skipped=["train"])
    assert "up to date, not rerun: train" in text
    assert "f" * 64 in text and "1.010" in text and "0.7500" in text


@pytest.mark.parametrize(
    ("train", "store_down", "attempts"),
    [({"batch_size": 73}, False, 1), ({"batch_size": 16}, True, 2)],
    ids=["a refusal runs once", "an I/O failure is retried"],
)
def test_a_refused_param_fails_the_train_task_at_once_and_io_is_retried(
    tiny_shards: Path,
    mlflow_uri: str,
    monkeypatch: pytest.MonkeyPatch,
    train: dict[str, int],
    store_down: bool,
    attempts: int,
) -> None:
    """A refusal naming its param (a batch larger than the 72 train records) was retried
    like an I/O failure: the retry failed alike, 10 s later. Now only the tracking store
    down (an OSError) is retried."""
    from prefect import flow

    from flows.train import train_task
    from tasks.runtime.params import ParamsError

    real_train = train_child.train
    tried: list[int] = []

    def counted(*args: object, **kwargs: object) -> object:
        tried.append(1)
        return real_train(*args, **kwargs)  # type: ignore[arg-type]

    def store_unreachable(root: object) -> object:
        raise ConnectionError("the tracking store did not answer")

    monkeypatch.setattr(train_child, "train", counted)
    if store_down:
        monkeypatch.setattr(tracking, "client", store_unreachable)
    params = default_params(train=train)
    layout = Layout(tiny_shards)

    @flow
    def one_task() -> object:
        return train_task.with_options(retry_delay_seconds=0)(params, layout)

    expected = (ConnectionError, "tracking store") if store_down else (ParamsError, "73")
    with pytest.raises(expected[0], match=expected[1]):
        one_task()
    assert len(tried) == attempts


def test_a_cluster_that_did_not_come_together_is_not_retried(
    tiny_shards: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's ClusterIncomplete (its chief never reached training) says to start every
    worker again: the task does not retry it in a process whose collectives are configured."""
    from prefect import flow

    from flows.train import train_task
    from tasks.train.cluster import ClusterIncomplete

    tried: list[int] = []

    def incomplete(*args: object, **kwargs: object) -> object:
        tried.append(1)
        raise ClusterIncomplete("worker-1 waited 2 s (cluster.join_timeout_s)")

    monkeypatch.setattr(train_child, "train", incomplete)

    @flow
    def one_task() -> object:
        return train_task.with_options(retry_delay_seconds=0)(default_params(), Layout(tiny_shards))

    with pytest.raises(ClusterIncomplete, match=r"cluster\.join_timeout_s"):
        one_task()
    assert len(tried) == 1


def test_training_stopped_by_sigterm_is_not_retried(
    tiny_shards: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop on SIGTERM (the state saved, the process asked to end) is the stage's end:
    a retry would train on in a process the platform is ending."""
    from prefect import flow

    from flows.train import train_task
    from tasks.train.cluster import Preempted

    tried: list[int] = []

    def stopped(*args: object, **kwargs: object) -> object:
        tried.append(1)
        raise Preempted("stopped by SIGTERM at epoch 1, step 2")

    monkeypatch.setattr(train_child, "train", stopped)

    @flow
    def one_task() -> object:
        return train_task.with_options(retry_delay_seconds=0)(default_params(), Layout(tiny_shards))

    with pytest.raises(Preempted, match="SIGTERM"):
        one_task()
    assert tried == [1]


def test_sigterm_to_the_stage_process_stops_its_training_child_where_it_saved(
    project: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m flows.train` trains in the child it prestarted: a SIGTERM to the stage
    process (a platform ending it) reaches that child, which saves where it stands and
    stops; the stage ends with that stop (status 143 at its entry point) and the MLflow run
    is not marked finished."""
    import os
    import signal

    from flows import train
    from tasks.train import cluster
    from tasks.train.backup import EPOCH_NAME, STEP_NAME
    from tasks.train.cluster import Preempted

    written = yaml.safe_load((project / "params.yaml").read_text())
    written["train"]["epochs"] = 30  # the child trains on long after the first epoch's line
    (project / "params.yaml").write_text(yaml.safe_dump(written))
    line = train.epoch_line

    def first_line_then_sigterm(epoch: int, planned: int, logs: dict[str, float]) -> str:
        if epoch == 0:  # the child is training on: the stage is asked to end
            os.kill(os.getpid(), signal.SIGTERM)
        return line(epoch, planned, logs)

    monkeypatch.setattr(train, "epoch_line", first_line_then_sigterm)
    monkeypatch.chdir(project)
    monkeypatch.setattr("sys.argv", ["flows.train"])
    handler = signal.getsignal(signal.SIGTERM)
    latency.prestart_child(train_child.warm_up)  # what `python -m flows.launch.train` does
    try:
        with pytest.raises(Preempted, match="stopped by SIGTERM"):
            train.main()
    finally:
        signal.signal(signal.SIGTERM, handler)
        cluster._stop_asked.clear()  # this process trained nothing; its own request goes
    layout = Layout(project)
    assert not layout.model_file.exists()
    main = layout.backup_dir / "main"
    committed = json.loads((main / EPOCH_NAME).read_text())["epoch"]
    saved = json.loads((main / STEP_NAME).read_text()) if (main / STEP_NAME).exists() else {}
    assert 0 <= committed < 29 and saved.get("epoch", committed + 1) == committed + 1
    run_id = json.loads((layout.backup_dir / "identity.json").read_text())["mlflow_run_id"]
    assert MlflowClient(mlflow_uri, mlflow_uri).get_run(run_id).info.status == "FAILED"
