"""Train stage: validated shards in, a Keras model, its history and an MLflow run out.

``train`` is the pure core (shards in, model and metrics files out; no MLflow); ``run_train``
wraps it with the validation gate, tracking and the layout's paths. A killed run resumes at
the epoch it stopped at: Keras' BackupAndRestore keeps weights, optimizer state and the epoch,
an epoch log beside it keeps the history of the epochs run before the kill, and the early
stopping state (wait, best value, best weights) is kept there too.

A backup is only resumed by the same run: ``identity.json`` in the backup records the train
params, the shards' fingerprint and the training code's version it was made with (and the
MLflow run it logs to). Any difference discards the backup, with the reason logged, and the
run starts over in a new MLflow run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tasks import manifest as manifest_module
from tasks import models, reader, schema
from tasks.atomic import write_json
from tasks.code_version import code_version
from tasks.gate import ShardsNotValidated as ShardsNotValidated  # re-exported for the flows
from tasks.gate import check_validated, check_validated_store
from tasks.layout import Layout
from tasks.manifest import ShardManifest, load_manifest
from tasks.metrics_files import split_numeric
from tasks.model_file import save_model
from tasks.models import build_model, unfreeze_top
from tasks.params import Params, TrainParams, flatten
from tasks.reader import read_split
from tasks.shard_store import ShardStore, open_store

log = logging.getLogger(__name__)  # a flow shows it in its run's log (flows.common.run_log)

FINE_TUNE_LR_FACTOR = 0.1  # fine-tuning a pretrained backbone wants a much smaller step
HISTORY_KEYS = ("loss", "accuracy", "val_loss", "val_accuracy")
IDENTITY_NAME = "identity.json"
MAIN_PHASE_WEIGHTS = "main_phase.weights.h5"  # Keras 3 saves weights only to *.weights.h5
MAIN_PHASE_DONE = "main_phase.json"  # written after the weights: the frozen phase's commit


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


# -- which backup may be resumed ----------------------------------------------------------


def training_code_version() -> str:
    """Version of the code that shapes a backup: model, training loop, reader, record schema."""
    return code_version(sys.modules[__name__], models, reader, schema, manifest_module)


def backup_identity(params: TrainParams, fingerprint: str) -> dict[str, Any]:
    """What a backup must have been made with to be resumed: params, shards and code."""
    return {
        "params": flatten(params, "train"),
        "fingerprint": fingerprint,
        "code_version": training_code_version(),
    }


def identity_changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Why a backup made with ``stored`` cannot be resumed by ``current``; [] when it can."""

    def show(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key]) if key in values else "(unset)"

    old, new = stored.get("params") or {}, current["params"]
    reasons = [
        f"{key} changed {show(old, key)} -> {show(new, key)}"
        for key in sorted(set(old) | set(new))
        if key not in old or key not in new or old[key] != new[key]
    ]
    if stored.get("fingerprint") != current["fingerprint"]:
        reasons.append(
            f"shards changed: fingerprint {str(stored.get('fingerprint'))[:12]} -> "
            f"{current['fingerprint'][:12]}"
        )
    if stored.get("code_version") != current["code_version"]:
        reasons.append(
            f"training code changed: version {stored.get('code_version')} -> "
            f"{current['code_version']}"
        )
    return reasons


def claim_backup(
    backup_dir: Path, identity: dict[str, Any]
) -> tuple[dict[str, Any] | None, list[str]]:
    """The stored identity of a backup this run may resume, else discard the backup.

    Returns ``(stored identity or None, reasons it was discarded)``. A backup without a
    readable identity (older versions wrote none) is discarded too: nobody can vouch for it.
    """
    if not backup_dir.exists() or not any(backup_dir.iterdir()):
        return None, []
    path = backup_dir / IDENTITY_NAME
    try:
        stored = json.loads(path.read_text())
        reasons = identity_changes(stored, identity)
    except FileNotFoundError:
        reasons = [f"{path} is missing (made by an older version)"]
    except (json.JSONDecodeError, AttributeError, KeyError) as error:
        reasons = [f"{path} is unreadable ({error})"]
    if not reasons:
        return stored, []
    discard_backup(backup_dir, reasons)
    return None, reasons


def discard_backup(backup_dir: Path, reasons: Sequence[str]) -> None:
    """Delete the backup and say why, so a rerun that starts over is never a surprise."""
    log.warning("backup discarded: %s (%s)", "; ".join(reasons), backup_dir)
    shutil.rmtree(backup_dir, ignore_errors=True)


