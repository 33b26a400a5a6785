"""The public shard reader: the only way training, evaluation and benchmarks see data.

It depends on the manifest and the record schema, never on the code that wrote the shards.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tasks.contracts.manifest import ShardManifest, load_manifest
from tasks.contracts.numpy_reader import OFFSETS_NAME, checked_offsets, read_entry
from tasks.contracts.raw_slice import RangeReadSchema, range_read, read_records_at
from tasks.contracts.record_order import (
    EpochOrder,
    SplitLocations,
    epoch_steps,
    slices_record_ids,
)
from tasks.schema import IMAGE_KEY, LABEL_KEY

if TYPE_CHECKING:
    import tensorflow as tf

    from tasks.contracts.shard_store import ShardStore


# Records held by the training shuffle buffer are capped by bytes, not count: 2048 raw
# 224x224 records would hold ~300 MB and stall every epoch while the buffer fills.
SHUFFLE_BUFFER_BYTES = 64 * 2**20
MAX_SHUFFLE_RECORDS = 4096
# Shards are local files: an unbuffered TFRecordDataset reads each record straight into its
# tensor, where the default 256 KiB buffer copies every record once more on its way there
# (CPU that raw records feel; jpeg records are too small for it to show).
READ_BUFFER_BYTES = 0


ReadOrder = Literal["global", "buffered"]
# Batches the training read keeps ready ahead of the step, beside the ones its parallel reads
# have in flight: a bounded read-ahead, never a buffer that must fill before the first batch.
READ_AHEAD_BATCHES = 2
# Replica batches located per Python call of the global order: one call a batch held the
# interpreter on tf.data's threads once per batch (the raw read at 0.8 of its rate with
# locations known ahead); a few at a time cost the same as none, in memory that stays a
# few batches of ids.
LOCATE_CHUNK = 8


def read_split(
    shards_dir: str | Path,
    split: str,
    *,
    batch_size: int,
    training: bool,
    seed: int | tf.Tensor | None = None,
    shuffle_buffer: int | None = None,
    manifest: ShardManifest | None = None,
    with_metadata: bool = False,
    file_shard: tuple[int, int] | None = None,
    store: ShardStore | None = None,
    ordered: bool = True,
    order: ReadOrder = "global",
    first_step: int | tf.Tensor = 0,
    replicas: tuple[int, int, int] = (0, 1, 1),
) -> tf.data.Dataset:
    """Batched ``(images, labels)`` of one split: uint8 [B, H, W, 3] and int32 [B].

    ``training=False`` reads in manifest order and keeps every record. ``training=True`` reads
    one epoch: with ``order="global"`` (the default) the epoch is a seeded permutation of the
    whole split (:mod:`tasks.contracts.record_order`, ``seed`` the epoch's own), ``batch_size``
    the global batch, the last partial batch dropped, each record read at its offset
    (:func:`tasks.contracts.raw_slice.read_records_at`) from ``first_step`` on, so a resumed
    run reads exactly what an uninterrupted one read there; ``replicas=(first, local, total)``
    yields, for each global batch, its slices ``first .. first + local - 1`` of ``total`` equal
    ones (one worker's replicas), so every number of workers reads the same global batches.
    GZIP shards cannot be entered at an offset: they are read as ``order="buffered"`` reads,
    files shuffled and interleaved 8 at a time, records shuffled in a buffer
    (``shuffle_buffer`` records, sized by bytes), ``file_shard=(i, n)`` taking files i, i + n,
    ...; each element is one replica's batch (``batch_size`` over ``replicas``' total), an
    epoch the global order's count of steps (a worker with fewer records wraps around), and
    a ``first_step`` there replays the epoch and drops the batches before it. Either order
    yields, from ``first_step`` on, that epoch's remaining steps, ``local`` batches each.
    The dataset's length is known without a scan. ``with_metadata=True`` yields the parsed
    feature dict instead (adds ``content_hash`` and ``source``), for evaluation reports. With
    a ``store`` (tasks.contracts.shard_store), shards come from object storage instead of
    ``shards_dir``, each sha256-checked before any of its records is read.
    ``ordered=False`` lets training take batches as they are ready instead of in the seed's
    order (faster where one read lags; training only).
    """
    import tensorflow as tf

    shards_dir = Path(shards_dir)
    manifest = manifest or (store.manifest() if store else load_manifest(shards_dir))
    if training and order == "global" and manifest.compression == "none":
        return _global_epoch(
            shards_dir,
            split,
            manifest,
            batch_size=batch_size,
            seed=seed,
            store=store,
            ordered=ordered,
            with_metadata=with_metadata,
            first_step=first_step,
            replicas=replicas,
        ).with_options(read_options())
    files, num_records = split_files(shards_dir, split, manifest, file_shard, store)
    steps = epoch_steps(manifest.split(split).num_records, batch_size)  # global batches
    batch_size = batch_size // replicas[2] if training else batch_size  # one replica's slice
    deterministic = not training or (ordered and seed is not None)
    buffer = shuffle_buffer or default_shuffle_buffer(manifest, split)
    ds = tf.data.Dataset.from_tensor_slices(files)
    # Shuffle the file order first, then interleave records from several files at once.
    ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True) if training else ds
    ds = fetched_from(store, manifest, ds) if store else ds
    ds = ds.interleave(
        plain(lambda path: shard_records(path, manifest)),
        cycle_length=min(len(files), 8) if training else 1,
        block_length=1 if training else None,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=deterministic,
    )
    ds = ds.apply(tf.data.experimental.assert_cardinality(num_records))
    # Shuffle serialized records (small for jpeg/png) before any decoding.
    ds = ds.shuffle(buffer, seed=seed, reshuffle_each_iteration=True) if training else ds
    # Batch serialized records first: batching moves the record strings (no copy), parsing
    # is vectorised per batch, and raw pixels are sliced from the record bytes without the
    # copy parse_example makes of each image (RecordSchema.parse_batch). For jpeg/png,
    # decoding inside the batch measured as fast as per-record parallel decode before
    # batching. Parsing and picking (image, label) are one map: training skips the metadata
    # entirely. Raw pixels are copied once, from their offset in each record (range_read);
    # stock ops, where its op is not built, copy the record's head, then slice.
    ds = ds.batch(batch_size, drop_remainder=training)
    # An epoch is a count of steps, each one batch per replica: a worker whose files hold
    # fewer records wraps around within it; a resumed epoch replays its order and drops the
    # batches already trained on.
    epoch = ds.repeat().take(steps * replicas[1]).skip(first_step * replicas[1])
    ds = epoch if training else ds
    parse = batch_parser(manifest, with_metadata=with_metadata)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(read_options())


def read_options(threads: int | None = None) -> tf.data.Options:
    """The tf.data options of every read: tf.data's autotuner off, so each parallel map runs
    on as many threads as the pipeline's pool holds (every core, or a private pool of
    ``threads``, which a training pipeline beside GPUs sets) and the read-ahead is what the
    reader sets. With the autotuner on, deleting an iterator waited for its thread (0.6 to
    1.0 s of a 1.7-s epoch read from a store, one epoch in three), and on 2 cores it took a
    jpeg read's maps down to 0.65 of their rate mid-run (docs/performance.md)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    if threads is not None:
        options.threading.private_threadpool_size = threads
    return options


