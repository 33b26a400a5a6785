"""The training loop every ``tf.distribute`` strategy runs (``tasks.train.stage`` drives it): each
worker's input, the compiled steps, the epochs of one phase and the input-bound probe.

Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585), so
the loop is ours: one step under ``strategy.run``, driving the Keras callbacks ``fit`` would.
A phase resumes at its last committed step (every ``checkpoint.every_steps`` steps and on
SIGTERM), else after its last committed epoch (``tasks.train.backup``); every worker reads
its own train files and the chief alone validates, sending the figures to the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from tasks.contracts.manifest import ShardManifest
from tasks.contracts.shard_store import ShardStore
from tasks.contracts.tf_reader import read_options, read_split
from tasks.runtime.accelerator import gpu_devices
from tasks.runtime.params import ParamsError, TrainParams
from tasks.runtime.processes import usable_cores
from tasks.train import backup as train_backup
from tasks.train.backup import BackupDirs, StepState, log
from tasks.train.callbacks import ResumableEarlyStopping
from tasks.train.cluster import (
    Preempted,
    any_worker,
    chief_value,
    is_chief,
    num_workers,
    stop_asked,
)

MOVING_STATISTICS = ("moving_mean", "moving_variance")  # BatchNormalization's, by name


# -- the input, per worker -----------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    """What one worker trains and validates on: its share of the train files, as an endless
    iterator of distributed batches from a given epoch on, and the val split (read by the
    chief)."""

    # (first epoch, its first step) -> iterator over per-replica (images, labels)
    batches: Callable[[int, int], Any]
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
    steps = records // params.batch_size
    if params.steps_per_execution > steps:
        raise ParamsError(
            f"train.steps_per_execution={params.steps_per_execution} exceeds the {steps} "
            f"steps of an epoch ({records} train records in {shards_dir}, batch "
            f"{params.batch_size}); set at most {steps}"
        )
    return steps


@dataclass(frozen=True)
class InputTuning:
    """How the train input overlaps the step; the defaults are the stage's, the bench varies
    them one at a time. On the CPU the step and the input share the cores, so none of these
    shows its effect there: they are for an accelerator."""

    # Batches each replica's device holds ahead of the step (tf.distribute's default is 1:
    # the copy of the next batch then waits for the step to take the current one).
    device_buffer: int = 2
    # Cores a GPU's runtime keeps (its launch and copy threads) out of tf.data's private
    # pool (the reads' parallelism: tasks.contracts.tf_reader.read_options), per local GPU,
    # at most half the cores; 0 lets tf.data take every core as on the CPU.
    cores_per_gpu: int = 2


def input_threads(cores: int, gpus: int, tuning: InputTuning) -> int | None:
    """tf.data's thread budget beside ``gpus`` local GPUs on ``cores``; None (tf.data's
    default: every core) without a GPU, where the step runs on those same cores."""
    if not gpus or not tuning.cores_per_gpu:
        return None
    return max(1, cores - min(tuning.cores_per_gpu * gpus, cores // 2))


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
    tuning: InputTuning = InputTuning(),
) -> Data:
    """The worker's input (see :class:`Data`): its train files read in step-sized epochs,
    each batch fetched to the device ahead of the step (:class:`InputTuning`), records
    read out of order only where ``train.deterministic`` is off."""
    steps = steps_per_epoch(params, manifest, shards_dir)
    threads = input_threads(usable_cores(), len(gpu_devices(strategy)), tuning)
    train = TrainInput(params, manifest, shards_dir, strategy, store, steps, threads, tuning)
    val = read_split(
        shards_dir,
        "val",
        batch_size=params.batch_size,
        training=False,
        manifest=manifest,
        store=store,
    )
    return Data(train.batches, val, steps, params.batch_size)


@dataclass(frozen=True)
class TrainInput:
    """One worker's train split: ``steps`` batches an epoch from its own files, read with
    ``threads`` tf.data threads (:func:`input_threads`)."""

    params: TrainParams
    manifest: ShardManifest
    shards_dir: Path
    strategy: tf.distribute.Strategy
    store: ShardStore | None
    steps: int
    threads: int | None
    tuning: InputTuning

    def batches(self, first_epoch: int, first_step: int = 0) -> Any:
        """The batches of every epoch from step ``first_step`` of ``first_epoch`` on,
        ``steps`` an epoch, each epoch shuffled by a seed of its own: a run resumed at any
        step reads what an uninterrupted run read there (one endless dataset reshuffles by
        how many passes its process made, and a resumed process starts from the first). One
        iterator for them all: building a dataset anew each epoch costs a noticeable share
        of a short epoch."""
        ahead = tf.distribute.InputOptions(
            experimental_fetch_to_device=True,
            experimental_per_replica_buffer_size=self.tuning.device_buffer,
        )
        epochs = partial(self.epochs, first_epoch, first_step)
        return iter(self.strategy.distribute_datasets_from_function(epochs, options=ahead))

    def epochs(
        self, first_epoch: int, first_step: int, context: tf.distribute.InputContext
    ) -> tf.data.Dataset:
        """Every epoch from step ``first_step`` of ``first_epoch`` on, as one dataset, for
        the input pipeline ``context`` names."""

        @tf.autograph.experimental.do_not_convert
        def epoch(number: tf.Tensor) -> tf.data.Dataset:
            skipped = tf.where(number == first_epoch, tf.constant(first_step, tf.int64), 0)
            return self.epoch(context, number, skipped)

        epochs = tf.data.Dataset.range(first_epoch, tf.int64.max)
        ds = epochs.flat_map(epoch).prefetch(tf.data.AUTOTUNE)
        return ds.with_options(read_options(self.threads))

    def epoch(
        self, context: tf.distribute.InputContext, number: tf.Tensor, first_step: Any = 0
    ) -> tf.data.Dataset:
        """Epoch ``number`` of the pipeline ``context`` names, from step ``first_step`` on (an
        int or an int64 tensor): for each of its global batches, one batch per replica of
        this pipeline (its slice of the global batch: any number of workers reads the same
        global batches). The order depends only on the seed and the epoch
        (:func:`epoch_seed`): the reader starts at the step itself (the global order) or
        replays the epoch and drops the steps before it (GZIP shards)."""
        # Every worker reaches every record (the reader's global order); GZIP shards, read in
        # the buffered order, are sharded by file instead: worker i reads files i, i + n, ...
        params = self.params
        replicas = self.strategy.num_replicas_in_sync
        local = replicas // context.num_input_pipelines
        return read_split(
            self.shards_dir,
            "train",
            batch_size=params.batch_size,
            training=True,
            seed=epoch_seed(params.seed, number),
            manifest=self.manifest,
            file_shard=(context.input_pipeline_id, context.num_input_pipelines),
            store=self.store,
            ordered=params.deterministic,
            first_step=first_step,
            replicas=(context.input_pipeline_id * local, local, replicas),
        )


EPOCH_SEED_STRIDE = 1_000_003  # a prime: seed s, epoch e and seed s', epoch e' rarely meet


def epoch_seed(seed: int, epoch: Any) -> Any:
    """The reader's shuffle seed for ``epoch`` (an int or an int64 tensor) of a run seeded
    ``seed``: the same for the same pair, in a resumed process as in the first."""
    return seed * EPOCH_SEED_STRIDE + epoch


# -- one step ------------------------------------------------------------------------------


class Steps(NamedTuple):
    """The compiled steps of one phase (see :func:`step_functions`)."""

    train: Callable[[Any], tf.Tensor]
    train_calls: Callable[[Any], tf.Tensor]  # per_call steps from an iterator, one call
    per_call: int
    evaluate: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
    sync_statistics: Callable[[], None]


# Every step function is traced through ``graph``, without AutoGraph: none has Python control
# flow on tensors, and AutoGraph writes each function it converts to a file in the temporary
# folder that nothing removes.
graph = partial(tf.function, autograph=False)


def step_functions(
    model: keras.Model, strategy: tf.distribute.Strategy, data: Data, per_call: int = 1
) -> Steps:
    """``train(batch)`` takes one step on every replica and returns ``[loss sum, correct,
    images]`` summed over the global batch; ``train_calls(batches)`` takes ``per_call``
    steps from the iterator ``batches`` in one compiled call (``train.steps_per_execution``:
    one host round trip for them all) and returns their sum; ``evaluate(images, labels)``
    the same for one local batch, no step taken; ``sync_statistics()`` averages the BatchNorm moving
    statistics over the replicas."""
    # XLA as Keras resolved ``train.xla`` at compile: off under op determinism, where not
    # every op has a deterministic XLA kernel (Keras warns then).
    xla = bool(model.jit_compile)
    replica_step = replica_train_step(model, data.global_batch, xla=xla)

    def one_step(batch: Any) -> tf.Tensor:
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    @graph
    def distributed_steps(batches: Any) -> tf.Tensor:
        # A graph loop, not per_call traced copies of the step: one step's graph, any count.
        def body(index: tf.Tensor, totals: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return index + 1, totals + one_step(next(batches))

        _, totals = tf.while_loop(
            lambda index, _: index < per_call, body, (tf.constant(0), tf.zeros(3))
        )
        return totals

    @graph(jit_compile=xla)
    def evaluate_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        probs = model(images, training=False)
        per_image = keras.losses.sparse_categorical_crossentropy(labels, probs)
        return step_figures(per_image, probs, labels)

    return Steps(
        graph(one_step),
        distributed_steps,
        per_call,
        evaluate_step,
        statistics_sync(model, strategy),
    )


def step_figures(per_image: tf.Tensor, probs: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """``[loss sum, correct, images]`` of one batch."""
    predicted = tf.argmax(probs, axis=-1, output_type=labels.dtype)
    return tf.stack(
        [
            tf.reduce_sum(tf.cast(per_image, tf.float32)),
            tf.reduce_sum(tf.cast(predicted == labels, tf.float32)),
            tf.cast(tf.size(labels), tf.float32),
        ]
    )


def replica_train_step(
    model: keras.Model, global_batch: int, *, xla: bool
) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """One replica's step on its share of the global batch: gradients, the update, and the
    batch's :func:`step_figures`."""
    optimizer = model.optimizer

    def gradients(images: tf.Tensor, labels: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor]:
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            per_image = keras.losses.sparse_categorical_crossentropy(labels, probs)
            # Averaged over the global batch, not this replica's share: the optimizer sums
            # the replicas' gradients, so the sum is the global batch's mean gradient.
            loss = tf.nn.compute_average_loss(per_image, global_batch_size=global_batch)
            # Scaled up under mixed_float16 so small gradients survive float16; the optimizer
            # (a LossScaleOptimizer then) unscales them and skips a step that overflowed.
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        return grads, step_figures(per_image, probs, labels)

    # Under XLA only the forward and backward pass are compiled. The update stays outside, in
    # the replica context: the loss-scale optimizer's cross-replica step (a merge_call under
    # a tf.cond) is refused inside an XLA function by MirroredStrategy on GPUs.
    compute_gradients = graph(gradients, jit_compile=True) if xla else gradients

    def train_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        grads, figures = compute_gradients(images, labels)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return figures

    return train_step if xla else graph(train_step)


