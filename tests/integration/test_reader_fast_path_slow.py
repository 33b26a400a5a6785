"""Raw records are read at their fixed layout only where their own bytes prove it.

``RecordSchema.parse_batch`` slices raw pixels out of the serialized bytes instead of going
through ``parse_example``. These tests pin that it gives exactly what the general parse
gives, that the writer's records do take that path, and that any other layout is caught by
the check and read correctly (never misread at the fixed offset).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tasks.contracts.tf_reader import read_split
from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, SOURCE_KEY, RecordSchema, raw_layout
from tasks.tfrecord import decode_example, encode_example
from tests.tiny_shards import write_tiny_shards

pytestmark = pytest.mark.slow

SCHEMA = RecordSchema(height=6, width=10, encoding="raw")  # not square: no H/W swap passes


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SCHEMA.image_shape, dtype=np.uint8)


def writer_record(seed: int, label: int, source: str = "cls/x.png") -> bytes:
    image = pixels(seed)
    return SCHEMA.serialize(image.tobytes(), label, hashlib.sha256(image).hexdigest(), source)


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def feature_entry(key: str, value: bytes | int) -> bytes:
    """The map entry of one feature: a one-feature record minus its tag and varint length."""
    single = encode_example({key: value})
    start = 1
    while single[start] & 0x80:
        start += 1
    return single[start + 1 :]


def reordered_record(seed: int, label: int) -> bytes:
    """A valid Example with the writer's features in another key order (as other writers do)."""
    image = pixels(seed)
    values: dict[str, bytes | int] = {
        IMAGE_KEY: image.tobytes(),
        SOURCE_KEY: b"cls/x.png",
        LABEL_KEY: label,
        HASH_KEY: hashlib.sha256(image).hexdigest().encode(),
    }
    entries = b"".join(feature_entry(key, value) for key, value in values.items())
    return b"\x0a" + varint(len(entries)) + entries


def parse(records: list[bytes], *, metadata: bool = True) -> dict[str, np.ndarray]:
    batch = tf.data.Dataset.from_tensor_slices(records).batch(len(records))
    parsed = next(iter(batch.map(lambda s: SCHEMA.parse_batch(s, metadata=metadata))))
    return {key: value.numpy() for key, value in parsed.items()}


def proven(records: list[bytes]) -> bool:
    return bool(SCHEMA.raw_record_bytes(tf.constant(records))[2])


@pytest.mark.parametrize("size", [(6, 10), (16, 16), (224, 224)])
def test_layout_points_at_the_image_and_label_the_writer_wrote(size: tuple[int, int]) -> None:
    schema = RecordSchema(*size, encoding="raw")
    image = np.arange(np.prod(schema.image_shape), dtype=np.uint64).astype(np.uint8)
    record = schema.serialize(image.tobytes(), 7, "f" * 64, "a/b.png")
    layout = raw_layout(image.size)
    assert record[layout.image_offset : layout.tail_offset] == image.tobytes()
    assert record[layout.label_offset] == 7


def test_tiny_images_whose_length_prefix_grows_are_still_read_right() -> None:
    """1x1 records straddle the 1- to 2-byte outer length: the check must route them."""
    schema = RecordSchema(1, 1, "raw")
    images = [np.array([[[i, 2 * i, 3 * i]]], np.uint8) for i in range(1, 4)]
    records = [
        schema.serialize(img.tobytes(), i, hashlib.sha256(img).hexdigest(), "s" * (40 * i))
        for i, img in enumerate(images)
    ]
    batch = tf.data.Dataset.from_tensor_slices(records).batch(3)
    parsed = next(iter(batch.map(schema.parse_batch)))
    np.testing.assert_array_equal(parsed[IMAGE_KEY].numpy(), np.stack(images))
    assert parsed[LABEL_KEY].numpy().tolist() == [0, 1, 2]