def write_identity(backup_dir: Path, identity: dict[str, Any], run_id: str | None = None) -> None:
    write_json(backup_dir / IDENTITY_NAME, {**identity, "mlflow_run_id": run_id})


class BackupUnusable(RuntimeError):
    """A backup that passed the identity check still failed to restore (e.g. another shape)."""


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


class GuardedBackupAndRestore(keras.callbacks.BackupAndRestore):
    """BackupAndRestore that turns a failed restore into ``BackupUnusable``.

    ``train`` then discards the backup and starts over, so no backup can fail every rerun.
    """

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        try:
            super().on_train_begin(logs)
        except Exception as error:
            raise BackupUnusable(f"cannot restore {self.backup_dir}: {error}") from error


class ResumableEarlyStopping(keras.callbacks.EarlyStopping):
    """EarlyStopping whose wait count, best value and best weights survive a kill.

    Stock EarlyStopping resets in ``on_train_begin``, so a resumed run would forget how long
    it has waited and which weights were best. The state is saved at each epoch end in the
    phase's backup dir and restored when BackupAndRestore (earlier in the callback list)
    resumed at the epoch right after it.
    """

    def __init__(self, state_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_file = state_dir / "early_stopping.json"

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        resumed_at = getattr(self.model, "_initial_epoch", None)  # set by BackupAndRestore
        if not resumed_at or not self.state_file.exists():
            return
        state = json.loads(self.state_file.read_text())
        if state["epoch"] != resumed_at - 1:  # killed between the backup and this state
            log.warning(
                "early stopping state is from epoch %s, not %s: starting it afresh",
                state["epoch"] + 1,
                resumed_at,
            )
            return
        self.wait, self.best = state["wait"], state["best"]
        self.best_epoch, self.stopped_epoch = state["best_epoch"], state["stopped_epoch"]
        if state.get("best_weights"):
            with np.load(self.state_file.parent / state["best_weights"]) as arrays:
                self.best_weights = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        weights_name = None
        if self.best_weights is not None:
            # One file per best epoch, named in the state file: the state never points at
            # weights from another epoch, whenever the process dies.
            weights_name = f"early_stopping_best_{self.best_epoch}.npz"
            weights_path = self.state_file.parent / weights_name
            if not weights_path.exists():
                tmp = weights_path.with_name(f".{weights_name}.tmp")
                with tmp.open("wb") as handle:
                    np.savez(handle, *self.best_weights)
                os.replace(tmp, weights_path)
        best = None if self.best is None else float(self.best)
        write_json(
            self.state_file,
            {
                "epoch": epoch,
                "wait": self.wait,
                "best": best,
                "best_epoch": self.best_epoch,
                "stopped_epoch": self.stopped_epoch,
                "best_weights": weights_name,
            },
        )
        for stale in self.state_file.parent.glob("early_stopping_best_*.npz"):
            if stale.name != weights_name:
                stale.unlink()


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


class EpochReport(keras.callbacks.Callback):
    """Hands each finished epoch to ``report(epoch, figures)``, the figures as plain floats
    (picklable: the stage's report may go to a parent process).

    Passed to :func:`run_train` after its own callbacks, so the figures already carry
    throughput and the learning rate.
    """

    def __init__(self, report: Callable[[int, dict[str, float]], object]) -> None:
        super().__init__()
        self.report = report

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.report(epoch, {key: float(value) for key, value in (logs or {}).items()})


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
    summary_file: str | Path | None = None,
    history_file: str | Path | None = None,
    plot_file: str | Path | None = None,
    strategy: tf.distribute.Strategy | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    store: ShardStore | None = None,
) -> dict[str, Any]:
    """Train ``params.model`` on the shards' train split (val for early stopping).

    Writes the model (Keras format) to ``model_file`` and, when given, the numeric summary
    (``metrics_file``, what DVC shows as metrics), the rest of it (``summary_file``), the
    per-epoch rows (``history_file``, DVC plot data) and the plot. Resumable: state lives in
    ``backup_dir`` until the run completes, and is resumed only by a run with the same
    params, shards and training code (else discarded, with the reason logged).
    ``batch_size`` is the global batch, split across the strategy's
    replicas. With a ``store`` (tasks.shard_store) the shards are read from object storage
    instead of ``shards_dir``: the same records in the same order. Returns a small summary.
    """
    shards_dir, model_file, backup_dir = Path(shards_dir), Path(model_file), Path(backup_dir)
    manifest = store.manifest() if store else load_manifest(shards_dir)
    strategy = strategy or choose_strategy()
    steps_per_epoch = manifest.split("train").num_records // params.batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"train.batch_size={params.batch_size} exceeds the "
            f"{manifest.split('train').num_records} train records in {shards_dir}; lower it"
        )
    identity = backup_identity(params, manifest.fingerprint)
    stored, _ = claim_backup(backup_dir, identity)  # run_train may have claimed it already
    if stored is None:
        write_identity(backup_dir, identity)
    previous_policy = keras.mixed_precision.global_policy()
    policy = precision_policy(params, gpu=on_gpu(strategy))
    keras.mixed_precision.set_global_policy(policy)
    try:
        try:
            model, epoch_log, train_ds = fit_phases(
                params, manifest, shards_dir, backup_dir, strategy, callbacks, store
            )
        except BackupUnusable as error:
            # The identity matched but the state does not fit this model: start over once.
            discard_backup(backup_dir, [str(error)])
            write_identity(backup_dir, identity, (stored or {}).get("mlflow_run_id"))
            model, epoch_log, train_ds = fit_phases(
                params, manifest, shards_dir, backup_dir, strategy, callbacks, store
            )
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)

    rows = read_epoch_log(epoch_log.path)
    save_model(model, model_file)  # the same weights give the same bytes
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
    numbers, rest = split_numeric({k: v for k, v in summary.items() if k != "history"})
    if metrics_file is not None:
        write_json(Path(metrics_file), numbers)
    if summary_file is not None:
        write_json(Path(summary_file), rest)
    if history_file is not None:
        write_json(Path(history_file), history_rows(rows))
    if plot_file is not None:
        plot_history(rows, Path(plot_file))
    shutil.rmtree(backup_dir, ignore_errors=True)  # completed: nothing left to resume
    return summary


