"""The TensorFlow-free reading half of tasks.tfrecord against TensorFlow's own bytes."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tasks.schema import RecordSchema, SchemaError
from tasks.tfrecord import (
    CorruptRecord,
    TFRecordWriter,
    _masked_crc,
    decode_example,
    encode_example,
    frame_record,
    is_canonical,
    read_framed,
    record_offsets,
)

pytestmark = pytest.mark.slow


def tf_example(features: dict[str, bytes | int | list[int]]) -> bytes:
    def feature(value: bytes | int | list[int]) -> tf.train.Feature:
        if isinstance(value, bytes):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        values = value if isinstance(value, list) else [value]
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    example = tf.train.Example(
        features=tf.train.Features(feature={k: feature(v) for k, v in features.items()})
    )
    return example.SerializeToString()


@pytest.mark.parametrize(
    "features",
    [
        {"image": b"\x00\xff" * 300, "label": 5, "content_hash": b"ab" * 32, "source": b"a/b.png"},
        {"zeta": b"", "alpha": 0, "mid": 2**40, "neg": -3, "min": -(2**63)},
        {"big": b"x" * 200_000, "label": 127, "other": 128},
    ],
)
def test_decode_example_reads_tensorflow_examples(features: dict[str, bytes | int]) -> None:
    assert decode_example(tf_example(features)) == features  # type: ignore[arg-type]
    assert decode_example(encode_example(features)) == features


def test_unpacked_int64_lists_decode_too() -> None:
    # Field 3 (int64_list) holding an unpacked varint field 1: legal protobuf, not what TF writes.
    feature = b"\x1a\x02\x08\x07"
    entry = b"\x0a\x01k" + b"\x12" + bytes([len(feature)]) + feature
    data = b"\x0a" + bytes([len(entry) + 2]) + b"\x0a" + bytes([len(entry)]) + entry
    assert decode_example(data) == {"k": 7}


def test_multi_value_and_float_features_are_refused_by_name() -> None:
    with pytest.raises(CorruptRecord, match="'ids' holds 2 values"):
        decode_example(tf_example({"ids": [1, 2]}))
    floats = tf.train.Example(
        features=tf.train.Features(
            feature={"score": tf.train.Feature(float_list=tf.train.FloatList(value=[0.5]))}
        )
    ).SerializeToString()
    with pytest.raises(CorruptRecord, match="'score': only bytes and int64"):
        decode_example(floats)


def test_framing_round_trips_and_crcs_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "f.tfrecord"
    payloads = [bytes([n]) * n for n in range(1, 30)]
    with tf.io.TFRecordWriter(str(path)) as writer:  # TensorFlow's framing
        for payload in payloads:
            writer.write(payload)
    data = path.read_bytes()
    handle = io.BytesIO(data)
    assert [read_framed(handle) for _ in payloads] == payloads
    assert read_framed(handle) is None
    offsets = record_offsets(path)
    assert [n - 16 for _, n in offsets] == [len(p) for p in payloads]
    damaged = bytearray(data)
    damaged[offsets[3][0] + 12] ^= 1  # first data byte of record 3
    handle = io.BytesIO(bytes(damaged))
    for _ in range(3):
        read_framed(handle)
    with pytest.raises(CorruptRecord, match="data CRC mismatch"):
        read_framed(handle)
    with pytest.raises(CorruptRecord, match="length CRC mismatch"):
        read_framed(io.BytesIO(data[1:]))


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_files_are_reported_with_the_record(tmp_path: Path, compress: bool) -> None:
    path = tmp_path / "f.tfrecord"
    with TFRecordWriter(path, gzip_compress=compress) as writer:
        for n in range(5):
            writer.write(b"x" * (10 + n))
    assert len(record_offsets(path, gzip_compressed=compress)) == 5
    if compress:
        import gzip

        raw = gzip.decompress(path.read_bytes())[:-3]
        path.write_bytes(gzip.compress(raw, mtime=0))
    else:
        path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CorruptRecord, match="record 4: truncated record"):
        record_offsets(path, gzip_compressed=compress)


@pytest.mark.parametrize("encoding", ["raw", "jpeg", "png"])
def test_schema_parse_mirrors_serialize(encoding: str) -> None:
    schema = RecordSchema(height=8, width=6, encoding=encoding)  # type: ignore[arg-type]
    pixels = np.random.default_rng(0).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    record = schema.serialize(schema.encode_image(pixels), 2, "ab" * 32, "cls/x.png")
    parsed = schema.parse(record)
    assert parsed["label"] == 2 and parsed["content_hash"] == "ab" * 32
    assert parsed["source"] == "cls/x.png"
    assert parsed["image"].shape == (8, 6, 3) and parsed["image"].flags.writeable
    if encoding != "jpeg":
        np.testing.assert_array_equal(parsed["image"], pixels)
    tf_image = schema.parse_single(tf.constant(record))["image"].numpy()
    assert np.abs(parsed["image"].astype(int) - tf_image).max() <= (8 if encoding == "jpeg" else 0)


def test_schema_parse_names_what_is_wrong() -> None:
    schema = RecordSchema(height=4, width=4, encoding="raw")
    with pytest.raises(SchemaError, match="raw image has 47 bytes, schema wants 48"):
        schema.parse(schema.serialize(b"\x00" * 47, 0, "h", "s"))
    with pytest.raises(SchemaError, match=r"record has features \['image', 'label'\]"):
        schema.parse(encode_example({"image": b"\x00" * 48, "label": 0}))
    png = RecordSchema(height=4, width=4, encoding="png")
    with pytest.raises(SchemaError, match="image is JPEG, schema wants png"):
        png.decode(RecordSchema(4, 4, "jpeg").encode_image(np.zeros((4, 4, 3), np.uint8)))


def test_a_declared_length_past_the_end_of_the_file_is_a_corrupt_record(tmp_path: Path) -> None:
    """A length field of 2**40 with a valid CRC: a short read where the file ends, named as
    a truncated record, never a terabyte allocation (MemoryError)."""
    size = struct.pack("<Q", 2**40)
    crafted = size + _masked_crc(size) + b"\x00" * 100
    path = tmp_path / "crafted.tfrecord"
    path.write_bytes(frame_record(b"first") + crafted)
    with open(path, "rb") as handle:
        assert read_framed(handle) == b"first"
        with pytest.raises(CorruptRecord, match=f"100 of {2**40} data bytes"):
            read_framed(handle)
    with pytest.raises(CorruptRecord, match="record 1: truncated"):
        record_offsets(path)


def test_example_bytes_with_a_key_that_is_not_text_are_a_corrupt_record() -> None:
    entry = b"\x0a\x02\xff\xfe" + b"\x12\x00"  # key b"\xff\xfe", an empty feature
    garbage = b"\x0a\x08" + b"\x0a\x06" + entry
    with pytest.raises(CorruptRecord, match="not UTF-8"):
        decode_example(garbage)


def test_only_the_writers_own_layout_is_canonical() -> None:
    """A feature repeated after the last entry decodes as protobuf does (the last wins),
    where a reader at fixed offsets takes the first: not canonical, so refused."""
    features: dict[str, bytes | int] = {  # small: every length a one-byte varint
        "content_hash": b"ab",
        "image": b"\x01" * 12,
        "label": 1,
        "source": b"a/1.png",
    }
    record = encode_example(features)
    assert is_canonical(record, decode_example(record))
    inner = record[2:]  # the map entries (the outer length is one byte here)
    repeated = encode_example({"label": 2})[2:]
    crafted = b"\x0a" + bytes([len(inner) + len(repeated)]) + inner + repeated
    assert decode_example(crafted)["label"] == 2  # what parse_single_example reads too
    assert decode_example(tf_example({**features, "label": 2})) == decode_example(crafted)
    assert not is_canonical(crafted, decode_example(crafted))
    entries = [encode_example({key: value})[2:] for key, value in features.items()]
    swapped = b"\x0a" + bytes([len(inner)]) + b"".join(reversed(entries))  # out of order
    assert decode_example(swapped) == features and not is_canonical(swapped, features)
