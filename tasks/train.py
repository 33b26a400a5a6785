"""Train stage: validated shards in, a Keras model, its history and an MLflow run out.

``train`` is the pure core (shards in, model and metrics files out; no MLflow); ``run_train``
wraps it with the validation gate, tracking and the layout's paths. A killed run resumes at
the epoch it stopped at: Keras' BackupAndRestore keeps weights, optimizer state and the epoch,
and an epoch log beside it keeps the history of the epochs run before the kill.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from tasks.atomic import write_json
from tasks.gate import ShardsNotValidated as ShardsNotValidated  # re-exported for the flows
from tasks.gate import check_validated
from tasks.layout import Layout
from tasks.manifest import load_manifest
from tasks.models import build_model, unfreeze_top
from tasks.params import Params, TrainParams
from tasks.reader import read_split

FINE_TUNE_LR_FACTOR = 0.1  # fine-tuning a pretrained backbone wants a much smaller step
HISTORY_KEYS = ("loss", "accuracy", "val_loss", "val_accuracy")


# -- devices, precision, determinism ------------------------------------------------------


def choose_strategy() -> tf.distribute.Strategy:
    """MirroredStrategy over every visible GPU when there is one, else the default strategy."""
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return tf.distribute.MirroredStrategy([gpu.name for gpu in gpus])
    return tf.distribute.get_strategy()


def on_gpu(strategy: tf.distribute.Strategy) -> bool:
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy places ops on the default device
        return bool(tf.config.list_logical_devices("GPU"))
    return any("GPU" in device.upper() for device in devices)


def precision_policy(params: TrainParams, *, gpu: bool) -> str:
    """float16 on GPU (tensor cores); bfloat16 on CPU, where float16 math is emulated."""
    if not params.mixed_precision:
        return "float32"
    return "mixed_float16" if gpu else "mixed_bfloat16"


def device_tags(params: TrainParams, strategy: tf.distribute.Strategy) -> dict[str, str]:
    """What the run ran on, for tracking: device type, replicas, precision, XLA."""
    gpu = on_gpu(strategy)
    return {
        "device.type": "gpu" if gpu else "cpu",
        "device.num_replicas": str(strategy.num_replicas_in_sync),
        "device.strategy": type(strategy).__name__,
        "device.precision_policy": precision_policy(params, gpu=gpu),
        "device.xla": str(params.xla).lower(),
    }


def seed_everything(params: TrainParams) -> None:
    """Seed Python, NumPy and TF; with ``deterministic`` CPU runs repeat bit for bit."""
    keras.utils.set_random_seed(params.seed)
    if params.deterministic:
        tf.config.experimental.enable_op_determinism()


# -- callbacks -----------------------------------------------------------------------------


class ThroughputTimer(keras.callbacks.Callback):
    """Adds ``images_per_sec`` and ``step_time_ms`` (training steps only) to epoch logs."""

    def __init__(self, global_batch_size: int) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self._start = self._last = 0.0
        self._steps = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = self._last = time.perf_counter()
        self._steps = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._steps += 1
        self._last = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        seconds = max(self._last - self._start, 1e-9)
        if logs is not None and self._steps:
            logs["images_per_sec"] = self._steps * self.global_batch_size / seconds
            logs["step_time_ms"] = 1000 * seconds / self._steps


class EpochLog(keras.callbacks.Callback):
    """Appends each epoch's logs to a JSON-lines file that survives a killed run.

    On a resumed run the first epoch seen says where training restarted; lines from that
    epoch on (written after the last backup) are dropped before new ones are added.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.first_epoch: int | None = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.first_epoch is None:
            self.first_epoch = epoch
            kept = [row for row in read_epoch_log(self.path) if row["epoch"] < epoch]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs if logs is not None else {}
        logs["learning_rate"] = float(
            keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
        )
        row = {"epoch": epoch, **{key: float(value) for key, value in logs.items()}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")


class MlflowEpochMetrics(keras.callbacks.Callback):
    """Logs every epoch's metrics to an MLflow run in one batched call per epoch."""

    def __init__(self, mlflow_client: Any, run_id: str) -> None:
        super().__init__()
        self.client = mlflow_client
        self.run_id = run_id

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, epoch) for key, value in (logs or {}).items()]
        self.client.log_batch(self.run_id, metrics=metrics)


