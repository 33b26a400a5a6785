"""The TensorFlow-free reader (tasks.contracts.numpy_reader) against read_split, on shards the
stage wrote."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tasks.contracts import numpy_reader as records
from tasks.contracts.manifest import SPLITS, load_manifest
from tasks.contracts.numpy_reader import (
    OFFSETS_NAME,
    SplitReader,
    iter_split,
    read_record,
    worker_range,
)
from tasks.contracts.tf_reader import read_split
from tasks.runtime.params import default_params
from tasks.shard.stage import shard_stage
from tasks.tfrecord import CorruptRecord

# About two 16x16 raw records per shard: every split has several shards.
PARAMS = {"image_size": (16, 16), "target_shard_mb": 0.002, "workers": 1}


def shard_set(tiny_index: Path, folder: Path, **overrides: Any) -> Path:
    shard_stage(default_params(shard={**PARAMS, **overrides}).shard, tiny_index, folder)
    return folder


@pytest.fixture(scope="module")
def raw_shards(tiny_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shard_set(tiny_index, tmp_path_factory.mktemp("records") / "shards")


def tf_split(shards_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Every image and label of a split through read_split (manifest order)."""
    batches = list(read_split(shards_dir, split, batch_size=5, training=False))
    images = np.concatenate([b[0].numpy() for b in batches])
    labels = np.concatenate([b[1].numpy() for b in batches])
    return images, labels


