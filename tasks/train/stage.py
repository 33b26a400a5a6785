"""Train stage: validated shards in, a Keras model, its history and an MLflow run out.

``train`` is the pure core (shards in, model and metrics files out; no MLflow); ``run_train``
wraps it with the validation gate, tracking and the layout's paths. One training loop runs
under every ``tf.distribute`` strategy: the default one (one device), MirroredStrategy (every
local GPU) and MultiWorkerMirroredStrategy (workers under ``TF_CONFIG``, see
``tasks.train.cluster``). Keras 3's ``model.fit`` fails under the multi-worker strategy
(keras-team/keras#20585), so the loop is ours (``tasks.train.loop``): one step under
``strategy.run``, driving the same Keras callbacks ``fit`` would.

``train.batch_size`` is the global batch: split across every replica of every worker, so a
single-device run means what it always did and more replicas do not change the step count.

A killed run resumes at the last step committed (every ``checkpoint.every_steps`` steps, and
on SIGTERM, which then ends training: :class:`tasks.train.cluster.Preempted`), else at the
epoch after the last one committed (``tasks.train.backup``), and only as the same run: same
params, shards and training code. With several workers the chief decides which backup is
resumed and records every output (the model, the metrics, MLflow); the others train beside
it and write only scratch copies.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tasks.contracts.manifest import ShardManifest, load_manifest
from tasks.contracts.shard_store import ShardStore, open_store
from tasks.contracts.validated_shards import (
    ShardsNotValidated as ShardsNotValidated,  # re-exported for the flows
)
from tasks.contracts.validated_shards import check_validated, check_validated_store
from tasks.runtime.accelerator import device_record, gpu_devices, select_accelerator
from tasks.runtime.atomic import write_json
from tasks.runtime.code_version import code_version
from tasks.runtime.layout import Layout
from tasks.runtime.params import CheckpointParams, Params, TrainParams, flatten
from tasks.runtime.tf_imports import keras_without_extras
from tasks.train import backup as train_backup
from tasks.train import models
from tasks.train.backup import (
    EPOCH_LOG_NAME,
    BackupDirs,
    BackupUnusable,
    claim_backup,
    discard_backup,
    log,
    read_epoch_log,
    write_identity,
)
from tasks.train.backup import IDENTITY_NAME as IDENTITY_NAME  # re-exported
from tasks.train.backup import identity_changes as identity_changes  # re-exported
from tasks.train.callbacks import EpochLog, MlflowEpochMetrics
from tasks.train.cluster import (
    chief_value,
    choose_strategy,
    is_chief,
    meet,
    num_workers,
    stop_on_sigterm,
    strategy_name,
    worker_name,
)
from tasks.train.loop import (
    Phase,
    check_distributable,
    fit_phase,
    probe_input_bound,
    read_data,
    step_functions,
    steps_per_epoch,
)
from tasks.train.model_file import save_model
from tasks.train.models import build_model, unfreeze_top
from tasks.train.summary import (
    TrainedRun,
    TrainRunRecord,
    TrainSummary,
    history_summary,
    write_outputs,
)

FINE_TUNE_LR_FACTOR = 0.1  # fine-tuning a pretrained backbone wants a much smaller step


# -- devices, precision, determinism ------------------------------------------------------


def on_gpu(strategy: tf.distribute.Strategy) -> bool:
    return bool(gpu_devices(strategy))


def precision_policy(params: TrainParams, *, gpu: bool) -> str:
    """float16 on GPU (tensor cores); bfloat16 on CPU, where float16 math is emulated."""
    if not params.mixed_precision:
        return "float32"
    return "mixed_float16" if gpu else "mixed_bfloat16"


# The x86 instruction sets oneDNN (TensorFlow's CPU kernels) chooses kernels by: a model
# trained on a CPU with other ones differs in its last bits (a run capped at AVX2 by
# ONEDNN_MAX_CPU_ISA writes another model file than one on AVX-512; each repeats exactly).
KERNEL_ISA_FLAGS = ("avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo; empty where it cannot be read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_isa(cpuinfo: str | None = None, cap: str | None = None) -> str:
    """The CPU's architecture and the :data:`KERNEL_ISA_FLAGS` it has (``cpuinfo``: the text
    of /proc/cpuinfo, read here when None; its flags are absent where it cannot be read), and
    the cap ``ONEDNN_MAX_CPU_ISA`` sets (``cap``; the environment's when None)."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
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
    """What the run runs on, for tracking: device type, name and count (on a GPU the CUDA and
    cuDNN versions TensorFlow was built with: :func:`tasks.runtime.accelerator.device_record`), the
    CPU's kernel instruction sets (:func:`cpu_isa`), workers, replicas, precision, steps per
    compiled call (XLA is tagged once trained: Keras decides it with the model)."""
    gpus = gpu_devices(strategy)
    cpuinfo = read_cpuinfo()
    return {
        **device_record(gpus, cpuinfo).tags(),
        "device.cpu_isa": cpu_isa(cpuinfo),
        "device.num_workers": str(num_workers(strategy)),
        "device.num_replicas": str(strategy.num_replicas_in_sync),
        "device.strategy": strategy_name(strategy),
        "device.precision_policy": precision_policy(params, gpu=bool(gpus)),
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
    (``lineage``: :func:`tasks.train.models.weights_lineage`'s), shards and code."""
    return {
        "params": {**flatten(params, "train"), **lineage},
        "fingerprint": fingerprint,
        "code_version": training_code_version(),
    }


# -- the core ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainInputs:
    """What a run trains on, checked (:func:`check_inputs`): the shards' manifest, the weights'
    lineage (:func:`tasks.train.models.weights_lineage`), the identity a backup must carry to
    be resumed (:func:`backup_identity`) and the object store the shards are read from (None:
    the layout's shard folder)."""

    manifest: ShardManifest
    lineage: dict[str, str]
    identity: dict[str, Any]
    store: ShardStore | None = None


def check_inputs(
    params: TrainParams,
    layout: Layout,
    manifest: ShardManifest,
    strategy: tf.distribute.Strategy,
    store: ShardStore | None = None,
) -> TrainInputs:
    """Refuse what training cannot run, then hash the weights file (once a run). Called on
    every worker before the first collective: one that refused alone would leave the others
    waiting for it; and before an MLflow run opens, so a refusal leaves no FAILED run."""
    models.check_weights(params.weights)
    steps_per_epoch(params, manifest, layout.shards_dir)  # refuses a batch larger than the split
    check_distributable(params, manifest, strategy)
    lineage = models.weights_lineage(params.weights)
    identity = backup_identity(params, manifest.fingerprint, lineage)
    return TrainInputs(manifest, lineage, identity, store)


class Fitted(NamedTuple):
    """A fitted model, its epoch log, the epoch whose weights it holds and the input-bound
    probe of its last phase's step."""

    model: keras.Model
    epoch_log: EpochLog
    weights_epoch: int
    probe: Callable[[], dict[str, float]]


def train(
    params: TrainParams,
    layout: Layout,
    *,
    strategy: tf.distribute.Strategy | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    inputs: TrainInputs | None = None,
    join_timeout_s: float | None = None,
    checkpoint: CheckpointParams | None = None,
) -> TrainSummary:
    """Train ``params.model`` on the layout's train split (val for early stopping).

    Writes the model (Keras format) to ``layout.model_file`` and the summary: its numbers
    (``layout.train_metrics``, DVC's metrics), the rest (``layout.train_summary``), the
    per-epoch rows (``layout.train_history``, DVC plot data) and the plot. Resumable: state
    lives in ``layout.backup_dir`` until the run completes, and is resumed only by a run with
    the same params, shards and training code (else discarded, with the reason logged). Every
    worker calls this; the chief alone writes. ``inputs``: :func:`check_inputs`'s, where the
    caller checked them (:func:`run_train`, which may read the shards from object storage);
    else the layout's shard folder, checked here. ``join_timeout_s``: :func:`meet`'s.
    ``checkpoint``: how often to save inside an epoch (None: only on SIGTERM, which ends
    training with :class:`tasks.train.cluster.Preempted` once the state is saved).
    """
    # The strategy first: the multi-worker one must exist before any other TensorFlow op.
    strategy = strategy or choose_strategy()
    if inputs is None:
        inputs = check_inputs(params, layout, load_manifest(layout.shards_dir), strategy)
    chief = is_chief(strategy)
    dirs = BackupDirs.for_worker(layout.backup_dir, chief=chief, worker=worker_name(strategy))
    stored = claim_or_start_backup(layout.backup_dir, inputs.identity) if chief else None
    meet(strategy, join_timeout_s)  # the first collective: after the chief's claim, bounded
    policy = precision_policy(params, gpu=on_gpu(strategy))
    every_steps = checkpoint.every_steps if checkpoint else 0
    with global_precision(policy), stop_on_sigterm():
        fitted = fit_or_start_over(
            params, layout, inputs, dirs, strategy, callbacks, stored, every_steps
        )
    rows = read_epoch_log(fitted.epoch_log.path)
    # Every worker saves (TensorFlow may need each one to read its variables); the chief's
    # copy is the model. The same weights give the same bytes.
    save_model(fitted.model, layout.model_file if chief else dirs.write / "model.keras")
    summary = summarize(params, rows, fitted, strategy, policy, layout.model_file, inputs)
    if chief:
        write_outputs(summary, rows, layout)
    dirs.clean_up()  # completed: nothing left to resume (the others drop their scratch)
    return summary


def claim_or_start_backup(backup_dir: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The chief's backup of the same run (:func:`run_train` may have claimed it already),
    else a fresh one carrying ``identity``."""
    stored, _ = claim_backup(backup_dir, identity)
    if stored is None:
        write_identity(backup_dir, identity)
    return stored


@contextmanager
def global_precision(policy: str) -> Iterator[None]:
    """Keras's global precision policy set to ``policy`` for the block, then put back."""
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)


def fit_or_start_over(
    params: TrainParams,
    layout: Layout,
    inputs: TrainInputs,
    dirs: BackupDirs,
    strategy: tf.distribute.Strategy,
    callbacks: Sequence[keras.callbacks.Callback],
    stored: dict[str, Any] | None,
    every_steps: int = 0,
) -> Fitted:
    """:func:`fit_phases`, once more from nothing where the backup's identity matched but its
    state does not fit this model (the chief discards it, keeping the MLflow run it names)."""
    fit = partial(fit_phases, params, layout.shards_dir, inputs, dirs, strategy, callbacks)
    try:
        return fit(every_steps)
    except BackupUnusable as error:
        if is_chief(strategy):
            discard_backup(layout.backup_dir, [str(error)])
            run_id = (stored or {}).get("mlflow_run_id")
            write_identity(layout.backup_dir, inputs.identity, run_id)
        chief_value(strategy, 0.0)  # the backup is gone before anyone looks again
        return fit(every_steps)


def summarize(
    params: TrainParams,
    rows: list[dict[str, float]],
    fitted: Fitted,
    strategy: tf.distribute.Strategy,
    policy: str,
    model_file: Path,
    inputs: TrainInputs,
) -> TrainSummary:
    """The run's summary, once the model is saved: the probe's extra steps change the
    in-memory weights, never the model file."""
    # The model's own figures: early stopping may have put back an earlier epoch's weights,
    # and the last epoch's ("final") then describe weights the model file does not hold.
    kept = [row for row in rows if int(row["epoch"]) == fitted.weights_epoch]
    return TrainSummary(
        **history_summary(rows),
        model_epoch=fitted.weights_epoch + 1,  # counted from 1, as the plot rows
        model={key: kept[0][key] for key in ("val_loss", "val_accuracy")} if kept else {},
        input_bound=fitted.probe(),
        model_file=str(model_file),
        fingerprint=inputs.manifest.fingerprint,
        resumed_from_epoch=fitted.epoch_log.first_epoch or 0,
        precision_policy=policy,
        # Whether the step ran under XLA: train.xla as Keras resolved it for this model (off
        # under op determinism and for layers XLA cannot compile, such as RandomCrop).
        xla=bool(fitted.model.jit_compile),
        steps_per_execution=params.steps_per_execution,
        strategy=strategy_name(strategy),
        num_workers=num_workers(strategy),
        num_replicas=strategy.num_replicas_in_sync,
        chief=is_chief(strategy),
    )


def fit_phases(
    params: TrainParams,
    shards_dir: Path,
    inputs: TrainInputs,
    dirs: BackupDirs,
    strategy: tf.distribute.Strategy,
    callbacks: Sequence[keras.callbacks.Callback],
    every_steps: int = 0,
) -> Fitted:
    """Build the model and fit it: the frozen (or only) phase, then fine-tuning if asked.

    Each phase resumes from its own backup dir, saving inside an epoch every
    ``every_steps`` steps (0: only on SIGTERM). The frozen phase commits its end weights and
    epoch count before its backup goes, so a kill between the phases resumes fine-tuning
    from those weights instead of redoing the frozen phase.
    """
    seed_everything(params)
    manifest = inputs.manifest
    data = read_data(params, manifest, shards_dir, strategy, inputs.store)
    epoch_log = EpochLog(dirs.write / EPOCH_LOG_NAME)
    hooks = [epoch_log, *callbacks]
    with strategy.scope():
        model = build_model(params, len(manifest.classes), manifest.record_schema.image_shape)
        compile_model(model, params, params.learning_rate, data.steps_per_epoch * params.epochs)
    steps = step_functions(model, strategy, data, params.steps_per_execution)
    fine_tune = params.fine_tune_layers > 0 and params.fine_tune_epochs > 0
    done = train_backup.restore_main_phase(model, dirs) if fine_tune else None
    if done is None:
        main = Phase(0, params.epochs, dirs.phase("main"), every_steps)
        done, weights_epoch = fit_phase(
            model, data, main, strategy, steps, params=params, callbacks=hooks
        )
        if not fine_tune:  # the only phase: the model holds its kept epoch
            return Fitted(
                model, epoch_log, weights_epoch, partial(probe_input_bound, steps.train, data)
            )
        train_backup.commit_main_phase(model, dirs, done)
    # Fine-tuning: the model holds the epoch this phase keeps, whatever the frozen one kept.
    with strategy.scope():
        unfreeze_top(model, params.fine_tune_layers)
        lr = params.learning_rate * FINE_TUNE_LR_FACTOR
        compile_model(model, params, lr, data.steps_per_epoch * params.fine_tune_epochs)
    tune_steps = step_functions(model, strategy, data, params.steps_per_execution)  # new set
    tune = Phase(done, done + params.fine_tune_epochs, dirs.phase("fine_tune"), every_steps)
    _, weights_epoch = fit_phase(
        model, data, tune, strategy, tune_steps, params=params, callbacks=hooks
    )
    return Fitted(
        model, epoch_log, weights_epoch, partial(probe_input_bound, tune_steps.train, data)
    )


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


# -- the stage -----------------------------------------------------------------------------


def run_train(
    params: Params,
    layout: Layout,
    *,
    strategy: tf.distribute.Strategy | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    run_tags: dict[str, str] | None = None,
) -> TrainedRun:
    """Gate on validation, open (or resume) an MLflow run, train, record the run for evaluate.
    Every worker runs this; the chief alone tracks (``run_tags`` on a new MLflow run)."""
    from tasks.contracts import run_records
    from tasks.runtime import tracking

    keras_without_extras()  # Keras's config held at its defaults, whatever keras.json says
    if strategy is None:
        # Before the strategy: hiding GPUs (train.accelerator: cpu) must precede TensorFlow's
        # runtime, and a refusal must precede every collective of a multi-worker run.
        select_accelerator(params.train.accelerator)
    strategy = strategy or choose_strategy(params.cluster.join_timeout_s)  # first: see train
    inputs = validated_inputs(params, layout, strategy)  # refused before a run opens
    timeout = params.cluster.join_timeout_s
    if not is_chief(strategy):
        return TrainedRun(
            train(
                params.train,
                layout,
                strategy=strategy,
                callbacks=callbacks,
                inputs=inputs,
                join_timeout_s=timeout,
                checkpoint=params.checkpoint,
            )
        )
    if untracked := models.untracked_weights(params.train.weights):
        log.warning(untracked)
    client = tracking.client(layout.root)
    run_id, resumed = open_run(client, params, layout, inputs, strategy, run_tags)
    try:
        with run_records.system_metrics(client, run_id, resume=resumed):
            summary = train(
                params.train,
                layout,
                strategy=strategy,
                callbacks=[MlflowEpochMetrics(client, run_id), *callbacks],
                inputs=inputs,
                join_timeout_s=timeout,
                checkpoint=params.checkpoint,
            )
    except BaseException:
        client.set_terminated(run_id, status="FAILED")  # the id stays in the backup to resume
        raise
    return TrainedRun(summary, finish_run(client, run_id, layout, summary))


def validated_inputs(
    params: Params, layout: Layout, strategy: tf.distribute.Strategy
) -> TrainInputs:
    """The shards a passing validation vouches for, from the object store when one is
    configured (SHARDFLOW_SHARDS_URL), else the layout's folder, checked for training."""
    store = open_store(layout.root, params.storage)
    if store:
        manifest = check_validated_store(store, layout.validation_report)
    else:
        manifest = check_validated(layout.shards_dir, layout.validation_report)
    return check_inputs(params.train, layout, manifest, strategy, store)


def open_run(
    client: Any,
    params: Params,
    layout: Layout,
    inputs: TrainInputs,
    strategy: tf.distribute.Strategy,
    run_tags: dict[str, str] | None,
) -> tuple[str, bool]:
    """The MLflow run to train in and whether it is resumed: the one the claimed backup
    names, reopened, else a new one (tagged with why a backup found was not resumed). The
    backup then names it."""
    from tasks.contracts import run_records

    stored, discarded = claim_backup(layout.backup_dir, inputs.identity)
    run_id = resume_run_id(client, (stored or {}).get("mlflow_run_id"))
    resumed = run_id is not None
    if run_id is None:
        run_id = run_records.start_train_run(
            client,
            params,
            inputs.manifest,
            shards_dir=inputs.store.url if inputs.store else layout.shards_dir,
            root=layout.root,
            device_tags=device_tags(params.train, strategy),
            run_tags=run_tags,
            inputs=inputs.lineage,
        )
        if discarded:  # the run says why it did not resume the backup it found
            client.set_tag(run_id, "resume.backup_discarded", "; ".join(discarded)[:5000])
    write_identity(layout.backup_dir, inputs.identity, run_id)
    return run_id, resumed


def finish_run(client: Any, run_id: str, layout: Layout, summary: TrainSummary) -> TrainRunRecord:
    """Log what no epoch logged and the output files, end the run, and leave its record
    for evaluate (``layout.train_run``)."""
    from tasks.runtime import tracking

    log_run_figures(client, run_id, summary)
    client.set_tag(run_id, "device.xla", str(summary.xla).lower())
    for path in (layout.train_metrics, layout.train_summary, layout.train_history):
        client.log_artifact(run_id, str(path), "train")
    client.log_artifact(run_id, str(layout.train_plot), "train")
    client.set_terminated(run_id, status="FINISHED")
    run = client.get_run(run_id)
    record = TrainRunRecord(
        run_id=run_id,
        experiment_id=run.info.experiment_id,
        tracking_uri=tracking.recorded_uri(client.tracking_uri, layout.root),
        fingerprint=summary.fingerprint,
        run_name=run.info.run_name,
    )
    write_json(layout.train_run, record.to_json())
    return record


def log_run_figures(client: Any, run_id: str, summary: TrainSummary) -> None:
    """The run's figures that no epoch logged, as metrics (step 0): the input-bound probe's,
    and the figures of the epoch whose weights the model holds (``model_val_accuracy``,
    ``model_val_loss``, ``model_epoch``): the runs table's ``val_accuracy`` is the last
    epoch's, which early stopping may not have kept."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    figures = {
        **summary.input_bound,
        **{f"model_{key}": value for key, value in summary.model.items()},
        "model_epoch": summary.model_epoch,
    }
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