def _global_epoch(
    shards_dir: Path,
    split: str,
    manifest: ShardManifest,
    *,
    batch_size: int,
    seed: int | tf.Tensor | None,
    store: ShardStore | None,
    ordered: bool,
    with_metadata: bool,
    first_step: int | tf.Tensor,
    replicas: tuple[int, int, int],
) -> tf.data.Dataset:
    """One epoch of ``split`` in its seeded global order (see :func:`read_split`)."""
    import tensorflow as tf

    locations = split_locations(shards_dir, split, manifest, store)
    first, local, total = replicas
    steps = epoch_steps(len(locations), batch_size)
    if not steps:
        raise ValueError(
            f"{shards_dir}: split {split!r} holds {len(locations)} records, fewer than one "
            f"batch of {batch_size}; lower the batch size"
        )
    if batch_size % total:  # the order refuses it too, but only once the first read runs
        raise ValueError(
            f"batch size {batch_size} does not split into {total} equal replica batches; "
            "make it a multiple of the replicas"
        )
    seed = random.SystemRandom().randrange(2**63) if seed is None else seed
    locate = _locator(locations, batch_size, first, local, total)
    files, end, width = locations.files, steps * local, batch_size // total

    def located(start: tf.Tensor) -> tuple[tf.Tensor, ...]:
        out = tf.numpy_function(
            locate, [seed, start, end], [tf.int32, tf.int64, tf.int64], stateful=False
        )
        return tuple(tf.ensure_shape(x, [None, width]) for x in out)

    # One element per replica slice of each global batch, from the resumed step on: a
    # position maps to its record on its own, so nothing before it is read or buffered.
    ds = tf.data.Dataset.range(first_step * local, end, LOCATE_CHUNK)
    ds = fetched_first(store, manifest.split(split).shards, ds) if store else ds
    ds = ds.map(plain(located)).unbatch()
    # unbatch hides the count; an epoch's length stays known without a scan
    ds = ds.apply(tf.data.experimental.assert_cardinality(end - first_step * local))
    schema = range_read(manifest.record_schema)
    if isinstance(schema, RangeReadSchema) and not with_metadata:
        # raw pixels read from the files straight into the batch: no record strings
        read = plain(lambda *where: schema.read_at(files, *where))
        ds = ds.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=ordered)
        return ds.prefetch(READ_AHEAD_BATCHES)
    read = plain(lambda *where: read_records_at(files, *where))
    ds = ds.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=ordered)
    parse = batch_parser(manifest, with_metadata=with_metadata)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=ordered)
    return ds.prefetch(READ_AHEAD_BATCHES)