def moving_statistics(model: keras.Model) -> list[Any]:
    """The model's BatchNorm moving statistics, in its order."""
    return [v for v in model.non_trainable_variables if v.path.endswith(MOVING_STATISTICS)]


def replica_statistics(model: keras.Model, strategy: tf.distribute.Strategy) -> list[np.ndarray]:
    """Every replica's own copy of each moving statistic, stacked ``(replica, ...)``: the
    state a mid-epoch save must keep (the weights file holds one replica's copy, and each
    replica keeps its own until the epoch's end averages them). A collective with several
    workers: every worker calls it at the same step."""
    statistics = moving_statistics(model)

    @graph
    def gathered() -> list[tf.Tensor]:
        def own() -> list[tf.Tensor]:
            return [tf.expand_dims(tf.identity(v.value), 0) for v in statistics]

        return [strategy.gather(copies, axis=0) for copies in strategy.run(own)]

    return [np.asarray(values) for values in gathered()]


def place_replica_statistics(
    model: keras.Model,
    strategy: tf.distribute.Strategy,
    saved: Sequence[np.ndarray],
    source: Path,
) -> None:
    """Give each of this worker's replicas its own copy of the moving statistics from
    ``saved`` (:func:`replica_statistics`'s, read from ``source``, indexed by replica in
    the sync group). Saved on another number of replicas, they are left as the weights
    file set them (the chief's copy on every replica), with a warning."""
    statistics = moving_statistics(model)
    if len(saved) != len(statistics):
        raise train_backup.BackupUnusable(
            f"{source} holds {len(saved)} moving statistics, the model has {len(statistics)}"
        )
    replicas = strategy.num_replicas_in_sync
    if any(len(values) != replicas for values in saved):
        log.warning(
            "%s was saved on another number of replicas than %d: every replica resumes "
            "with the chief's moving statistics",
            source,
            replicas,
        )
        return
    mine = strategy.experimental_local_results(
        strategy.experimental_distribute_values_from_function(
            lambda context: [values[context.replica_id_in_sync_group] for values in saved]
        )
    )
    for index, variable in enumerate(statistics):
        copies = getattr(variable.value, "values", (variable.value,))  # this worker's devices
        for copy, replica in zip(copies, mine, strict=True):
            copy.assign(replica[index])