def read_epoch_log(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the core ------------------------------------------------------------------------------


def train(
    params: TrainParams,
    shards_dir: str | Path,
    *,
    model_file: str | Path,
    backup_dir: str | Path,
    metrics_file: str | Path | None = None,
    plot_file: str | Path | None = None,
    strategy: tf.distribute.Strategy | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> dict[str, Any]:
    """Train ``params.model`` on the shards' train split (val for early stopping).

    Writes the model (Keras format) to ``model_file`` and, when given, the history JSON and
    plot. Resumable: state lives in ``backup_dir`` until the run completes. ``batch_size`` is
    the global batch, split across the strategy's replicas. Returns a small summary dict.
    """
    shards_dir, model_file, backup_dir = Path(shards_dir), Path(model_file), Path(backup_dir)
    manifest = load_manifest(shards_dir)
    strategy = strategy or choose_strategy()
    seed_everything(params)
    steps_per_epoch = manifest.split("train").num_records // params.batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"train.batch_size={params.batch_size} exceeds the "
            f"{manifest.split('train').num_records} train records in {shards_dir}; lower it"
        )
    train_ds = read_split(
        shards_dir,
        "train",
        batch_size=params.batch_size,
        training=True,
        seed=params.seed,
        manifest=manifest,
    )
    val_ds = read_split(
        shards_dir, "val", batch_size=params.batch_size, training=False, manifest=manifest
    )
    epoch_log = EpochLog(backup_dir / "epochs.jsonl")
    standard = [ThroughputTimer(params.batch_size), epoch_log]
    if params.early_stopping_patience > 0:
        standard.append(
            keras.callbacks.EarlyStopping(
                patience=params.early_stopping_patience, restore_best_weights=True
            )
        )
    checkpoint = backup_dir.parent / "checkpoints" / "last.keras"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    standard.append(keras.callbacks.ModelCheckpoint(checkpoint, save_freq="epoch"))

    previous_policy = keras.mixed_precision.global_policy()
    policy = precision_policy(params, gpu=on_gpu(strategy))
    keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope():
            model = build_model(params, len(manifest.classes), manifest.record_schema.image_shape)
            compile_model(model, params, params.learning_rate, steps_per_epoch * params.epochs)
        main_done = backup_dir / "main_phase.keras"
        fine_tune = params.fine_tune_layers > 0 and params.fine_tune_epochs > 0
        if fine_tune and main_done.exists():
            # The frozen phase finished before the kill: pick up its weights, skip it.
            model.load_weights(main_done)
        else:
            fit_phase(
                model,
                train_ds,
                val_ds,
                params.epochs,
                0,
                backup_dir / "main",
                [*standard, *callbacks],
            )
            if fine_tune:
                model.save_weights(main_done)
        if fine_tune:
            done = len(read_epoch_log(epoch_log.path))
            with strategy.scope():
                unfreeze_top(model, params.fine_tune_layers)
                compile_model(
                    model,
                    params,
                    params.learning_rate * FINE_TUNE_LR_FACTOR,
                    steps_per_epoch * params.fine_tune_epochs,
                )
            fit_phase(
                model,
                train_ds,
                val_ds,
                done + params.fine_tune_epochs,
                done,
                backup_dir / "fine_tune",
                [*standard, *callbacks],
            )
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)

    rows = read_epoch_log(epoch_log.path)
    model_file.parent.mkdir(parents=True, exist_ok=True)
    model.save(model_file)
    summary = history_summary(rows)
    # After saving: the probe's extra steps change the in-memory weights, never the model file.
    summary["input_bound"] = probe_input_bound(model, train_ds)
    summary.update(
        model_file=str(model_file),
        fingerprint=manifest.fingerprint,
        resumed_from_epoch=epoch_log.first_epoch or 0,
        precision_policy=policy,
        strategy=type(strategy).__name__,
        num_replicas=strategy.num_replicas_in_sync,
    )
    if metrics_file is not None:
        write_json(Path(metrics_file), summary)
    if plot_file is not None:
        plot_history(rows, Path(plot_file))
    shutil.rmtree(backup_dir, ignore_errors=True)  # completed: nothing left to resume
    return summary


def probe_input_bound(
    model: keras.Model, train_ds: tf.data.Dataset, *, steps: int = 20, warmup: int = 3
) -> dict[str, float]:
    """Median train-step time fed by the shard reader over the same fed from memory.

    A ratio near 1 means the accelerator never waits for data; well above 1 means the input
    pipeline starves it. Logged per run so a starved accelerator shows in the MLflow UI.
    """
    real = train_ds.repeat()
    batch = next(iter(train_ds))
    synthetic = tf.data.Dataset.from_tensors(batch).repeat()
    real_s = _median_step_seconds(model, real, steps=steps, warmup=warmup)
    synthetic_s = _median_step_seconds(model, synthetic, steps=steps, warmup=warmup)
    return {
        "input_bound_ratio": real_s / synthetic_s,
        "step_ms_reader": real_s * 1000,
        "step_ms_in_memory": synthetic_s * 1000,
    }


