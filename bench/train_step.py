"""Is training input-bound? Step time fed by ``read_split`` over step time fed from memory.

The synthetic feed repeats one real batch already in memory (``Dataset.from_tensors``), so
the two runs differ only in where batches come from.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from bench.stats import median
from tasks.params import TrainParams
from tasks.reader import read_split


def build_default_model(
    params: TrainParams, num_classes: int, image_shape: tuple[int, int, int]
) -> tuple[Any, str]:
    """The project's default model, or a small CNN stand-in while tasks.models is missing."""
    import keras

    try:
        from tasks.models import build_model
    except ImportError:
        model = keras.Sequential(
            [
                keras.Input(image_shape),
                keras.layers.Rescaling(1.0 / 255),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(128, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(num_classes),
            ]
        )
        return model, "stand-in small CNN (tasks.models.build_model not found)"
    return build_model(
        params, num_classes, image_shape
    ), f"tasks.models.build_model({params.model})"


def step_times(model: Any, ds: Any, *, steps: int, warmup: int) -> list[float]:
    """Seconds per train step (incl. waiting for data) for ``steps`` steps after ``warmup``."""
    import keras

    stamps: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            stamps.append(time.perf_counter())

    model.fit(ds, epochs=1, steps_per_epoch=warmup + steps + 1, callbacks=[Stamp()], verbose=0)
    deltas = [b - a for a, b in itertools.pairwise(stamps)]
    return deltas[warmup:]


def input_bound_ratio(
    shards_dir: Path, params: TrainParams, *, steps: int, warmup: int
) -> dict[str, Any]:
    """Median step time fed by the shard reader over median step time fed from memory."""
    import keras
    import tensorflow as tf

    from tasks.manifest import load_manifest

    manifest = load_manifest(shards_dir)
    schema = manifest.record_schema
    real = read_split(shards_dir, "train", batch_size=params.batch_size, training=True, seed=0)
    batch = next(iter(real))
    synthetic = tf.data.Dataset.from_tensors(batch).repeat()

    times: dict[str, list[float]] = {}
    model_note = ""
    for name, ds in (
        ("synthetic", synthetic),
        ("real", real.repeat()),
        ("synthetic_again", synthetic),
    ):
        keras.utils.set_random_seed(params.seed)
        model, model_note = build_default_model(params, len(manifest.classes), schema.image_shape)
        model.compile(
            optimizer=keras.optimizers.Adam(params.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=_logits(model)),
            jit_compile=params.xla,
        )
        times[name] = step_times(model, ds, steps=steps, warmup=warmup)
    # Synthetic runs before and after the real one, so drift in machine load cancels out.
    synthetic_s = median(times["synthetic"] + times["synthetic_again"])
    real_s = median(times["real"])
    return {
        "ratio": real_s / synthetic_s,
        "real_step_ms": round(real_s * 1000, 3),
        "synthetic_step_ms": round(synthetic_s * 1000, 3),
        "real_mean_step_ms": round(sum(times["real"]) / len(times["real"]) * 1000, 3),
        "steps": steps,
        "batch_size": params.batch_size,
        "image_shape": list(schema.image_shape),
        "model": model_note,
    }


def _logits(model: Any) -> bool:
    """True unless the model ends in a softmax (then the loss takes probabilities)."""
    activation = getattr(model.layers[-1], "activation", None)
    return getattr(activation, "__name__", "") != "softmax"