def statistics_sync(model: keras.Model, strategy: tf.distribute.Strategy) -> Callable[[], None]:
    """A compiled call that averages the BatchNorm moving statistics over the replicas.

    Each replica updates its own copy of them from its own batches (Keras 3 does not
    aggregate them). An average of exponential moving averages is the moving average of the
    averaged batch statistics, so averaging once an epoch, before anyone reads them, equals
    averaging at every step."""
    statistics = moving_statistics(model)

    @graph
    def sync_statistics() -> None:
        def replica_means() -> list[tf.Tensor]:
            context = tf.distribute.get_replica_context()
            values = [tf.identity(v.value) for v in statistics]  # this replica's copies
            return context.all_reduce(tf.distribute.ReduceOp.MEAN, values)

        means = strategy.experimental_local_results(strategy.run(replica_means))[0]
        for variable, mean in zip(statistics, means, strict=True):
            variable.assign(mean)

    return sync_statistics


# -- epochs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """Epochs ``[first, end)`` of one training phase, resumable from ``dirs``, saving its
    state inside an epoch every ``every_steps`` steps (``checkpoint.every_steps``; 0: only
    on SIGTERM)."""

    first: int
    end: int
    dirs: BackupDirs
    every_steps: int = 0


def resume_point(
    model: keras.Model, phase: Phase, strategy: tf.distribute.Strategy, steps: int
) -> tuple[int, StepState | None]:
    """The epoch the phase starts at and the state saved inside it, both loaded into
    ``model``. Every worker restores the same step from the chief's backup, or the run is
    refused: workers that disagree on where they are would wait on each other's
    collectives."""
    start = max(train_backup.restore_epoch(model, phase.dirs), phase.first)
    inside = train_backup.restore_step(model, phase.dirs, start) if start < phase.end else None
    step = inside.step if inside else 0
    if chief_value(strategy, start) != start or chief_value(strategy, step) != step:
        raise RuntimeError(
            f"this worker restored epoch {start}, step {step} from {phase.dirs.read}, the "
            "chief another: the backup dir must be one path that every worker mounts"
        )
    if inside and inside.statistics and strategy.num_replicas_in_sync > 1:
        path = phase.dirs.read / inside.statistics
        with np.load(path) as saved:
            place_replica_statistics(model, strategy, [saved[name] for name in saved.files], path)
    if inside:
        log.warning(
            "resumed at epoch %d, step %d (of %d): the state saved there (%s)",
            start + 1,
            step,
            steps,
            phase.dirs.read,
        )
    return start, inside


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
    start, inside = resume_point(model, phase, strategy, data.steps_per_epoch)
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
    batches = data.batches(start, inside.step if inside else 0)
    saves = set(
        train_backup.checkpoint_steps(data.steps_per_epoch, steps.per_call, phase.every_steps)
    )
    for epoch in range(start, phase.end):
        hooks.on_epoch_begin(epoch)
        boundary = partial(call_boundary, model, phase.dirs, strategy, epoch, saves)
        logs = run_epoch(steps, batches, data.steps_per_epoch, inside, boundary)
        inside = None
        if strategy.num_replicas_in_sync > 1:
            steps.sync_statistics()  # before validation, the backup and the model read them
        logs.update(validate(steps.evaluate, data.val, strategy))
        logs["learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        # The backup first: the epoch is committed before any callback can fail.
        train_backup.save_epoch(model, phase.dirs, epoch)
        hooks.on_epoch_end(epoch, logs)
        ended = epoch + 1
        if ended < phase.end and any_worker(strategy, stop_asked()):
            raise Preempted(
                f"stopped by SIGTERM after epoch {ended}, committed in {phase.dirs.write}: "
                "rerun the train stage to resume there"
            )
        if model.stop_training:  # early stopping; the same on every worker (same figures)
            break
    hooks.on_train_end()
    best = stopping[0] if stopping else None
    if isinstance(best, ResumableEarlyStopping) and best.best_weights is not None:
        return ended, int(best.best_epoch)  # on_train_end put that epoch's weights back
    return ended, ended - 1


def call_boundary(
    model: keras.Model,
    dirs: BackupDirs,
    strategy: tf.distribute.Strategy,
    epoch: int,
    saves: set[int],
    step: int,
    totals: tf.Tensor,
) -> None:
    """Between two compiled calls, ``step`` steps into ``epoch``: save the state there when
    the schedule (``saves``) or a SIGTERM asks, then stop on a SIGTERM. With several
    workers they agree first (a SIGTERM to any one stops all at the same step)."""
    stop = any_worker(strategy, stop_asked())
    if step in saves or stop:
        replicas = strategy.num_replicas_in_sync
        state = StepState.named(epoch, step, totals.numpy().tolist(), replicas=replicas)
        statistics = replica_statistics(model, strategy) if replicas > 1 else []
        train_backup.save_step(model, dirs, state, statistics)
    if stop:
        raise Preempted(
            f"stopped by SIGTERM at epoch {epoch + 1}, step {step}, its state saved in "
            f"{dirs.write}: rerun the train stage to resume there"
        )


def run_epoch(
    train: Steps,
    batches: Any,
    steps: int,
    start: StepState | None = None,
    boundary: Callable[[int, tf.Tensor], None] | None = None,
) -> dict[str, float]:
    """One epoch of ``steps`` training steps on ``batches``, ``train.per_call`` a compiled
    call and the rest one by one; loss and accuracy over it, images/s and step time.

    ``start``: the state saved inside the epoch, whose step and partial totals it goes on
    from (its calls fall where an uninterrupted epoch's do: saves are on call boundaries).
    ``boundary(step, totals)`` runs after each call but the epoch's last."""
    began = time.perf_counter()
    calls, _ = divmod(steps, train.per_call) if train.per_call > 1 else (0, steps)
    step = start.step if start else 0
    totals = tf.constant(start.totals if start else (0.0, 0.0, 0.0), tf.float32)
    while step < steps:
        if step < calls * train.per_call:
            totals += train.train_calls(batches)
            step += train.per_call
        else:
            totals += train.train(next(batches))
            step += 1
        if boundary is not None and step < steps:
            boundary(step, totals)
    loss_sum, correct, images = (float(x) for x in totals.numpy())  # waits for the last step
    seconds = max(time.perf_counter() - began, 1e-9)
    done = images - (start.totals[2] if start else 0.0)  # the images of this process's steps
    return {
        "loss": loss_sum / images,
        "accuracy": correct / images,
        "images_per_sec": done / seconds,
        "step_time_ms": 1000 * seconds / (steps - (start.step if start else 0)),
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


# The probe's steps are taken in turns, reader-fed then memory-fed, so that a slow spell of a
# shared host falls on both figures: 20 steps of one, then 20 of the other, read ratios of
# 0.81-1.21 for one model on 2 idle cores.
PROBE_ROUNDS = 4


def probe_input_bound(
    train_step: Callable[[Any], tf.Tensor],
    data: Data,
    *,
    steps: int = 20,
    warmup: int = 3,
    rounds: int = PROBE_ROUNDS,
) -> dict[str, float]:
    """Median train-step time fed by the shard reader over the same fed from memory.

    A ratio near 1 means the accelerator never waits for data; well above 1 means the input
    pipeline starves it. Logged per run so a starved accelerator shows in the MLflow UI.
    """
    batches = data.batches(0, 0)
    batch = next(batches)
    real_s, in_memory_s = median_step_seconds_in_turns(
        [lambda: train_step(next(batches)), lambda: train_step(batch)], steps, warmup, rounds
    )
    return {
        "input_bound_ratio": real_s / in_memory_s,
        "step_ms_reader": real_s * 1000,
        "step_ms_in_memory": in_memory_s * 1000,
    }


def median_step_seconds_in_turns(
    feeds: Sequence[Callable[[], tf.Tensor]], steps: int, warmup: int, rounds: int
) -> list[float]:
    """Median seconds per step of each of ``feeds``, waiting for the next batch and the
    step's result: ``rounds`` turns of each in order, a turn ``warmup`` untimed steps (what
    the turn before left ready or running) then ``ceil(steps / rounds)`` timed ones."""
    per_turn = -(-steps // rounds)
    times: list[list[float]] = [[] for _ in feeds]
    for _ in range(rounds):
        for step, kept in zip(feeds, times, strict=True):
            for index in range(warmup + per_turn):
                start = time.perf_counter()
                step().numpy()
                if index >= warmup:
                    kept.append(time.perf_counter() - start)
    return [sorted(kept)[len(kept) // 2] for kept in times]