def _median_step_seconds(
    model: keras.Model, ds: tf.data.Dataset, *, steps: int, warmup: int
) -> float:
    """Median seconds per ``train_on_batch`` step, waiting for the next batch included."""
    batches = iter(ds)
    times: list[float] = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        images, labels = next(batches)
        model.train_on_batch(images, labels)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def compile_model(model: keras.Model, params: TrainParams, lr: float, total_steps: int) -> None:
    schedule: float | keras.optimizers.schedules.LearningRateSchedule = lr
    if params.lr_schedule == "cosine":
        schedule = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(total_steps, 1))
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=params.xla,
    )


def fit_phase(
    model: keras.Model,
    train_ds: tf.data.Dataset,
    val_ds: tf.data.Dataset,
    epochs: int,
    initial_epoch: int,
    backup_dir: Path,
    callbacks: list[keras.callbacks.Callback],
) -> None:
    # BackupAndRestore goes first: it restores state before the others see an epoch, and
    # saves it at epoch end before a later callback can fail.
    backup = keras.callbacks.BackupAndRestore(str(backup_dir))
    model.fit(
        train_ds,
        validation_data=val_ds,
        epochs=epochs,
        initial_epoch=initial_epoch,
        callbacks=[backup, *callbacks],
        verbose=2,
    )


def history_summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Per-epoch lists, final values and throughput from the epoch log."""
    keys = sorted({key for row in rows for key in row} - {"epoch"})
    history = {key: [row.get(key) for row in rows] for key in keys}
    speeds = [row["images_per_sec"] for row in rows if "images_per_sec" in row]
    # The first epoch pays for tracing; report steady-state throughput when there is one.
    steady = speeds[1:] or speeds
    return {
        "epochs_completed": len(rows),
        "history": history,
        "final": {key: values[-1] for key, values in history.items() if values},
        "images_per_sec": sum(steady) / len(steady) if steady else None,
    }


def plot_history(rows: list[dict[str, float]], path: Path) -> None:
    """Loss and accuracy per epoch, train vs val, as a PNG (no pyplot, no global backend)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    epochs = [int(row["epoch"]) + 1 for row in rows]
    for axis, metric in zip(figure.subplots(1, 2), ("loss", "accuracy"), strict=True):
        for prefix, label in (("", "train"), ("val_", "val")):
            values = [row.get(prefix + metric) for row in rows]
            axis.plot(epochs, values, marker="o", label=label)
        axis.set_xlabel("epoch")
        axis.set_title(metric)
        axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")


# -- the stage -----------------------------------------------------------------------------


def run_train(
    params: Params,
    layout: Layout,
    *,
    strategy: tf.distribute.Strategy | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> dict[str, Any]:
    """Gate on validation, open (or resume) an MLflow run, train, record the run for evaluate."""
    from tasks import tracking

    manifest = check_validated(layout.shards_dir, layout.validation_report)
    strategy = strategy or choose_strategy()
    client = tracking.client(layout.root)
    run_id_file = layout.backup_dir / "mlflow_run_id"
    run_id = resume_run_id(client, run_id_file)
    if run_id is None:
        run_id = tracking.start_train_run(
            client,
            params,
            manifest,
            shards_dir=layout.shards_dir,
            root=layout.root,
            device_tags=device_tags(params.train, strategy),
        )
        run_id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id_file.write_text(run_id)
    try:
        summary = train(
            params.train,
            layout.shards_dir,
            model_file=layout.model_file,
            backup_dir=layout.backup_dir,
            metrics_file=layout.train_metrics,
            plot_file=layout.train_plot,
            strategy=strategy,
            callbacks=[MlflowEpochMetrics(client, run_id), *callbacks],
        )
    except BaseException:
        client.set_terminated(run_id, status="FAILED")  # the id stays in the backup to resume
        raise
    probe = summary.get("input_bound", {})
    if probe:
        from mlflow.entities import Metric

        client.log_batch(
            run_id,
            metrics=[
                Metric(key, float(value), int(time.time() * 1000), 0)
                for key, value in probe.items()
            ],
        )
    client.log_artifact(run_id, str(layout.train_metrics), "train")
    client.log_artifact(run_id, str(layout.train_plot), "train")
    client.set_terminated(run_id, status="FINISHED")
    run = client.get_run(run_id)
    record = {
        "run_id": run_id,
        "experiment_id": run.info.experiment_id,
        "tracking_uri": client.tracking_uri,
        "fingerprint": manifest.fingerprint,
        "run_name": run.info.run_name,
    }
    write_json(layout.train_run, record)
    return {**summary, **record}


def resume_run_id(client: Any, run_id_file: Path) -> str | None:
    """The MLflow run of an interrupted training, reopened, if the backup names one."""
    if not run_id_file.exists():
        return None
    run_id = run_id_file.read_text().strip()
    try:
        client.update_run(run_id, status="RUNNING")
    except Exception:  # the store was reset since: start a fresh run
        return None
    return run_id
