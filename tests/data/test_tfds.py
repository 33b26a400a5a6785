"""TensorFlow Datasets loads the shard folder as the shard stage leaves it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tasks.contracts.manifest import SPLITS, load_manifest
from tasks.contracts.tf_reader import read_split
from tasks.contracts.tfds_metadata import (
    DATASET_INFO_NAME,
    FEATURES_NAME,
    FILE_TEMPLATE,
    LABELS_NAME,
    dataset_info_json,
    features_json,
    labels_text,
)
from tasks.runtime.atomic import write_json, write_text
from tasks.runtime.params import default_params
from tasks.shard.planning import shard_name
from tasks.shard.stage import shard_stage

PARAMS = {"image_size": (16, 16), "target_shard_mb": 0.002, "workers": 1}


def shard_set(tiny_index: Path, folder: Path, **overrides: Any) -> Path:
    shard_stage(default_params(shard={**PARAMS, **overrides}).shard, tiny_index, folder)
    return folder


def tfds_split(builder: tfds.core.DatasetBuilder, split: str) -> tuple[np.ndarray, np.ndarray]:
    ds = builder.as_dataset(split=split, shuffle_files=False, as_supervised=True, batch_size=5)
    pairs = list(tfds.as_numpy(ds))
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def reader_split(shards_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    batches = list(read_split(shards_dir, split, batch_size=5, training=False))
    images = np.concatenate([b[0].numpy() for b in batches])
    return images, np.concatenate([b[1].numpy() for b in batches])


@pytest.mark.parametrize("encoding", ["raw", "jpeg", "png"])
def test_builder_from_directory_yields_what_read_split_yields(
    tiny_index: Path, tmp_path: Path, encoding: str
) -> None:
    shards_dir = shard_set(tiny_index, tmp_path / "shards", encoding=encoding)
    manifest = load_manifest(shards_dir)
    builder = tfds.builder_from_directory(str(shards_dir))

    features = builder.info.features
    expected_kind = tfds.features.Tensor if encoding == "raw" else tfds.features.Image
    assert type(features["image"]) is expected_kind
    assert features["image"].shape == (16, 16, 3) and features["image"].np_dtype == np.uint8
    assert features["label"].names == manifest.classes
    assert set(features.keys()) == {"image", "label", "content_hash", "source"}
    assert set(builder.info.splits) == set(SPLITS)
    for split in SPLITS:
        assert builder.info.splits[split].num_examples == manifest.split(split).num_records
        images, labels = tfds_split(builder, split)
        expected_images, expected_labels = reader_split(shards_dir, split)
        np.testing.assert_array_equal(labels, expected_labels)
        np.testing.assert_array_equal(images, expected_images)


def test_provenance_features_come_through(tiny_index: Path, tmp_path: Path) -> None:
    shards_dir = shard_set(tiny_index, tmp_path / "shards")
    builder = tfds.builder_from_directory(str(shards_dir))
    first = next(iter(tfds.as_numpy(builder.as_dataset(split="test", shuffle_files=False))))
    batch = next(iter(read_split(shards_dir, "test", batch_size=1, training=False,
                                 with_metadata=True)))  # fmt: skip
    assert first["content_hash"] == batch["content_hash"].numpy()[0]
    assert first["source"] == batch["source"].numpy()[0]


def test_file_template_names_the_shard_files() -> None:
    for split, index, count in [("train", 0, 7), ("val", 3, 4), ("test", 11, 120000)]:
        expected = FILE_TEMPLATE.format(
            SPLIT=split, FILEFORMAT="tfrecord", SHARD_X_OF_Y=f"{index:05d}-of-{count:05d}"
        )
        assert shard_name(split, index, count) == expected


def test_gzip_shards_get_no_tfds_metadata(tiny_index: Path, tmp_path: Path) -> None:
    shards_dir = shard_set(tiny_index, tmp_path / "shards")
    assert (shards_dir / DATASET_INFO_NAME).exists()
    shard_set(tiny_index, shards_dir, compression="gzip")  # the same folder, resharded
    for name in (DATASET_INFO_NAME, FEATURES_NAME, LABELS_NAME):
        assert not (shards_dir / name).exists()


def test_tfds_cannot_read_gzip_shards(tiny_index: Path, tmp_path: Path) -> None:
    """Why GZIP shards get no metadata: TFDS opens tfrecord files uncompressed."""
    shards_dir = shard_set(tiny_index, tmp_path / "shards", compression="gzip")
    manifest = load_manifest(shards_dir)
    write_json(shards_dir / FEATURES_NAME, features_json(manifest))
    write_text(shards_dir / LABELS_NAME, labels_text(manifest))
    write_json(shards_dir / DATASET_INFO_NAME, dataset_info_json(manifest))
    builder = tfds.builder_from_directory(str(shards_dir))
    with pytest.raises(tf.errors.DataLossError):
        list(builder.as_dataset(split="train", shuffle_files=False))


def test_class_names_that_break_the_labels_file_are_refused(
    tiny_index: Path, tmp_path: Path
) -> None:
    manifest = load_manifest(shard_set(tiny_index, tmp_path / "shards"))
    manifest.classes[1] = "two\nlines"
    with pytest.raises(ValueError, match="two\\\\nlines"):
        labels_text(manifest)