def fit_phases(
    params: TrainParams,
    manifest: ShardManifest,
    shards_dir: Path,
    backup_dir: Path,
    strategy: tf.distribute.Strategy,
    callbacks: Sequence[keras.callbacks.Callback],
    store: ShardStore | None = None,
) -> tuple[keras.Model, EpochLog, tf.data.Dataset]:
    """Build the model and fit it: the frozen (or only) phase, then fine-tuning if asked.

    Each phase resumes from its own BackupAndRestore dir. The frozen phase commits its end
    weights and epoch count before its backup goes, so a kill between the phases resumes
    fine-tuning from those weights instead of redoing the frozen phase.
    """
    seed_everything(params)
    steps_per_epoch = manifest.split("train").num_records // params.batch_size
    train_ds = read_split(
        shards_dir,
        "train",
        batch_size=params.batch_size,
        training=True,
        seed=params.seed,
        manifest=manifest,
        store=store,
    )
    val_ds = read_split(
        shards_dir,
        "val",
        batch_size=params.batch_size,
        training=False,
        manifest=manifest,
        store=store,
    )
    epoch_log = EpochLog(backup_dir / "epochs.jsonl")
    checkpoint = backup_dir.parent / "checkpoints" / "last.keras"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)

    def phase_callbacks(phase_dir: Path) -> list[keras.callbacks.Callback]:
        standard: list[keras.callbacks.Callback] = [ThroughputTimer(params.batch_size), epoch_log]
        if params.early_stopping_patience > 0:
            standard.append(
                ResumableEarlyStopping(
                    phase_dir, patience=params.early_stopping_patience, restore_best_weights=True
                )
            )
        standard.append(keras.callbacks.ModelCheckpoint(checkpoint, save_freq="epoch"))
        return [*standard, *callbacks]

    with strategy.scope():
        model = build_model(params, len(manifest.classes), manifest.record_schema.image_shape)
        compile_model(model, params, params.learning_rate, steps_per_epoch * params.epochs)
    fine_tune = params.fine_tune_layers > 0 and params.fine_tune_epochs > 0
    main_weights, main_done = backup_dir / MAIN_PHASE_WEIGHTS, backup_dir / MAIN_PHASE_DONE
    if fine_tune and main_done.exists():
        # The frozen phase finished before the kill: pick up its weights, skip it.
        try:
            with warnings.catch_warnings():
                # The file holds the frozen phase's optimizer too; fine-tuning starts a new one.
                warnings.filterwarnings("ignore", message="Skipping variable loading for optim")
                model.load_weights(main_weights)
        except Exception as error:
            raise BackupUnusable(f"cannot load {main_weights}: {error}") from error
        done = int(json.loads(main_done.read_text())["epochs_completed"])
    else:
        main_dir = backup_dir / "main"
        fit_phase(model, train_ds, val_ds, params.epochs, 0, main_dir, phase_callbacks(main_dir))
        done = len(read_epoch_log(epoch_log.path))
        if fine_tune:
            tmp = backup_dir / f"tmp-{MAIN_PHASE_WEIGHTS}"
            model.save_weights(tmp)
            os.replace(tmp, main_weights)
            write_json(main_done, {"epochs_completed": done})
            shutil.rmtree(main_dir, ignore_errors=True)
    if fine_tune:
        with strategy.scope():
            unfreeze_top(model, params.fine_tune_layers)
            compile_model(
                model,
                params,
                params.learning_rate * FINE_TUNE_LR_FACTOR,
                steps_per_epoch * params.fine_tune_epochs,
            )
        tune_dir = backup_dir / "fine_tune"
        fit_phase(
            model,
            train_ds,
            val_ds,
            done + params.fine_tune_epochs,
            done,
            tune_dir,
            phase_callbacks(tune_dir),
        )
    return model, epoch_log, train_ds


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
    # saves it at epoch end before a later callback can fail. Its backup stays until
    # `train` completes (the frozen phase's is removed once its weights are committed).
    backup = GuardedBackupAndRestore(str(backup_dir), delete_checkpoint=False)
    # Keras keeps the epoch a BackupAndRestore restored on the model, and prefers it over
    # `initial_epoch`: clear it so a phase never starts at the previous phase's epoch.
    model._initial_epoch = None
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