def _locator(locations: SplitLocations, batch_size: int, first: int, local: int, total: int) -> Any:
    """``(seed, start, end) -> (file_ids, offsets, sizes)``, each [k, slice]: elements
    ``start .. min(start + LOCATE_CHUNK, end) - 1``, element ``e`` being replica ``first + e %
    local``'s slice of global batch ``e // local``."""

    @functools.lru_cache(maxsize=4)
    def order(seed: int) -> EpochOrder:
        return EpochOrder(len(locations), seed)

    def locate(seed: Any, start: Any, end: Any) -> tuple[Any, Any, Any]:
        elements = np.arange(int(start), min(int(start) + LOCATE_CHUNK, int(end)))
        steps, replicas = np.divmod(elements, local)
        ids = slices_record_ids(order(int(seed)), steps, batch_size, first + replicas, total)
        return locations.of(ids)

    return locate


def fetched_first(store: ShardStore, shards: Any, elements: tf.data.Dataset) -> tf.data.Dataset:
    """``elements``, each time they are iterated only once every one of ``shards`` is in
    ``store``'s cache, sha256 checked (downloaded side by side where missing): a global order
    reaches every shard from its first batch on."""
    import tensorflow as tf

    def fetch_all(_: Any) -> Any:
        store.fetch_all(shards)
        return _

    start = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
    start = start.map(lambda x: tf.numpy_function(fetch_all, [x], tf.int64, stateful=False))
    return start.flat_map(lambda _: elements)


def split_locations(
    shards_dir: Path, split: str, manifest: ShardManifest, store: ShardStore | None
) -> SplitLocations:
    """Where each record of ``split`` lies, from the shard folder's ``offsets.json`` (checked
    against the manifest), else from the record headers (CRC checked, data skipped). From a
    ``store``, every shard of the split is downloaded (sha256 checked) first, all at once on
    the store's threads, and its record headers read."""
    shards = manifest.split(split).shards
    if not shards or not manifest.split(split).num_records:
        raise ValueError(
            f"{shards_dir}: split {split!r} holds no records; validation fails such a set "
            "(add images, or raise that split's fraction in ingest.splits)"
        )
    if store is None and (shards_dir / OFFSETS_NAME).exists():
        by_file = checked_offsets(shards_dir, manifest)
        return SplitLocations.from_offsets(
            [shards_dir / shard.file for shard in shards], [by_file[s.file] for s in shards]
        )
    # No index (a store holds none; a set written before it existed): the headers tell. A
    # store's shard lies in its cache under its sha256 (fetched_first puts it there again
    # before each iteration).
    paths = store.fetch_all(shards) if store else [shards_dir / shard.file for shard in shards]
    entries = [
        read_entry(path, shard.num_records, gzip_compressed=False)
        for path, shard in zip(paths, shards, strict=True)
    ]
    return SplitLocations.from_offsets(paths, entries)


def batch_parser(manifest: ShardManifest, *, with_metadata: bool) -> Any:
    """A tf.data map from a batch of serialized records to ``(images, labels)``, or to the
    parsed feature dict ``with_metadata``."""
    schema = range_read(manifest.record_schema)

    def parse(serialized: tf.Tensor) -> Any:
        features = schema.parse_batch(serialized, metadata=with_metadata)
        return features if with_metadata else (features[IMAGE_KEY], features[LABEL_KEY])

    return plain(parse)


