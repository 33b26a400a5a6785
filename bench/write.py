"""Write throughput: images/s from source JPEGs to TFRecords, the seeds' way and Shardflow's.

Every writer runs in a fresh interpreter and reports its own clock, so each pays its real
start-up (TensorFlow import, worker spawn) and none profits from this process's warm state.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.images import list_images
from bench.measured import run_measured
from bench.scaling import measure_shard_run
from tasks.runtime.params import ShardParams


def seed_write(source_dir: Path, path: Path, *, size: tuple[int, int], encoding: str) -> int:
    """The seeds' writer: a Python loop, eager TF decode/resize/encode, one Example per image."""
    import tensorflow as tf

    images = list_images(source_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for file, label in images:
            image = tf.io.decode_jpeg(tf.io.read_file(str(file)), channels=3)
            pixels = tf.cast(tf.image.resize(image, size), tf.uint8)
            if encoding == "jpeg":
                data = tf.io.encode_jpeg(pixels).numpy()
            elif encoding == "png":
                data = tf.io.encode_png(pixels).numpy()
            else:
                data = pixels.numpy().tobytes()
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    return len(images)


def seed_write_measured(
    source_dir: Path, path: Path, *, size: tuple[int, int], encoding: str
) -> tuple[int, float]:
    """(images, seconds) of :func:`seed_write` in a fresh interpreter."""
    args = [str(source_dir), str(path), str(size[0]), str(size[1]), encoding]
    result = run_measured("bench.write", args, path.with_suffix(".log"))
    return int(result["images"]), float(result["seconds"])


def shardflow_write_measured(
    params: ShardParams, index_path: Path, root: Path, *, workers: int
) -> tuple[int, float]:
    """(images, seconds) of one full shard stage (the flow) from an existing index, in a
    fresh interpreter; the shards land in ``Layout(root).shards_dir``."""
    result = measure_shard_run(params, index_path, root, workers=workers)
    from tasks.contracts.manifest import load_manifest
    from tasks.runtime.layout import Layout

    manifest = load_manifest(Layout(root).shards_dir)
    records = manifest.total_records
    return records, float(result["shard_s"])


def _child(source_dir: str, path: str, height: str, width: str, encoding: str) -> None:
    start = time.perf_counter()
    n = seed_write(Path(source_dir), Path(path), size=(int(height), int(width)), encoding=encoding)
    print(json.dumps({"images": n, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    _child(*sys.argv[1:6])
