"""Read throughput: images/s of batched (image, label) over whole epochs, per input recipe.

Each ``*_dataset`` builds one pipeline; :func:`measure_reads` times them all together: a
warm-up epoch of each, then ``passes`` rounds in which each pipeline reads whole epochs for at
least ``seconds``, in turns, so the ratios between them hold on a noisy machine. All yield
batches of ``size`` images at ``batch``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.images import list_images
from bench.stats import alternating_passes, for_at_least
from tasks.contracts.manifest import load_manifest
from tasks.contracts.shard_store import SHARD_READ_CHUNK
from tasks.contracts.tf_reader import ReadOrder, read_split, shard_records
from tasks.schema import IMAGE_KEY

if TYPE_CHECKING:
    import tensorflow as tf


def epoch_images(ds: tf.data.Dataset) -> int:
    """Iterate one epoch; return how many images it yielded."""
    count = 0
    for images, _labels in ds:
        count += int(images.shape[0])
    return count


def measure_reads(
    datasets: dict[str, tf.data.Dataset], *, passes: int, seconds: float
) -> dict[str, dict[str, Any]]:
    """images/s of every pipeline (:func:`bench.stats.alternating_passes`), each timed pass
    reading whole epochs for at least ``seconds``."""
    for ds in datasets.values():
        epoch_images(ds)  # warm-up: tracing, thread pools, file cache
    runs = {
        name: for_at_least(functools.partial(epoch_images, ds), seconds)
        for name, ds in datasets.items()
    }
    return alternating_passes(runs, passes=passes, warmup=0)


def folder_dataset(source_dir: Path, *, size: tuple[int, int], batch: int) -> tf.data.Dataset:
    """What a Keras user picks first: decode and resize every file on every epoch."""
    import keras
    import tensorflow as tf

    ds = keras.utils.image_dataset_from_directory(
        source_dir, image_size=size, batch_size=batch, shuffle=True, seed=0, verbose=False
    )
    return ds.prefetch(tf.data.AUTOTUNE)


def write_seed_tfrecord(source_dir: Path, path: Path) -> int:
    """The seeds' writer: one file, the original JPEG bytes and the label in an Example."""
    import tensorflow as tf

    images = list_images(source_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for file, label in images:
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[file.read_bytes()])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    return len(images)


