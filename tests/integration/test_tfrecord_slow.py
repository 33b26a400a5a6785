"""The TensorFlow-free writer produces exactly what TensorFlow writes and reads."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import tensorflow as tf

from tasks.schema import RecordSchema
from tasks.tfrecord import TFRecordWriter, encode_example, frame_record

pytestmark = pytest.mark.slow


def tf_example(features: dict[str, bytes | int]) -> bytes:
    feature = {
        key: tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))
        if isinstance(value, int)
        else tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        for key, value in features.items()
    }
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=True)


@pytest.mark.parametrize(
    "features",
    [
        {"image": b"\x00\xff" * 300, "label": 5, "content_hash": b"ab" * 32, "source": b"a/b.png"},
        {"zeta": b"", "alpha": 0, "mid": 2**40},
        {"label": 127, "other": 128},  # varint boundary
        {"big": b"x" * 200_000, "neg": -3},
    ],
)
def test_example_bytes_match_tensorflow(features: dict[str, bytes | int]) -> None:
    assert encode_example(features) == tf_example(features)


def test_schema_serialize_matches_tensorflow() -> None:
    schema = RecordSchema(height=2, width=2, encoding="raw")
    ours = schema.serialize(b"\x01" * 12, 3, "f" * 64, "cls/img.jpg")
    expected = tf_example(
        {"image": b"\x01" * 12, "label": 3, "content_hash": b"f" * 64, "source": b"cls/img.jpg"}
    )
    assert ours == expected


@pytest.mark.parametrize("compress", [False, True])
def test_files_match_tensorflow_and_read_back(tmp_path: Path, compress: bool) -> None:
    records = [encode_example({"i": n, "payload": bytes([n % 256]) * n}) for n in range(50)]
    ours = tmp_path / "ours.tfrecord"
    with TFRecordWriter(ours, gzip_compress=compress) as writer:
        for record in records:
            writer.write(record)
    compression = "GZIP" if compress else ""
    read = [r.numpy() for r in tf.data.TFRecordDataset(str(ours), compression_type=compression)]
    assert read == records
    theirs = tmp_path / "theirs.tfrecord"
    with tf.io.TFRecordWriter(str(theirs), options=tf.io.TFRecordOptions(compression_type="")) as w:
        for record in records:
            w.write(record)
    plain = gzip.decompress(ours.read_bytes()) if compress else ours.read_bytes()
    assert plain == theirs.read_bytes()


def test_gzip_output_is_deterministic(tmp_path: Path) -> None:
    blobs = []
    for name in ("a", "b"):
        with TFRecordWriter(tmp_path / name, gzip_compress=True) as writer:
            writer.write(b"same")
        blobs.append((tmp_path / name).read_bytes())
    assert blobs[0] == blobs[1]


def test_frame_is_length_crc_data_crc() -> None:
    framed = frame_record(b"abc")
    assert len(framed) == 8 + 4 + 3 + 4 and framed[12:15] == b"abc"


def test_rejects_unsupported_values() -> None:
    with pytest.raises(TypeError, match="bytes or int"):
        encode_example({"x": 1.5})  # type: ignore[dict-item]