def test_writer_records_take_the_fast_path_and_match_the_python_reader() -> None:
    records = [writer_record(i, label) for i, label in enumerate([0, 4, 127])]
    assert proven(records)
    parsed = parse(records)
    for i, record in enumerate(records):
        want = SCHEMA.parse(record)
        np.testing.assert_array_equal(parsed[IMAGE_KEY][i], want[IMAGE_KEY])
        assert parsed[LABEL_KEY][i] == want[LABEL_KEY]
        assert parsed[HASH_KEY][i].decode() == want[HASH_KEY]
        assert parsed[SOURCE_KEY][i].decode() == want[SOURCE_KEY]
    assert parsed[LABEL_KEY].dtype == np.int32
    assert set(parse(records, metadata=False)) == {IMAGE_KEY, LABEL_KEY}


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda: reordered_record(9, 3), id="other-key-order"),
        pytest.param(
            lambda: SCHEMA.serialize(pixels(9).tobytes(), 3, "abc", "cls/x.png"), id="short-hash"
        ),
        pytest.param(lambda: writer_record(9, 300), id="label-over-127"),
        pytest.param(lambda: writer_record(9, -3), id="negative-label"),
        pytest.param(lambda: writer_record(9, 3, "d/" + "x" * 300), id="long-source"),
        pytest.param(
            lambda: encode_example(
                {
                    HASH_KEY: hashlib.sha256(pixels(9)).hexdigest().encode(),
                    IMAGE_KEY: pixels(9).tobytes(),
                    "image_id": b"extra feature between image and label",
                    LABEL_KEY: 3,
                    SOURCE_KEY: b"cls/x.png",
                }
            ),
            id="extra-feature",
        ),
    ],
)
def test_a_record_with_another_layout_is_not_misread(odd: object) -> None:
    record = odd()  # type: ignore[operator]
    features = decode_example(record)  # a valid Example holding the same image
    assert features[IMAGE_KEY] == pixels(9).tobytes()
    records = [writer_record(0, 1), record]
    assert not proven(records)
    parsed = parse(records)
    np.testing.assert_array_equal(parsed[IMAGE_KEY][1], pixels(9))
    assert parsed[LABEL_KEY].tolist() == [1, features[LABEL_KEY]]
    np.testing.assert_array_equal(parsed[IMAGE_KEY][0], pixels(0))


def test_the_check_is_what_stops_a_misread() -> None:
    """At the fixed offset, a reordered record holds other bytes: only the check saves it."""
    layout = raw_layout(int(np.prod(SCHEMA.image_shape)))
    record = reordered_record(9, 3)
    assert record[layout.image_offset : layout.tail_offset] != pixels(9).tobytes()
    np.testing.assert_array_equal(parse([record])[IMAGE_KEY][0], pixels(9))


def test_a_missing_feature_still_fails_naming_the_key() -> None:
    image = pixels(0)
    record = encode_example({HASH_KEY: hashlib.sha256(image).hexdigest().encode(), LABEL_KEY: 1})
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"Feature: {IMAGE_KEY} \("):
        parse([record], metadata=False)
    no_source = encode_example(
        {HASH_KEY: hashlib.sha256(image).hexdigest().encode(), IMAGE_KEY: image.tobytes()}
        | {LABEL_KEY: 1}
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"Feature: {SOURCE_KEY} \("):
        parse([no_source], metadata=False)


@pytest.mark.parametrize("with_metadata", [False, True])
def test_read_split_gives_what_the_general_parse_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_metadata: bool
) -> None:
    """Same tensors, same order for a seed, with and without the fast path."""
    shards = write_tiny_shards(tmp_path, size=8, per_class={"train": 11}, validated=False)

    def read() -> list[dict[str, np.ndarray]]:
        ds = read_split(
            shards, "train", batch_size=4, training=True, seed=5, with_metadata=with_metadata
        )
        batches = [
            b if with_metadata else dict(zip((IMAGE_KEY, LABEL_KEY), b, strict=True)) for b in ds
        ]
        return [{k: v.numpy() for k, v in batch.items()} for batch in batches]

    files = sorted(str(p) for p in shards.glob("train.tfrecord-*[0-9]"))
    schema = RecordSchema(8, 8, "raw")
    for batch in tf.data.TFRecordDataset(files).batch(4):
        assert bool(schema.raw_record_bytes(batch)[2])  # the writer's shards take the fast path
    fast = read()
    monkeypatch.setattr(
        RecordSchema,
        "_parse_raw_batch",
        lambda self, serialized, *, metadata: self._parse_batch_general(
            serialized, metadata=metadata
        ),
    )
    general = read()
    assert len(fast) == len(general) == 33 // 4
    for got, want in zip(fast, general, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_the_read_ceiling_reads_the_records_read_split_reads(tmp_path: Path) -> None:
    """bench's bytes ceiling and read_split share one file reader (unbuffered, same bytes)."""
    from bench.read import bytes_dataset

    shards = write_tiny_shards(tmp_path, size=8, per_class={"train": 11}, validated=False)
    files = sorted(str(p) for p in shards.glob("train.tfrecord-*[0-9]"))
    on_disk = [r.numpy() for r in tf.data.TFRecordDataset(files)]  # TF's default buffered read
    ceiling = [r.numpy() for records, _ in bytes_dataset(shards, batch=4) for r in records]
    assert len(ceiling) == 33 // 4 * 4
    assert set(ceiling) <= set(on_disk) and len(set(ceiling)) == len(ceiling)
