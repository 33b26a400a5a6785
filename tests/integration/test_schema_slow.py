"""The record schema: writer and readers agree, eagerly and inside tf.data, for every encoding."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import tensorflow as tf

from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, SOURCE_KEY, RecordSchema

pytestmark = pytest.mark.slow

HEIGHT, WIDTH = 12, 20  # not square: a height/width swap cannot pass
ENCODINGS = ["raw", "png", "jpeg"]


def smooth_image(seed: int) -> np.ndarray:
    """A gradient with a little noise: JPEG keeps it close, every seed differs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    base = np.stack([x * 10, y * 15, (x + y) * 6], axis=-1) + rng.integers(0, 20)
    return np.clip(base + rng.integers(-3, 4, size=base.shape), 0, 255).astype(np.uint8)


def records(schema: RecordSchema, n: int = 3) -> tuple[list[np.ndarray], list[bytes]]:
    images = [smooth_image(i) for i in range(n)]
    serialized = [
        schema.serialize(schema.encode_image(img), i, hashlib.sha256(img).hexdigest(), f"c/{i}.png")
        for i, img in enumerate(images)
    ]
    return images, serialized


def assert_pixels(encoding: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.uint8
    if encoding == "jpeg":
        assert np.abs(got.astype(int) - want.astype(int)).mean() < 3
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_round_trip_eager_parse_single(encoding: str) -> None:
    schema = RecordSchema(HEIGHT, WIDTH, encoding)
    images, serialized = records(schema)
    for i, (image, data) in enumerate(zip(images, serialized, strict=True)):
        features = schema.parse_single(tf.constant(data))
        assert_pixels(encoding, features[IMAGE_KEY].numpy(), image)
        assert int(features[LABEL_KEY]) == i
        assert features[HASH_KEY].numpy().decode() == hashlib.sha256(image).hexdigest()
        assert features[SOURCE_KEY].numpy().decode() == f"c/{i}.png"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_round_trip_in_dataset_map(encoding: str) -> None:
    schema = RecordSchema(HEIGHT, WIDTH, encoding)
    images, serialized = records(schema)
    batched = tf.data.Dataset.from_tensor_slices(serialized).batch(len(images))
    batch = next(iter(batched.map(schema.parse_batch)))
    singles = list(tf.data.Dataset.from_tensor_slices(serialized).map(schema.parse_single))

    assert batch[LABEL_KEY].dtype == tf.int32
    assert batch[LABEL_KEY].numpy().tolist() == list(range(len(images)))
    for i, image in enumerate(images):
        assert_pixels(encoding, batch[IMAGE_KEY][i].numpy(), image)
        assert_pixels(encoding, singles[i][IMAGE_KEY].numpy(), image)
        assert int(singles[i][LABEL_KEY]) == i


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_shapes_are_static_after_parse_in_dataset_map(encoding: str) -> None:
    schema = RecordSchema(HEIGHT, WIDTH, encoding)
    _, serialized = records(schema)
    ds = tf.data.Dataset.from_tensor_slices(serialized)
    batch_spec = ds.batch(2).map(schema.parse_batch).element_spec
    single_spec = ds.map(schema.parse_single).element_spec
    assert batch_spec[IMAGE_KEY].shape.as_list() == [None, HEIGHT, WIDTH, 3]
    assert batch_spec[LABEL_KEY].shape.as_list() == [None]
    assert single_spec[IMAGE_KEY].shape.as_list() == [HEIGHT, WIDTH, 3]
    # drop_remainder makes the batch size static; parsing must keep it (Keras likes it known).
    fixed_spec = ds.batch(2, drop_remainder=True).map(schema.parse_batch).element_spec
    assert fixed_spec[IMAGE_KEY].shape.as_list() == [2, HEIGHT, WIDTH, 3]
    assert fixed_spec[LABEL_KEY].shape.as_list() == [2]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_encode_and_serialize_are_deterministic(encoding: str) -> None:
    schema = RecordSchema(HEIGHT, WIDTH, encoding)
    _, first = records(schema)
    _, second = records(RecordSchema(HEIGHT, WIDTH, encoding))
    assert first == second
    assert len(set(first)) == len(first)  # and distinct inputs stay distinct


def test_encode_rejects_wrong_shape() -> None:
    schema = RecordSchema(HEIGHT, WIDTH, "raw")
    with pytest.raises(ValueError, match=rf"\({WIDTH}, {HEIGHT}, 3\)"):
        schema.encode_image(np.zeros((WIDTH, HEIGHT, 3), np.uint8))


def example_without(key: str) -> bytes:
    """A serialized record with one feature removed."""
    schema = RecordSchema(HEIGHT, WIDTH, "raw")
    image = smooth_image(0)
    full = schema.serialize(schema.encode_image(image), 1, "abc", "c/0.png")
    example = tf.train.Example.FromString(full)
    del example.features.feature[key]
    return example.SerializeToString(deterministic=True)


@pytest.mark.parametrize("key", [IMAGE_KEY, LABEL_KEY, HASH_KEY, SOURCE_KEY])
def test_missing_key_fails_naming_the_key(key: str) -> None:
    schema = RecordSchema(HEIGHT, WIDTH, "raw")
    data = example_without(key)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"Feature: {key} \("):
        schema.parse_single(tf.constant(data))
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"Feature: {key} \("):
        next(iter(tf.data.Dataset.from_tensor_slices([data]).batch(1).map(schema.parse_batch)))


def test_raw_record_of_wrong_size_fails_to_decode() -> None:
    """A raw image that is not H*W*C bytes must not be silently reshaped."""
    small = RecordSchema(HEIGHT - 1, WIDTH, "raw")
    data = small.serialize(small.encode_image(np.zeros(small.image_shape, np.uint8)), 0, "h", "s")
    with pytest.raises(tf.errors.InvalidArgumentError):
        RecordSchema(HEIGHT, WIDTH, "raw").parse_single(tf.constant(data))


def test_schema_dict_round_trip_and_version_check() -> None:
    schema = RecordSchema(HEIGHT, WIDTH, "jpeg", jpeg_quality=75)
    assert RecordSchema.from_dict(schema.to_dict()) == schema
    with pytest.raises(ValueError, match="version 99"):
        RecordSchema.from_dict({**schema.to_dict(), "version": 99})
