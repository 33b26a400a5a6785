"""Side by side: one epoch of the same model on the same images, fed by each loader a user
picks between, and the same epoch fed one batch already in memory.

The feeds: ``raw`` and ``jpeg`` (``read_split`` on raw and on JPEG shards), ``folder``
(``keras.utils.image_dataset_from_directory`` over the source folder, decoding every file
every epoch) and ``seed`` (the seeds' recipe: ``TFRecordDataset`` + ``parse_single_example``
+ decode + resize, in a serial map). Each model trains with Keras ``fit`` under the run's
precision policy and XLA setting, in a spawned process of its own (the policy is
process-wide), every feed on the same compiled step. Figures per feed: images/s over the
epoch and the input-bound ratio (that epoch's time over the in-memory epoch's).
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import read as r
from tasks.runtime.params import TrainParams

if TYPE_CHECKING:
    import tensorflow as tf

FEEDS = ("raw", "jpeg", "folder", "seed")
MODELS = ("small_cnn", "efficientnet_b0", "resnet50")
# Per-GPU batches: the published ResNet-50 figures (MLPerf, NVIDIA's examples) train at 256
# per GPU; the other models at 64, the batch of the GPU figures in docs/performance.md.
BATCH_PER_GPU = {"small_cnn": 64, "efficientnet_b0": 64, "resnet50": 256}
WARMUP_STEPS = 3  # traces the step for this feed's dtypes before the timed epoch


@dataclass(frozen=True)
class FeedSet:
    """The same images four ways, at ``size``: the source folder, raw and JPEG shards of it
    (every image in train), and the seeds' one-file TFRecord of its original JPEGs."""

    source_dir: Path
    raw_shards: Path
    jpeg_shards: Path
    seed_file: Path
    size: tuple[int, int]
    classes: int


def feed_batch(model: str, gpus: int) -> int:
    """The global batch of ``model``'s run: its per-GPU batch on every GPU (one on the CPU)."""
    return BATCH_PER_GPU[model] * max(gpus, 1)


def feed_dataset(name: str, feeds: FeedSet, batch: int) -> tf.data.Dataset:
    """One epoch of ``(images, labels)`` batches from feed ``name``."""
    if name == "raw":
        return r.shardflow_dataset(feeds.raw_shards, batch=batch)
    if name == "jpeg":
        return r.shardflow_dataset(feeds.jpeg_shards, batch=batch)
    if name == "folder":
        return r.folder_dataset(feeds.source_dir, size=feeds.size, batch=batch)
    if name == "seed":
        return r.seed_dataset(feeds.seed_file, size=feeds.size, batch=batch)
    raise ValueError(f"unknown feed {name!r}; choose one of {FEEDS}")


def timed_epoch(model: Any, ds: tf.data.Dataset, steps: int) -> float:
    """Seconds of ``steps`` training steps on ``ds``, the last step's result waited for."""
    start = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    return time.perf_counter() - start


def measure_feed(model: Any, ds: tf.data.Dataset, batch: int) -> dict[str, Any]:
    """One epoch of ``model`` fed by ``ds`` and the same steps fed its first batch from
    memory: images/s and the input-bound ratio."""
    import tensorflow as tf

    steps = r.epoch_images(ds) // batch  # whole batches of one epoch (also warms the files)
    if steps < 1:
        raise ValueError(f"fewer images than one batch of {batch}: add images or lower it")
    model.fit(ds.repeat(), epochs=1, steps_per_epoch=min(WARMUP_STEPS, steps), verbose=0)
    fed_s = timed_epoch(model, ds.repeat(), steps)
    first = next(iter(ds))
    in_memory = tf.data.Dataset.from_tensors(first).repeat()
    model.fit(in_memory, epochs=1, steps_per_epoch=min(WARMUP_STEPS, steps), verbose=0)
    memory_s = timed_epoch(model, in_memory, steps)
    return {
        "images_per_s": round(steps * batch / fed_s, 2),
        "input_bound_ratio": round(fed_s / memory_s, 4),
        "steps": steps,
        "epoch_s": round(fed_s, 3),
        "in_memory_epoch_s": round(memory_s, 3),
    }


def measure_model(
    feeds: FeedSet, params: TrainParams, feed_names: tuple[str, ...]
) -> dict[str, Any]:
    """Every feed of ``feed_names`` through one compiled ``params.model``, in a spawned
    process (precision policy and op determinism are process-wide)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_measure_model, feeds, params, feed_names).result()


def _measure_model(
    feeds: FeedSet, params: TrainParams, feed_names: tuple[str, ...]
) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from tasks.train.models import build_model
    from tasks.train.stage import compile_model, precision_policy, seed_everything

    gpus = len(tf.config.list_physical_devices("GPU"))
    policy = precision_policy(params, gpu=bool(gpus))
    keras.mixed_precision.set_global_policy(policy)
    seed_everything(params)
    model = build_model(params, feeds.classes, (*feeds.size, 3))
    compile_model(model, params, params.learning_rate, total_steps=1)
    result: dict[str, Any] = {
        "model": params.model,
        "batch_size": params.batch_size,
        "precision_policy": policy,
        "xla": bool(model.jit_compile),
        "gpus": gpus,
        "feeds": {},
    }
    for name in feed_names:
        ds = feed_dataset(name, feeds, params.batch_size)
        result["feeds"][name] = measure_feed(model, ds, params.batch_size)
    return result