def history_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """The epoch log as DVC plot rows: ``epoch`` counted from 1, as the PNG shows it."""
    return [{**row, "epoch": int(row["epoch"]) + 1} for row in rows]


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
    run_tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Gate on validation, open (or resume) an MLflow run, train, record the run for evaluate.

    ``run_tags``: the orchestrator's tags for a new MLflow run (the flow run that trains)."""
    from tasks import tracking

    store = open_store(layout.root, params.storage)  # SHARDFLOW_SHARDS_URL, else data/shards
    if store:
        manifest = check_validated_store(store, layout.validation_report)
    else:
        manifest = check_validated(layout.shards_dir, layout.validation_report)
    strategy = strategy or choose_strategy()
    client = tracking.client(layout.root)
    identity = backup_identity(params.train, manifest.fingerprint)
    stored, discarded = claim_backup(layout.backup_dir, identity)
    run_id = resume_run_id(client, (stored or {}).get("mlflow_run_id"))
    resumed = run_id is not None
    if run_id is None:
        run_id = tracking.start_train_run(
            client,
            params,
            manifest,
            shards_dir=store.url if store else layout.shards_dir,
            root=layout.root,
            device_tags=device_tags(params.train, strategy),
            run_tags=run_tags,
        )
        if discarded:  # the run says why it did not resume the backup it found
            client.set_tag(run_id, "resume.backup_discarded", "; ".join(discarded)[:5000])
    write_identity(layout.backup_dir, identity, run_id)
    try:
        with tracking.system_metrics(client, run_id, resume=resumed):
            summary = train(
                params.train,
                layout.shards_dir,
                model_file=layout.model_file,
                backup_dir=layout.backup_dir,
                metrics_file=layout.train_metrics,
                summary_file=layout.train_summary,
                history_file=layout.train_history,
                plot_file=layout.train_plot,
                strategy=strategy,
                callbacks=[MlflowEpochMetrics(client, run_id), *callbacks],
                store=store,
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
    for path in (layout.train_metrics, layout.train_summary, layout.train_history):
        client.log_artifact(run_id, str(path), "train")
    client.log_artifact(run_id, str(layout.train_plot), "train")
    client.set_terminated(run_id, status="FINISHED")
    run = client.get_run(run_id)
    record = {
        "run_id": run_id,
        "experiment_id": run.info.experiment_id,
        "tracking_uri": tracking.recorded_uri(client.tracking_uri, layout.root),
        "fingerprint": manifest.fingerprint,
        "run_name": run.info.run_name,
    }
    write_json(layout.train_run, record)
    return {**summary, **record}


def resume_run_id(client: Any, run_id: str | None) -> str | None:
    """The MLflow run of an interrupted training, reopened, if its backup names one."""
    if not run_id:
        return None
    try:
        client.update_run(run_id, status="RUNNING")
    except Exception:  # the store was reset since: start a fresh run
        return None
    return run_id
