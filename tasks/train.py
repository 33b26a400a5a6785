"""Train stage: validated shards in, a Keras model, its history and an MLflow run out.

``train`` is the pure core (shards in, model and metrics files out; no MLflow); ``run_train``
wraps it with the validation gate, tracking and the layout's paths. One training loop runs
under every ``tf.distribute`` strategy: the default one (one device), MirroredStrategy (every
local GPU) and MultiWorkerMirroredStrategy (workers under ``TF_CONFIG``, see
``tasks.train_cluster``). Keras 3's ``model.fit`` fails under the multi-worker strategy
(keras-team/keras#20585), so the loop is ours: :func:`train_step` under ``strategy.run``,
driving the same Keras callbacks ``fit`` would.

``train.batch_size`` is the global batch: split across every replica of every worker, so a
single-device run means what it always did and more replicas do not change the step count.

A killed run resumes at the epoch after the last one committed (``tasks.train_backup``),
and only as the same run: same params, shards and training code. With several workers the
chief decides which backup is resumed and records every output (the model, the metrics,
MLflow); the others train beside it and write only scratch copies.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tasks import models, train_backup
from tasks.atomic import write_json
from tasks.code_version import code_version
from tasks.gate import ShardsNotValidated as ShardsNotValidated  # re-exported for the flows
from tasks.gate import check_validated, check_validated_store
from tasks.layout import Layout
from tasks.manifest import ShardManifest, load_manifest
from tasks.metrics_files import split_numeric
from tasks.model_file import save_model
from tasks.models import build_model, unfreeze_top
from tasks.params import Params, ParamsError, TrainParams, flatten
from tasks.reader import read_split
from tasks.shard_store import ShardStore, open_store
from tasks.tf_imports import keras_without_extras
from tasks.train_backup import (
    EPOCH_LOG_NAME,
    BackupDirs,
    BackupUnusable,
    claim_backup,
    discard_backup,
    log,
    read_epoch_log,
    write_identity,
)
from tasks.train_backup import IDENTITY_NAME as IDENTITY_NAME  # re-exported
from tasks.train_backup import identity_changes as identity_changes  # re-exported
from tasks.train_callbacks import (
    EpochLog,
    MlflowEpochMetrics,
    ResumableEarlyStopping,
)
from tasks.train_cluster import (
    chief_value,
    choose_strategy,
    is_chief,
    meet,
    num_workers,
    strategy_name,
    worker_name,
)

FINE_TUNE_LR_FACTOR = 0.1  # fine-tuning a pretrained backbone wants a much smaller step
MOVING_STATISTICS = ("moving_mean", "moving_variance")  # BatchNormalization's, by name


# -- devices, precision, determinism ------------------------------------------------------


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


# The x86 instruction sets oneDNN (TensorFlow's CPU kernels) chooses kernels by: a model
# trained on a CPU with other ones differs in its last bits (this VM with AVX-512 and the same
# run capped at AVX2 by ONEDNN_MAX_CPU_ISA gave two model files; each repeats exactly).
KERNEL_ISA_FLAGS = ("avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_isa(cpuinfo: str | None = None, cap: str | None = None) -> str:
    """The CPU's architecture and the :data:`KERNEL_ISA_FLAGS` it has (``cpuinfo``: the text
    of /proc/cpuinfo, read here when None; its flags are absent where it cannot be read), and
    the cap ``ONEDNN_MAX_CPU_ISA`` sets (``cap``; the environment's when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            flags = set(value.split())
            break
    present = " ".join(f for f in KERNEL_ISA_FLAGS if f in flags)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") if cap is None else cap
    capped = f" (ONEDNN_MAX_CPU_ISA={cap})" if cap else ""
    return f"{platform.machine()}: {present or 'flags unknown'}{capped}"


def device_tags(params: TrainParams, strategy: tf.distribute.Strategy) -> dict[str, str]:
    """What the run runs on, for tracking: device type, the CPU's kernel instruction sets
    (:func:`cpu_isa`), workers, replicas, precision (XLA is tagged once trained: Keras
    decides it with the model)."""
    gpu = on_gpu(strategy)
    return {
        "device.type": "gpu" if gpu else "cpu",
        "device.cpu_isa": cpu_isa(),
        "device.num_workers": str(num_workers(strategy)),
        "device.num_replicas": str(strategy.num_replicas_in_sync),
        "device.strategy": strategy_name(strategy),
        "device.precision_policy": precision_policy(params, gpu=gpu),
    }


def seed_everything(params: TrainParams) -> None:
    """Seed Python, NumPy and TF and number Keras's unnamed layers from the start again;
    with ``deterministic`` CPU runs repeat bit for bit, and so does the model file.

    Keras names an unnamed layer or optimizer after the ones the process made before
    (``input_layer``, then ``input_layer_1``, ...; keras.applications leaves its inputs
    unnamed) and the model file holds those names: a second run in one process (a
    deployment's, a retry, a resume after a failure) wrote other bytes for the same weights.
    """
    from keras.src.utils.naming import reset_uids  # the counter clear_session resets, alone

    keras.utils.set_random_seed(params.seed)
    reset_uids()
    if params.deterministic:
        tf.config.experimental.enable_op_determinism()


# -- which backup may be resumed ----------------------------------------------------------


def training_code_version() -> str:
    """Version of the code that shapes a backup: this module and every project module it
    imports (model, training loop, reader, record schema, ...)."""
    return code_version(sys.modules[__name__])


def backup_identity(
    params: TrainParams, fingerprint: str, lineage: dict[str, str]
) -> dict[str, Any]:
    """What a backup must have been made with to be resumed: params, the weights they name
    (``lineage``: :func:`tasks.models.weights_lineage`'s), shards and code."""
    return {
        "params": {**flatten(params, "train"), **lineage},
        "fingerprint": fingerprint,
        "code_version": training_code_version(),
    }


# -- the input, per worker -----------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    """What one worker trains and validates on: its share of the train files, as an endless
    iterator of distributed batches from a given epoch on, and the val split (read by the
    chief)."""

    batches: Callable[[int], Any]  # first epoch -> iterator over per-replica (images, labels)
    val: tf.data.Dataset
    steps_per_epoch: int
    global_batch: int


def steps_per_epoch(params: TrainParams, manifest: ShardManifest, shards_dir: Path) -> int:
    """Steps of one epoch, from the global record count: the same on every worker, or the
    collectives of the worker with more steps wait forever."""
    records = manifest.split("train").num_records
    if records // params.batch_size == 0:
        raise ParamsError(
            f"train.batch_size={params.batch_size} exceeds the {records} train records in "
            f"{shards_dir}; lower it"
        )
    return records // params.batch_size


def check_distributable(
    params: TrainParams, manifest: ShardManifest, strategy: tf.distribute.Strategy
) -> None:
    """Refuse what the strategy cannot split: the batch over replicas, the files over workers."""
    replicas, workers = strategy.num_replicas_in_sync, num_workers(strategy)
    if params.batch_size % replicas:
        raise ParamsError(
            f"train.batch_size={params.batch_size} does not split over {replicas} replicas: "
            f"set a multiple of {replicas} (it is the global batch)"
        )
    files = len(manifest.split("train").shards)
    if files < workers:
        raise ParamsError(
            f"{files} train shard files for {workers} workers: each worker reads its own "
            "files; lower shard.target_shard_mb so the train split has at least one file "
            "per worker, and reshard"
        )


def read_data(
    params: TrainParams,
    manifest: ShardManifest,
    shards_dir: Path,
    strategy: tf.distribute.Strategy,
    store: ShardStore | None = None,
) -> Data:
    steps = steps_per_epoch(params, manifest, shards_dir)

    def batches(first_epoch: int) -> Any:
        """The batches of every epoch from ``first_epoch`` on, ``steps`` an epoch, each
        epoch shuffled by a seed of its own: a run resumed at any epoch reads what an
        uninterrupted run read there (one endless dataset reshuffles by how many passes its
        process made, and a resumed process starts from the first). One iterator for them
        all: a dataset built anew each epoch cost 0.35 s of its 1.5 s on the demo."""

        def train_input(context: tf.distribute.InputContext) -> tf.data.Dataset:
            @tf.autograph.experimental.do_not_convert
            def epoch(number: tf.Tensor) -> tf.data.Dataset:
                # Sharded by file: worker i reads train files i, i + n, ... (AutoShardPolicy
                # FILE, done by the reader so it still knows its record count). Repeated,
                # then cut: an epoch is a count of steps, and a worker whose files hold
                # fewer records wraps around within it.
                return (
                    read_split(
                        shards_dir,
                        "train",
                        batch_size=context.get_per_replica_batch_size(params.batch_size),
                        training=True,
                        seed=epoch_seed(params.seed, number),
                        manifest=manifest,
                        file_shard=(context.input_pipeline_id, context.num_input_pipelines),
                        store=store,
                    )
                    .repeat()
                    .take(steps)
                )

            epochs = tf.data.Dataset.range(first_epoch, tf.int64.max)
            return epochs.flat_map(epoch).prefetch(tf.data.AUTOTUNE)

        return iter(strategy.distribute_datasets_from_function(train_input))

    val = read_split(
        shards_dir,
        "val",
        batch_size=params.batch_size,
        training=False,
        manifest=manifest,
        store=store,
    )
    return Data(batches, val, steps, params.batch_size)


EPOCH_SEED_STRIDE = 1_000_003  # a prime: seed s, epoch e and seed s', epoch e' rarely meet


def epoch_seed(seed: int, epoch: Any) -> Any:
    """The reader's shuffle seed for ``epoch`` (an int or an int64 tensor) of a run seeded
    ``seed``: the same for the same pair, in a resumed process as in the first."""
    return seed * EPOCH_SEED_STRIDE + epoch


# -- one step ------------------------------------------------------------------------------


class Steps(NamedTuple):
    """The compiled steps of one phase (see :func:`step_functions`)."""

    train: Callable[[Any], tf.Tensor]
    evaluate: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
    sync_statistics: Callable[[], None]


def step_functions(model: keras.Model, strategy: tf.distribute.Strategy, data: Data) -> Steps:
    """``train(batch)`` takes one step on every replica and returns ``[loss sum, correct,
    images]`` summed over the global batch; ``evaluate(images, labels)`` the same for one
    local batch, no step taken; ``sync_statistics()`` averages the BatchNorm moving
    statistics over the replicas."""
    optimizer = model.optimizer
    # XLA as Keras resolved ``train.xla`` at compile: off under op determinism, where not
    # every op has a deterministic XLA kernel (Keras warns then).
    xla = bool(model.jit_compile)
    # Every step function is traced through ``graph``, without AutoGraph: none has Python
    # control flow on tensors, and AutoGraph writes each function it converts to a file in
    # the temporary folder that nothing removes.
    graph = partial(tf.function, autograph=False)

    def gradients(images: tf.Tensor, labels: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor]:
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            per_image = keras.losses.sparse_categorical_crossentropy(labels, probs)
            # Averaged over the global batch, not this replica's share: the optimizer sums
            # the replicas' gradients, so the sum is the global batch's mean gradient.
            loss = tf.nn.compute_average_loss(per_image, global_batch_size=data.global_batch)
            # Scaled up under mixed_float16 so small gradients survive float16; the optimizer
            # (a LossScaleOptimizer then) unscales them and skips a step that overflowed.
            scaled = optimizer.scale_loss(loss)
        return tape.gradient(scaled, model.trainable_variables), figures(per_image, probs, labels)

    # Under XLA only the forward and backward pass are compiled. The update stays outside, in
    # the replica context: the loss-scale optimizer's cross-replica step (a merge_call under
    # a tf.cond) is refused inside an XLA function by MirroredStrategy on GPUs.
    compute_gradients = graph(gradients, jit_compile=True) if xla else gradients

    def train_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        grads, step_figures = compute_gradients(images, labels)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return step_figures

    def figures(per_image: tf.Tensor, probs: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        predicted = tf.argmax(probs, axis=-1, output_type=labels.dtype)
        return tf.stack(
            [
                tf.reduce_sum(tf.cast(per_image, tf.float32)),
                tf.reduce_sum(tf.cast(predicted == labels, tf.float32)),
                tf.cast(tf.size(labels), tf.float32),
            ]
        )

    replica_step = train_step if xla else graph(train_step)

    @graph
    def distributed_step(batch: Any) -> tf.Tensor:
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    @graph(jit_compile=xla)
    def evaluate_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        probs = model(images, training=False)
        per_image = keras.losses.sparse_categorical_crossentropy(labels, probs)
        return figures(per_image, probs, labels)

    # Each replica updates its own copy of the BatchNorm moving statistics from its own
    # batches (Keras 3 does not aggregate them). An average of exponential moving averages
    # is the moving average of the averaged batch statistics, so averaging once an epoch,
    # before anyone reads them, equals averaging at every step.
    statistics = [v for v in model.non_trainable_variables if v.path.endswith(MOVING_STATISTICS)]

    @graph
    def sync_statistics() -> None:
        def replica_means() -> list[tf.Tensor]:
            context = tf.distribute.get_replica_context()
            values = [tf.identity(v.value) for v in statistics]  # this replica's copies
            return context.all_reduce(tf.distribute.ReduceOp.MEAN, values)

        means = strategy.experimental_local_results(strategy.run(replica_means))[0]
        for variable, mean in zip(statistics, means, strict=True):
            variable.assign(mean)

    return Steps(distributed_step, evaluate_step, sync_statistics)


# -- epochs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """Epochs ``[first, end)`` of one training phase, resumable from ``dirs``."""

    first: int
    end: int
    dirs: BackupDirs


def fit_phase(
    model: keras.Model,
    data: Data,
    phase: Phase,
    strategy: tf.distribute.Strategy,
    steps: Steps,
    *,
    params: TrainParams,
    callbacks: Sequence[keras.callbacks.Callback],
) -> tuple[int, int]:
    """Train one phase, resuming after its last committed epoch; the epoch it ended at and
    the epoch whose weights the model holds (early stopping restores its best one's).

    ``callbacks`` start with the epoch log; early stopping follows it, then the rest.
    """
    # Every worker restores the same epoch from the chief's backup, or the run is refused:
    # workers that disagree on where they are would wait on each other's collectives.
    start = max(train_backup.restore_epoch(model, phase.dirs), phase.first)
    if chief_value(strategy, start) != start:
        raise RuntimeError(
            f"this worker restored epoch {start} from {phase.dirs.read}, the chief another: "
            "the backup dir must be one path that every worker mounts"
        )
    stopping: list[keras.callbacks.Callback] = []
    if params.early_stopping_patience > 0:
        stopping.append(
            ResumableEarlyStopping(
                phase.dirs,
                resumed_at=start if start > phase.first else 0,
                patience=params.early_stopping_patience,
                restore_best_weights=True,
            )
        )
    hooks = keras.callbacks.CallbackList([*callbacks[:1], *stopping, *callbacks[1:]], model=model)
    model.stop_training = False
    hooks.on_train_begin()
    ended = start
    batches = data.batches(start)
    for epoch in range(start, phase.end):
        hooks.on_epoch_begin(epoch)
        logs = run_epoch(steps.train, batches, data.steps_per_epoch)
        if strategy.num_replicas_in_sync > 1:
            steps.sync_statistics()  # before validation, the backup and the model read them
        logs.update(validate(steps.evaluate, data.val, strategy))
        logs["learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        # The backup first: the epoch is committed before any callback can fail.
        train_backup.save_epoch(model, phase.dirs, epoch)
        hooks.on_epoch_end(epoch, logs)
        ended = epoch + 1
        if model.stop_training:  # early stopping; the same on every worker (same figures)
            break
    hooks.on_train_end()
    best = stopping[0] if stopping else None
    if isinstance(best, ResumableEarlyStopping) and best.best_weights is not None:
        return ended, int(best.best_epoch)  # on_train_end put that epoch's weights back
    return ended, ended - 1


def run_epoch(train: Callable[[Any], tf.Tensor], batches: Any, steps: int) -> dict[str, float]:
    """One epoch of ``steps`` training steps on ``batches``; loss and accuracy over it,
    images/s and step time."""
    start = time.perf_counter()
    totals = tf.zeros(3)
    for _ in range(steps):
        totals += train(next(batches))
    loss_sum, correct, images = (float(x) for x in totals.numpy())  # waits for the last step
    seconds = max(time.perf_counter() - start, 1e-9)
    return {
        "loss": loss_sum / images,
        "accuracy": correct / images,
        "images_per_sec": images / seconds,
        "step_time_ms": 1000 * seconds / steps,
    }


def validate(
    evaluate: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
    val: tf.data.Dataset,
    strategy: tf.distribute.Strategy,
) -> dict[str, float]:
    """Val loss and accuracy, computed by the chief (the demo has one val file) and sent to
    every worker, so early stopping decides the same everywhere."""
    loss_sum = correct = images = 0.0
    if is_chief(strategy):
        totals = tf.zeros(3)
        for batch_images, batch_labels in val:
            totals += evaluate(batch_images, batch_labels)
        loss_sum, correct, images = (float(x) for x in totals.numpy())
    images = chief_value(strategy, images)
    return {
        "val_loss": chief_value(strategy, loss_sum) / images,
        "val_accuracy": chief_value(strategy, correct) / images,
    }


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
    weights_lineage: dict[str, str] | None = None,
    join_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Train ``params.model`` on the shards' train split (val for early stopping).

    Writes the model (Keras format) to ``model_file`` and, when given, the numeric summary
    (``metrics_file``, DVC's metrics), the rest of it (``summary_file``), the per-epoch rows
    (``history_file``, DVC plot data) and the plot. Resumable: state lives in ``backup_dir``
    until the run completes, and is resumed only by a run with the same params, shards and
    training code (else discarded, with the reason logged). Every worker calls this; the
    chief alone writes. A ``store`` (tasks.shard_store) reads the shards from object
    storage instead. ``weights_lineage``: the caller's :func:`tasks.models.weights_lineage`,
    else hashed here; ``join_timeout_s``: :func:`meet`'s. Returns a small summary dict.
    """
    # The strategy first: the multi-worker one must exist before any other TensorFlow op.
    strategy = strategy or choose_strategy()
    shards_dir, model_file, backup_dir = Path(shards_dir), Path(model_file), Path(backup_dir)
    manifest = store.manifest() if store else load_manifest(shards_dir)
    chief = is_chief(strategy)
    # Refusals before the first collective, on every worker: one that refused alone would
    # leave the others waiting for it.
    models.check_weights(params.weights)
    steps_per_epoch(params, manifest, shards_dir)  # refuses a batch larger than the split
    check_distributable(params, manifest, strategy)
    lineage = weights_lineage or models.weights_lineage(params.weights)
    identity = backup_identity(params, manifest.fingerprint, lineage)
    dirs = BackupDirs.for_worker(backup_dir, chief=chief, worker=worker_name(strategy))
    stored = None
    if chief:
        stored, _ = claim_backup(backup_dir, identity)  # run_train may have claimed it already
        if stored is None:
            write_identity(backup_dir, identity)
    meet(strategy, join_timeout_s)  # the first collective: after the chief's claim, bounded
    previous_policy = keras.mixed_precision.global_policy()
    policy = precision_policy(params, gpu=on_gpu(strategy))
    keras.mixed_precision.set_global_policy(policy)
    try:
        try:
            model, epoch_log, weights_epoch, probe = fit_phases(
                params, manifest, shards_dir, dirs, strategy, callbacks, store
            )
        except BackupUnusable as error:
            # The identity matched but the state does not fit this model: start over once.
            if chief:
                discard_backup(backup_dir, [str(error)])
                write_identity(backup_dir, identity, (stored or {}).get("mlflow_run_id"))
            chief_value(strategy, 0.0)  # the backup is gone before anyone looks again
            model, epoch_log, weights_epoch, probe = fit_phases(
                params, manifest, shards_dir, dirs, strategy, callbacks, store
            )
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)

    rows = read_epoch_log(epoch_log.path)
    # Every worker saves (TensorFlow may need each one to read its variables); the chief's
    # copy is the model. The same weights give the same bytes.
    save_model(model, model_file if chief else dirs.write / "model.keras")
    summary = history_summary(rows)
    # The model's own figures: early stopping may have put back an earlier epoch's weights,
    # and the last epoch's ("final") then describe weights the model file does not hold.
    kept = [row for row in rows if int(row["epoch"]) == weights_epoch]
    summary["model_epoch"] = weights_epoch + 1  # counted from 1, as the plot rows
    summary["model"] = {key: kept[0][key] for key in ("val_loss", "val_accuracy")} if kept else {}
    # After saving: the probe's extra steps change the in-memory weights, never the model file.
    summary["input_bound"] = probe()
    summary.update(
        model_file=str(model_file),
        fingerprint=manifest.fingerprint,
        resumed_from_epoch=epoch_log.first_epoch or 0,
        precision_policy=policy,
        # Whether the step ran under XLA: train.xla as Keras resolved it for this model (off
        # under op determinism and for layers XLA cannot compile, such as RandomCrop).
        xla=bool(model.jit_compile),
        strategy=strategy_name(strategy),
        num_workers=num_workers(strategy),
        num_replicas=strategy.num_replicas_in_sync,
        chief=chief,
    )
    if chief:
        write_outputs(summary, rows, metrics_file, summary_file, history_file, plot_file)
    dirs.clean_up()  # completed: nothing left to resume (the others drop their scratch)
    return summary


def write_outputs(
    summary: dict[str, Any],
    rows: list[dict[str, float]],
    metrics_file: str | Path | None,
    summary_file: str | Path | None,
    history_file: str | Path | None,
    plot_file: str | Path | None,
) -> None:
    """The summary's numbers, the rest of it, the plot rows and the plot, where given."""
    numbers, rest = split_numeric({k: v for k, v in summary.items() if k != "history"})
    if metrics_file is not None:
        write_json(Path(metrics_file), numbers)
    if summary_file is not None:
        write_json(Path(summary_file), rest)
    if history_file is not None:
        write_json(Path(history_file), history_rows(rows))
    if plot_file is not None:
        plot_history(rows, Path(plot_file))


def fit_phases(
    params: TrainParams,
    manifest: ShardManifest,
    shards_dir: Path,
    dirs: BackupDirs,
    strategy: tf.distribute.Strategy,
    callbacks: Sequence[keras.callbacks.Callback],
    store: ShardStore | None = None,
) -> tuple[keras.Model, EpochLog, int, Callable[[], dict[str, float]]]:
    """Build the model and fit it: the frozen (or only) phase, then fine-tuning if asked.
    Returns the model, its epoch log, the epoch whose weights it holds and the input-bound
    probe of its last phase's step.

    Each phase resumes from its own backup dir. The frozen phase commits its end weights and
    epoch count before its backup goes, so a kill between the phases resumes fine-tuning
    from those weights instead of redoing the frozen phase.
    """
    seed_everything(params)
    data = read_data(params, manifest, shards_dir, strategy, store)
    epoch_log = EpochLog(dirs.write / EPOCH_LOG_NAME)
    hooks = [epoch_log, *callbacks]
    with strategy.scope():
        model = build_model(params, len(manifest.classes), manifest.record_schema.image_shape)
        compile_model(model, params, params.learning_rate, data.steps_per_epoch * params.epochs)
    steps = step_functions(model, strategy, data)
    fine_tune = params.fine_tune_layers > 0 and params.fine_tune_epochs > 0
    done = train_backup.restore_main_phase(model, dirs) if fine_tune else None
    if done is None:
        main = Phase(0, params.epochs, dirs.phase("main"))
        done, weights_epoch = fit_phase(
            model, data, main, strategy, steps, params=params, callbacks=hooks
        )
        if not fine_tune:  # the only phase: the model holds its kept epoch
            return model, epoch_log, weights_epoch, lambda: probe_input_bound(steps.train, data)
        train_backup.commit_main_phase(model, dirs, done)
    # Fine-tuning: the model holds the epoch this phase keeps, whatever the frozen one kept.
    with strategy.scope():
        unfreeze_top(model, params.fine_tune_layers)
        lr = params.learning_rate * FINE_TUNE_LR_FACTOR
        compile_model(model, params, lr, data.steps_per_epoch * params.fine_tune_epochs)
    tune_steps = step_functions(model, strategy, data)  # new trainable set
    tune = Phase(done, done + params.fine_tune_epochs, dirs.phase("fine_tune"))
    _, weights_epoch = fit_phase(
        model, data, tune, strategy, tune_steps, params=params, callbacks=hooks
    )
    return model, epoch_log, weights_epoch, lambda: probe_input_bound(tune_steps.train, data)


def probe_input_bound(
    train_step: Callable[[Any], tf.Tensor], data: Data, *, steps: int = 20, warmup: int = 3
) -> dict[str, float]:
    """Median train-step time fed by the shard reader over the same fed from memory.

    A ratio near 1 means the accelerator never waits for data; well above 1 means the input
    pipeline starves it. Logged per run so a starved accelerator shows in the MLflow UI.
    """
    batches = data.batches(0)
    batch = next(batches)
    real_s = median_step_seconds(lambda: train_step(next(batches)), steps, warmup)
    in_memory_s = median_step_seconds(lambda: train_step(batch), steps, warmup)
    return {
        "input_bound_ratio": real_s / in_memory_s,
        "step_ms_reader": real_s * 1000,
        "step_ms_in_memory": in_memory_s * 1000,
    }


def median_step_seconds(step: Callable[[], tf.Tensor], steps: int, warmup: int) -> float:
    """Median seconds per step, waiting for the next batch and the step's result."""
    times: list[float] = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        step().numpy()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def compile_model(model: keras.Model, params: TrainParams, lr: float, total_steps: int) -> None:
    """Adam (a LossScaleOptimizer around it under mixed_float16, Keras' doing), built now,
    inside the strategy's scope, so its slots are mirrored like the weights."""
    schedule: float | keras.optimizers.schedules.LearningRateSchedule = lr
    if params.lr_schedule == "cosine":
        schedule = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(total_steps, 1))
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=params.xla,
    )
    model.optimizer.build(model.trainable_variables)


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
    Every worker runs this; the chief alone tracks (``run_tags`` on a new MLflow run)."""
    from tasks import tracking

    keras_without_extras()  # Keras's config held at its defaults, whatever keras.json says
    strategy = strategy or choose_strategy(params.cluster.join_timeout_s)  # first: see train
    store = open_store(layout.root, params.storage)  # SHARDFLOW_SHARDS_URL, else data/shards
    if store:
        manifest = check_validated_store(store, layout.validation_report)
    else:
        manifest = check_validated(layout.shards_dir, layout.validation_report)
    if not is_chief(strategy):
        return train(
            params.train,
            layout.shards_dir,
            model_file=layout.model_file,
            backup_dir=layout.backup_dir,
            strategy=strategy,
            callbacks=callbacks,
            store=store,
            join_timeout_s=params.cluster.join_timeout_s,
        )
    # What train refuses, refused before a run opens (and is left FAILED) for it.
    models.check_weights(params.train.weights)
    if untracked := models.untracked_weights(params.train.weights):
        log.warning(untracked)
    steps_per_epoch(params.train, manifest, layout.shards_dir)
    check_distributable(params.train, manifest, strategy)
    client = tracking.client(layout.root)
    lineage = models.weights_lineage(params.train.weights)  # hashes the file: once a run
    identity = backup_identity(params.train, manifest.fingerprint, lineage)
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
            inputs=lineage,
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
                weights_lineage=lineage,
                join_timeout_s=params.cluster.join_timeout_s,
            )
    except BaseException:
        client.set_terminated(run_id, status="FAILED")  # the id stays in the backup to resume
        raise
    log_run_figures(client, run_id, summary)
    client.set_tag(run_id, "device.xla", str(summary["xla"]).lower())
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


def log_run_figures(client: Any, run_id: str, summary: dict[str, Any]) -> None:
    """The run's figures that no epoch logged, as metrics (step 0): the input-bound probe's,
    and the figures of the epoch whose weights the model holds (``model_val_accuracy``,
    ``model_val_loss``, ``model_epoch``): the runs table's ``val_accuracy`` is the last
    epoch's, which early stopping may not have kept."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    figures = {
        **summary.get("input_bound", {}),
        **{f"model_{key}": value for key, value in summary.get("model", {}).items()},
    }
    if "model_epoch" in summary:
        figures["model_epoch"] = summary["model_epoch"]
    metrics = [Metric(key, float(value), now, 0) for key, value in figures.items()]
    if metrics:
        client.log_batch(run_id, metrics=metrics)


def resume_run_id(client: Any, run_id: str | None) -> str | None:
    """The MLflow run of an interrupted training, reopened, if its backup names one."""
    if not run_id:
        return None
    try:
        client.update_run(run_id, status="RUNNING")
    except Exception:  # the store was reset since: start a fresh run
        return None
    return run_id