def numpy_split(shards_dir: Path, split: str, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    pairs = list(iter_split(shards_dir, split, **kwargs))
    images = np.stack([image for image, _ in pairs])
    return images, np.array([label for _, label in pairs])


@pytest.mark.parametrize(
    "overrides", [{}, {"encoding": "png"}, {"compression": "gzip"}], ids=["raw", "png", "gzip"]
)
def test_iter_split_equals_read_split(
    tiny_index: Path, tmp_path: Path, overrides: dict[str, Any]
) -> None:
    shards_dir = shard_set(tiny_index, tmp_path / "shards", **overrides)
    for split in SPLITS:
        expected_images, expected_labels = tf_split(shards_dir, split)
        images, labels = numpy_split(shards_dir, split)
        assert images.dtype == np.uint8 and images.shape == expected_images.shape
        np.testing.assert_array_equal(labels, expected_labels)
        np.testing.assert_array_equal(images, expected_images)


def test_jpeg_pixels_are_the_accurate_idct_decode(tiny_index: Path, tmp_path: Path) -> None:
    """PIL decodes JPEG with the accurate integer IDCT; read_split uses TF's default (fast)."""
    shards_dir = shard_set(tiny_index, tmp_path / "shards", encoding="jpeg")
    expected_images, expected_labels = tf_split(shards_dir, "train")
    images, labels = numpy_split(shards_dir, "train")
    np.testing.assert_array_equal(labels, expected_labels)
    # Off by a few levels at most from read_split's fast IDCT ...
    assert np.abs(images.astype(int) - expected_images).max() <= 8
    # ... and exactly TensorFlow's own decode with the accurate IDCT.
    reader = SplitReader(shards_dir, "train")
    serialized = tf.data.TFRecordDataset([str(shards_dir / s.file) for s in reader.shards])
    for image, record in zip(images, serialized, strict=True):
        encoded = tf.io.parse_single_example(record, reader.schema.parse_spec())["image"]
        accurate = tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_ACCURATE")
        np.testing.assert_array_equal(image, accurate.numpy())


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the records tasks.contracts.numpy_reader reads off disk (each read_framed call is
    one record)."""
    calls: list[int] = []
    real = records.read_framed

    def counting(handle: Any) -> bytes | None:
        calls.append(1)
        return real(handle)

    monkeypatch.setattr(records, "read_framed", counting)
    return calls


def test_read_record_seeks_straight_to_the_record(
    raw_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    everything = list(iter_split(raw_shards, "train"))
    calls = count_reads(monkeypatch)
    for position in reversed(range(len(everything))):
        image, label = read_record(raw_shards, "train", position)
        np.testing.assert_array_equal(image, everything[position][0])
        assert label == everything[position][1]
    assert len(calls) == len(everything)  # one record read per lookup: no scan
    with pytest.raises(IndexError, match="out of range"):
        read_record(raw_shards, "train", len(everything))


@pytest.mark.parametrize("num_workers", [2, 3, 7])
def test_workers_split_the_records_without_overlap_or_scan(
    raw_shards: Path, monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    all_images, all_labels = numpy_split(raw_shards, "train")
    calls = count_reads(monkeypatch)
    parts = []
    for worker in range(num_workers):
        before = len(calls)
        part = list(iter_split(raw_shards, "train", worker=worker, num_workers=num_workers))
        start, stop = worker_range(len(all_labels), worker, num_workers)
        assert len(calls) - before == len(part) == stop - start  # reads only its own records
        parts.extend(part)
    np.testing.assert_array_equal(np.stack([image for image, _ in parts]), all_images)
    np.testing.assert_array_equal(np.array([label for _, label in parts]), all_labels)


def test_worker_range_covers_every_record_once() -> None:
    for total in (0, 1, 5, 17):
        for n in (1, 2, 3, 8):
            cover = [i for k in range(n) for i in range(*worker_range(total, k, n))]
            assert cover == list(range(total))
    with pytest.raises(ValueError, match="worker 2 of 2"):
        worker_range(10, 2, 2)


def offsets(shards_dir: Path) -> dict[str, Any]:
    return json.loads((shards_dir / OFFSETS_NAME).read_text())


def test_offsets_are_record_boundaries(raw_shards: Path) -> None:
    manifest = load_manifest(raw_shards)
    index = offsets(raw_shards)
    assert index["fingerprint"] == manifest.fingerprint
    for info in manifest.splits.values():
        for shard in info.shards:
            entry = index["shards"][shard.file]
            assert len(entry["offsets"]) == shard.num_records and entry["offsets"][0] == 0
            assert entry["end"] == shard.bytes
            data = (raw_shards / shard.file).read_bytes()
            for start in entry["offsets"]:  # each offset starts a record that parses
                (length,) = struct.unpack("<Q", data[start : start + 8])
                example = data[start + 12 : start + 12 + length]
                assert manifest.record_schema.parse(example)["label"] in range(
                    len(manifest.classes)
                )


def test_missing_or_stale_index_is_named(raw_shards: Path, tmp_path: Path) -> None:
    shards_dir = Path(shutil.copytree(raw_shards, tmp_path / "shards"))
    shard = load_manifest(shards_dir).split("val").shards[0]
    index = offsets(shards_dir)
    index["shards"][shard.file]["offsets"].pop()
    (shards_dir / OFFSETS_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{shard.file}.*stale index"):
        list(iter_split(shards_dir, "val"))
    index["fingerprint"] = "0" * 64
    (shards_dir / OFFSETS_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"offsets\.json: indexes shard set 0000"):
        list(iter_split(shards_dir, "val"))
    (shards_dir / OFFSETS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=OFFSETS_NAME):
        list(iter_split(shards_dir, "val"))


def test_an_offset_moved_to_another_boundary_is_caught_before_a_wrong_record(
    raw_shards: Path, tmp_path: Path
) -> None:
    """Record 2's offset pointed at record 1's start: a real boundary, every CRC passes."""
    shards_dir = Path(shutil.copytree(raw_shards, tmp_path / "shards"))
    manifest = load_manifest(shards_dir)
    shard = max(manifest.split("train").shards, key=lambda s: s.num_records)
    assert shard.num_records >= 3
    start = sum(
        s.num_records
        for s in manifest.split("train").shards[: manifest.split("train").shards.index(shard)]
    )
    index = offsets(shards_dir)
    index["shards"][shard.file]["offsets"][2] = index["shards"][shard.file]["offsets"][1]
    (shards_dir / OFFSETS_NAME).write_text(json.dumps(index))
    for read in (
        lambda: read_record(shards_dir, "train", start + 1),  # ends where record 2 truly starts
        lambda: read_record(shards_dir, "train", start + 2),  # is record 1
        lambda: list(iter_split(shards_dir, "train")),
    ):
        with pytest.raises(CorruptRecord, match=f"{shard.file}: record [12] ends at byte"):
            read()
    assert read_record(shards_dir, "train", start)[1] in range(len(manifest.classes))


def test_damaged_record_names_file_and_record(raw_shards: Path, tmp_path: Path) -> None:
    shards_dir = Path(shutil.copytree(raw_shards, tmp_path / "shards"))
    shard = load_manifest(shards_dir).split("train").shards[1]
    starts = offsets(shards_dir)["shards"][shard.file]["offsets"]
    data = bytearray((shards_dir / shard.file).read_bytes())
    data[starts[1] + 40] ^= 0xFF  # inside the second record's data
    (shards_dir / shard.file).write_bytes(bytes(data))
    with pytest.raises(CorruptRecord, match=f"{shard.file}: record 1: data CRC mismatch"):
        list(iter_split(shards_dir, "train"))


def test_resharding_reindexes_and_keeps_shard_globs_clean(tiny_index: Path, tmp_path: Path) -> None:
    shards_dir = shard_set(tiny_index, tmp_path / "shards")
    shard_set(tiny_index, shards_dir, target_shard_mb=16.0)  # one shard per split now
    files = {s.file for info in load_manifest(shards_dir).splits.values() for s in info.shards}
    assert set(offsets(shards_dir)["shards"]) == files
    # Shards end in their count's digits; beside each, its DALI index and nothing else.
    assert {p.name for p in shards_dir.glob("*.tfrecord-*[0-9]")} == files
    assert {p.name for p in shards_dir.glob("*.tfrecord-*")} == files | {f"{f}.idx" for f in files}
    assert [len(list(iter_split(shards_dir, split))) for split in SPLITS] == [
        load_manifest(shards_dir).split(split).num_records for split in SPLITS
    ]


def test_reading_never_loads_tensorflow(raw_shards: Path) -> None:
    """What a PyTorch data-loader worker runs: TensorFlow must not end up in the process."""
    code = (
        "import sys; from tasks.contracts.numpy_reader import iter_split, read_record\n"
        f"n = sum(1 for _ in iter_split({str(raw_shards)!r}, 'test', worker=1, num_workers=2))\n"
        f"read_record({str(raw_shards)!r}, 'val', 0)\n"
        "print(n, sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    assert int(out[0]) > 0 and out[1].strip() == "[]"


def test_dali_indexes_name_every_record_at_its_offset(tiny_index: Path, tmp_path: Path) -> None:
    """`<shard>.idx` holds one `offset size` line per record (DALI's tfrecord2idx format):
    the bytes at each offset are that record, framed, in TensorFlow's order; the shards
    and the fingerprint are those of a set without indexes; a rerun keeps them."""
    shards_dir = shard_set(tiny_index, tmp_path / "shards")
    manifest = load_manifest(shards_dir)
    assert manifest.fingerprint == manifest.compute_fingerprint()  # no index in the manifest
    for info in manifest.splits.values():
        for shard in info.shards:
            data = (shards_dir / shard.file).read_bytes()
            lines = (shards_dir / f"{shard.file}.idx").read_text().splitlines()
            at_offsets = []
            for line in lines:
                offset, size = map(int, line.split(" "))
                (length,) = struct.unpack("<Q", data[offset : offset + 8])
                assert size == 8 + 4 + length + 4  # header, its CRC, data, data CRC
                at_offsets.append(data[offset + 12 : offset + 12 + length])
            assert offset + size == len(data)  # the last record ends the file
            read = [r.numpy() for r in tf.data.TFRecordDataset(str(shards_dir / shard.file))]
            assert at_offsets == read and len(read) == shard.num_records
    indexes = {p.name: p.read_bytes() for p in shards_dir.glob("*.idx")}
    again = shard_set(tiny_index, shards_dir)
    assert load_manifest(again).fingerprint == manifest.fingerprint
    assert {p.name: p.read_bytes() for p in shards_dir.glob("*.idx")} == indexes
    # GZIP shards cannot be entered at an offset: DALI needs uncompressed ones, no index.
    gzipped = shard_set(tiny_index, tmp_path / "gzip", compression="gzip")
    assert not list(gzipped.glob("*.idx"))