def seed_dataset(path: Path, *, size: tuple[int, int], batch: int) -> tf.data.Dataset:
    """The seeds' reader: parse_single_example + decode + resize in a serial map, then batch."""
    import tensorflow as tf

    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(example: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        features = tf.io.parse_single_example(example, spec)
        image = tf.io.decode_jpeg(features["image"], channels=3)
        return tf.image.resize(image, size), features["label"]

    ds = tf.data.TFRecordDataset(str(path)).map(parse).batch(batch)
    # The recipe's map is serial. Left alone, tf.data's default `map_parallelization` rewrite
    # sometimes parallelises it, and the baseline would flip between a serial and a parallel
    # rate from run to run; pin it to what the recipe says.
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False
    return ds.with_options(options)


def ceiling_dataset(
    encoded: list[bytes], labels: list[int], *, size: tuple[int, int] | None, batch: int
) -> tf.data.Dataset:
    """Decode (+ resize when ``size``) JPEG bytes already in memory, on every core: no I/O."""
    import tensorflow as tf

    def decode(data: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        image = tf.io.decode_jpeg(data, channels=3)
        return (tf.image.resize(image, size) if size else image), label

    ds = tf.data.Dataset.from_tensor_slices((encoded, labels))
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch).prefetch(tf.data.AUTOTUNE)


def source_jpegs(source_dir: Path) -> tuple[list[bytes], list[int]]:
    images = list_images(source_dir)
    return [file.read_bytes() for file, _ in images], [label for _, label in images]


def shard_image_bytes(shards_dir: Path, split: str = "train") -> tuple[list[bytes], list[int]]:
    """The encoded image feature of every record of a split, via the shared record schema."""
    import tensorflow as tf

    manifest = load_manifest(shards_dir)
    schema = manifest.record_schema
    files = [str(shards_dir / s.file) for s in manifest.split(split).shards]
    ds = tf.data.TFRecordDataset(files, compression_type=manifest.compression_type).batch(256)
    encoded: list[bytes] = []
    labels: list[int] = []
    for serialized in ds:
        features = tf.io.parse_example(serialized, schema.parse_spec())
        encoded.extend(features[IMAGE_KEY].numpy().tolist())
        labels.extend(features["label"].numpy().tolist())
    return encoded, labels


def shardflow_dataset(
    shards_dir: Path, *, batch: int, order: ReadOrder = "global"
) -> tf.data.Dataset:
    """One training epoch as training reads it; ``order="buffered"`` is the reader before the
    global order (files interleaved, records through a shuffle buffer), kept as the reference."""
    return read_split(shards_dir, "train", batch_size=batch, training=True, seed=0, order=order)


def first_batch_share(
    shards_dir: Path, *, batch: int, order: ReadOrder = "global", epochs: int = 4
) -> dict[str, Any]:
    """How long the first batch of an epoch takes, as a share of that epoch's time, read as
    training reads epochs (``tasks.train.loop.TrainInput``): one iterator over them, each
    epoch seeded by its own number, a prefetch over them all.

    Epoch 0 is left out (tracing, thread pools, file cache); ``share`` is the median over
    epochs 1 and later of (time from the previous epoch's last batch to this epoch's first)
    over (this epoch's time)."""
    import statistics
    import time

    import tensorflow as tf

    from tasks.train.loop import epoch_seed

    steps = load_manifest(shards_dir).split("train").num_records // batch

    @tf.autograph.experimental.do_not_convert  # as training builds its epochs
    def one(number: tf.Tensor) -> tf.data.Dataset:
        return read_split(
            shards_dir, "train", batch_size=batch, training=True, seed=epoch_seed(0, number),
            order=order,
        ).take(steps)  # fmt: skip

    iterator = iter(tf.data.Dataset.range(epochs).flat_map(one).prefetch(tf.data.AUTOTUNE))
    shares, firsts = [], []
    for number in range(epochs):
        start = time.perf_counter()
        next(iterator)
        first = time.perf_counter() - start
        for _ in range(steps - 1):
            next(iterator)
        if number:
            firsts.append(first)
            shares.append(first / (time.perf_counter() - start))
    return {
        "share": round(statistics.median(shares), 4),
        "first_batch_s": [round(f, 4) for f in firsts],
        "shares": [round(s, 4) for s in shares],
    }


def order_memory(sizes: dict[str, int], *, batch: int = 64) -> dict[str, Any]:
    """Peak bytes (tracemalloc) held while computing a whole epoch's global order batch by
    batch, per split size: the order's own memory, which must not grow with the split. The
    offset table beside it (``SplitLocations``: 16 bytes a record) is the split's index and
    is reported apart."""
    import tracemalloc

    import numpy as np

    from tasks.contracts.record_order import EpochOrder, batch_record_ids, epoch_steps

    figures: dict[str, Any] = {}
    for key, size in sizes.items():
        tracemalloc.start()
        order = EpochOrder(size, 0)
        checksum = 0
        for step in range(epoch_steps(size, batch)):
            checksum ^= int(np.bitwise_xor.reduce(batch_record_ids(order, step, batch)))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        figures[key] = round(peak / 1024, 2)
    figures["offsets_bytes_per_record"] = 4 + 8 + 8
    return figures


def bytes_dataset(shards_dir: Path, *, batch: int, split: str = "train") -> tf.data.Dataset:
    """The physical limit of ``read.raw``: the same shard files as bare serialized records.

    Read (:func:`tasks.contracts.tf_reader.shard_records`) and interleaved like
    :func:`tasks.contracts.tf_reader.read_split` reads them, batched, never parsed or decoded: what
    is
    left of a read once every copy after the file read is gone.
    """
    import tensorflow as tf

    manifest = load_manifest(shards_dir)
    files = [str(shards_dir / s.file) for s in manifest.split(split).shards]
    ds = tf.data.Dataset.from_tensor_slices(files)
    ds = ds.interleave(
        lambda path: shard_records(path, manifest),
        cycle_length=min(len(files), 8),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    ds = ds.batch(batch, drop_remainder=True)
    return ds.map(lambda records: (records, records)).prefetch(tf.data.AUTOTUNE)


class ColdS3Read:
    """``read.s3``: each epoch reads the raw train split from an S3 server through an emptied
    shard cache (:class:`tasks.contracts.shard_store.ShardStore`), exactly as training reads it: one
    store and one pipeline for the run, as in training, cold for every epoch. Iterating it
    yields one cold epoch's batches, so :func:`measure_reads` times it beside the others."""

    def __init__(self, url: str, root: Path, *, batch: int, prefetch: int) -> None:
        from tasks.contracts.shard_store import ShardStore

        self.store = ShardStore(url, root, max_bytes=2**40, prefetch=prefetch)
        self.ds = read_split(
            root, "train", batch_size=batch, training=True, seed=0, store=self.store
        )

    def __iter__(self) -> Any:
        self.store.clear()  # cold: every shard is downloaded and checked again
        return iter(self.ds)


class S3BytesCeiling:
    """``read.s3_bytes_ceiling``: the S3 server's bare whole-object read of the same shards,
    ``prefetch`` objects at a time (as the store downloads them), bytes dropped on arrival.
    Like the store, it keeps one client (its connections) and one pool of ``prefetch``
    threads for the run. Yields one array per shard whose length is the shard's record
    count, so the figure is in images/s like the rest."""

    def __init__(self, url: str, shards_dir: Path, *, prefetch: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from tasks.contracts.shard_store import s3_client, split_url

        self.bucket, self.prefix = split_url(url)
        self.shards = load_manifest(shards_dir).split("train").shards
        self.client = s3_client()
        self.pool = ThreadPoolExecutor(prefetch)

    def get(self, name: str) -> int:
        body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"]
        size = 0
        with body:
            while block := body.read(SHARD_READ_CHUNK):
                size += len(block)
        return size

    def __iter__(self) -> Any:
        import numpy as np

        sizes = self.pool.map(self.get, [s.file for s in self.shards])
        for shard, _ in zip(self.shards, sizes, strict=True):
            yield np.empty(shard.num_records, dtype=np.uint8), None