def plain(function: Any) -> Any:
    """``function``, kept from AutoGraph: the reader's functions are plain TensorFlow ops
    with Python-level branches only, so its conversion finds nothing to convert and only
    slows each process's first read."""
    import tensorflow as tf

    return tf.autograph.experimental.do_not_convert(function)


def split_files(
    shards_dir: Path,
    split: str,
    manifest: ShardManifest,
    file_shard: tuple[int, int] | None,
    store: ShardStore | None,
) -> tuple[list[str], int]:
    """The files of ``split`` (every one, or ``file_shard``'s share) and their record count.
    With a ``store`` the list holds shard names, each turned into a checked local file by
    :func:`fetched_from`. A split without records is refused."""
    info = manifest.split(split)
    shards = info.shards[file_shard[0] :: file_shard[1]] if file_shard else info.shards
    files = [shard.file if store else str(shards_dir / shard.file) for shard in shards]
    if not info.num_records:
        raise ValueError(
            f"{shards_dir}: split {split!r} holds no records; validation fails such a set "
            "(add images, or raise that split's fraction in ingest.splits)"
        )
    return files, sum(shard.num_records for shard in shards)


def fetched_from(
    store: ShardStore, manifest: ShardManifest, names: tf.data.Dataset
) -> tf.data.Dataset:
    """Shard ``names`` as verified local paths in ``store``'s cache, in their order.

    Each name starts its shard's download (the store's own ``prefetch`` threads) as it
    enters the buffer, ``prefetch`` names ahead of the reader; the next map waits for the
    shard in file order and passes its path on only once its sha256 matched. No tf.data
    thread waits on the network: threads blocked on downloads would leave none, on few
    cores, to parse the shards already there.
    """
    import tensorflow as tf

    ds = names.map(start_fetch_op(store, manifest)).prefetch(store.prefetch)
    ds = ds.map(fetch_op(store, manifest))
    # The two maps run one name at a time, in order, as written: not parallelised by
    # tf.data's optimiser, which would otherwise take their (stateless) ops for pure ones.
    # The option holds for the whole pipeline; every other map here sets its own.
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False
    return ds.with_options(options)


def shard_records(path: tf.Tensor | str, manifest: ShardManifest) -> tf.data.Dataset:
    """The serialized records of one shard file, read as every Shardflow reader reads them."""
    import tensorflow as tf

    return tf.data.TFRecordDataset(
        path, compression_type=manifest.compression_type, buffer_size=READ_BUFFER_BYTES
    )


def fetch_op(store: ShardStore, manifest: ShardManifest) -> Any:
    """A tf.data map from a shard's name to its verified local path in ``store``'s cache."""
    from tasks.contracts.shard_store import local_path_fetcher

    return _string_op(local_path_fetcher(store, manifest))


def start_fetch_op(store: ShardStore, manifest: ShardManifest) -> Any:
    """A tf.data map passing a shard's name on, its download started in ``store``."""
    from tasks.contracts.shard_store import download_starter

    return _string_op(download_starter(store, manifest))


def _string_op(function: Any) -> Any:
    """``function`` (bytes -> str) as a tf.data map op over a shard's name.

    Declared stateless, though it downloads: under op determinism (training's default,
    ``train.deterministic``) one stateful op anywhere in a pipeline switches off its
    ``prefetch`` and runs every parallel map one element at a time, so a read from object
    storage would download one shard at a time and parse serially. Order and one call per
    name are kept by the pipeline itself (sequential maps, see :func:`read_split`).
    """
    import tensorflow as tf

    def op(name: tf.Tensor) -> tf.Tensor:
        path = tf.numpy_function(function, [name], tf.string, stateful=False)
        return tf.ensure_shape(path, [])

    return op


def default_shuffle_buffer(manifest: ShardManifest, split: str) -> int:
    """Records that fit ``SHUFFLE_BUFFER_BYTES`` at this split's mean record size."""
    info = manifest.split(split)
    total = sum(shard.bytes for shard in info.shards)
    mean = total / max(info.num_records, 1)
    return int(max(64, min(MAX_SHUFFLE_RECORDS, SHUFFLE_BUFFER_BYTES // max(mean, 1))))
