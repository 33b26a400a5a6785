"""Is training input-bound? The production training run's own probe, one spawned run per model.

``tasks.train.stage.train`` trains for one epoch on the shards, then times its compiled step fed by
the shard reader against the same step fed one batch already in memory
(``tasks.train.loop.probe_input_bound``): the figure every MLflow run logs. The bench runs that
code, not a copy of it, in a fresh spawned process per run, because op determinism, the
precision policy and XLA are process-wide in TensorFlow.
"""

from __future__ import annotations

import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tasks.runtime.params import TrainParams

# One epoch is enough: the probe times steps after training, on the traced step.
EPOCHS = 1


def input_params(
    params: TrainParams,
    model: str,
    *,
    mixed_precision: bool | None,
    xla: bool | None,
    crop: float | None = None,
) -> TrainParams:
    """``params`` for one measured run of ``model``: one epoch, from scratch, no fine-tuning;
    ``None`` keeps params.yaml's value.

    XLA needs op determinism off (Keras turns ``jit_compile`` off under it), so asking for
    XLA turns determinism off; both are recorded with the figure. Keras also turns it off
    for a model with a random crop (``RandomCrop`` does not support XLA): ``crop=0`` drops it.
    """
    xla = params.xla if xla is None else xla
    augment = params.augment if crop is None else params.augment.model_copy(update={"crop": crop})
    return params.model_copy(
        update={
            "augment": augment,
            "model": model,
            "weights": None,  # nothing is downloaded: random weights time the same
            "epochs": EPOCHS,
            "fine_tune_layers": 0,
            "fine_tune_epochs": 0,
            "early_stopping_patience": 0,
            "mixed_precision": (
                params.mixed_precision if mixed_precision is None else mixed_precision
            ),
            "xla": xla,
            "deterministic": params.deterministic and not xla,
        }
    )


def measure_input_bound(shards_dir: Path, params: TrainParams, work: Path) -> dict[str, Any]:
    """One production training run of ``params`` in a spawned process, from nothing in
    ``work`` (no backup to resume); its probe's figures."""
    shutil.rmtree(work, ignore_errors=True)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_train_and_probe, shards_dir, params, work).result()


def _train_and_probe(shards_dir: Path, params: TrainParams, work: Path) -> dict[str, Any]:
    import tensorflow as tf

    from tasks.runtime.layout import Layout
    from tasks.train.stage import train

    layout = Layout(work)  # a scratch project whose shard folder is the bench's shards
    layout.shards_dir.parent.mkdir(parents=True, exist_ok=True)
    layout.shards_dir.symlink_to(shards_dir.resolve(), target_is_directory=True)
    summary = train(params, layout)
    probe = summary.input_bound
    gpus = tf.config.list_physical_devices("GPU")
    return {
        "ratio": probe["input_bound_ratio"],
        "step_ms_reader": round(probe["step_ms_reader"], 3),
        "step_ms_in_memory": round(probe["step_ms_in_memory"], 3),
        "model": params.model,
        "batch_size": params.batch_size,
        "precision_policy": summary.precision_policy,
        "xla_asked": params.xla,
        "xla": summary.xla,  # as Keras resolved it for this model
        "deterministic": params.deterministic,
        "augment": params.augment.model_dump(),
        "devices": [
            tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
            for gpu in gpus
        ]
        or ["cpu"],
    }
