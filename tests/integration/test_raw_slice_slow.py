"""The raw-record op reads exactly the bytes the stock ops read, and its absence is said."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from tasks.contracts import raw_slice, tf_reader
from tasks.schema import RecordSchema, raw_layout
from tasks.tfrecord import encode_example, frame_record

pytestmark = pytest.mark.slow

RANGES = [(0, 3), (2, 50), (100, 20), (0, 1500), (1490, 7)]


def records() -> tf.Tensor:
    """Records shorter than, inside and past every range, the empty one included."""
    rng = np.random.default_rng(0)
    sizes = [0, 1, 5, 101, 113, 119, 1000, 1496, 1500, 1600]
    return tf.constant([rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes])


def read(ranges: list[tuple[int, int]], *, in_map: bool) -> list[np.ndarray]:
    if not in_map:
        return [part.numpy() for part in raw_slice.record_ranges(records(), ranges)]
    ds = tf.data.Dataset.from_tensors(records()).map(
        lambda batch: tuple(raw_slice.record_ranges(batch, ranges))
    )
    return [part.numpy() for part in next(iter(ds))]


@pytest.mark.parametrize("in_map", [False, True], ids=["eager", "in a Dataset.map"])
def test_the_op_reads_the_bytes_the_stock_ops_read(in_map: bool) -> None:
    assert raw_slice.loaded_op() is not None, "make install builds the op where g++ is found"
    fused = read(RANGES, in_map=in_map)
    with raw_slice.stock_ops():
        stock = read(RANGES, in_map=in_map)
    for (offset, length), got, want in zip(RANGES, fused, stock, strict=True):
        assert got.dtype == np.uint8 and got.shape == (10, length)
        np.testing.assert_array_equal(got, want, err_msg=f"range ({offset}, {length})")
    # and what the stock ops read is each record's bytes, zeros past its end
    for row, record in zip(fused[1], records().numpy(), strict=True):
        want = np.frombuffer(record[2:52].ljust(50, b"\0"), np.uint8)
        np.testing.assert_array_equal(row, want)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 2**62), (2**62, 2**62), (2**63 - 2, 5)],
    ids=["rows times length", "offset plus length", "offset near the top"],
)
def test_a_range_past_what_int64_or_a_tensor_holds_is_an_invalid_argument(
    offset: int, length: int
) -> None:
    """Never the process aborted by a CHECK on the output's shape."""
    op = raw_slice.loaded_op()
    assert op is not None, "make install builds the op where g++ is found"
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ShardflowDecodeRawAt|overflow"):
        op.shardflow_decode_raw_at(records(), offset=offset, length=length)


def op_types(schema: RecordSchema) -> set[str]:
    """The ops the reader's batch parser runs for shards of ``schema``."""
    parser = tf_reader.batch_parser(SimpleNamespace(record_schema=schema), with_metadata=False)
    graph = tf.function(parser).get_concrete_function(tf.TensorSpec([None], tf.string)).graph
    types = {op.type for op in graph.get_operations()}
    for function in graph.as_graph_def().library.function:  # the tf.cond branches
        types |= {node.op for node in function.node_def}
    return types


def test_the_reader_cuts_raw_batches_with_the_op() -> None:
    schema = RecordSchema(8, 8, "raw")
    fused = op_types(schema)
    assert "ShardflowDecodeRawAt" in fused and "DecodePaddedRaw" not in fused
    with raw_slice.stock_ops():
        assert "ShardflowDecodeRawAt" not in op_types(schema)


def written_records(
    schema: RecordSchema, labels: list[int], rng: np.random.Generator, content_hash: str
) -> list[bytes]:
    """Raw 4x4 records as the writer serializes them, random pixels, one a label."""
    return [
        schema.serialize(
            schema.encode_image(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)),
            label,
            content_hash,
            f"class/{i}.jpg",
        )
        for i, label in enumerate(labels)
    ]


def test_the_reader_reads_the_same_batches_either_way() -> None:
    """Records of the writer, and records the fast path refuses, alike through the op."""
    schema = RecordSchema(4, 4, "raw")
    rng = np.random.default_rng(1)

    def batch(labels: list[int]) -> tf.Tensor:
        return tf.constant(written_records(schema, labels, rng, "ab" * 32))

    # a label over 127 is a 2-byte varint: that batch goes through parse_example
    batches = [batch([0, 5, 127, 3]), batch([0, 5, 200, 3])]
    for batch in batches:
        fused = raw_slice.range_read(schema).parse_batch(batch, metadata=True)
        stock = schema.parse_batch(batch, metadata=True)
        for key, want in stock.items():
            np.testing.assert_array_equal(fused[key].numpy(), want.numpy(), err_msg=key)


def test_raw_records_read_into_the_batch_are_the_records_parsed(tmp_path: Path) -> None:
    """The op that reads a record's pixels straight into its batch row gives what reading the
    record and parsing it gives: for the writer's records, for records that do not prove the
    layout (a label over 127: a 2-byte varint) and beside a record too short for it."""
    schema = RecordSchema(4, 4, "raw")
    rng = np.random.default_rng(2)
    labels = [0, 5, 127, 3, 200, 1]
    written = [*written_records(schema, labels, rng, "cd" * 32), encode_example({"label": 1})]
    path = tmp_path / "records.tfrecord"
    path.write_bytes(b"".join(frame_record(data) for data in written))
    sizes = [len(data) + 16 for data in written]
    offsets = np.cumsum([0, *sizes[:-1]])
    fused = raw_slice.range_read(schema)
    assert isinstance(fused, raw_slice.RangeReadSchema)

    def both(rows: list[int]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        where = (
            tf.constant([0] * len(rows), tf.int32),
            tf.constant(offsets[rows], tf.int64),
            tf.constant([sizes[r] for r in rows], tf.int64),
        )
        images, got_labels = fused.read_at([str(path)], *where)
        parsed = schema.parse_batch(raw_slice.read_records_at([str(path)], *where), metadata=False)
        return (images.numpy(), got_labels.numpy()), (
            parsed["image"].numpy(),
            parsed["label"].numpy(),
        )

    for rows in ([0, 1, 2, 3], [0, 4, 5]):  # proven, then parsed (label 200)
        (images, got_labels), (want_images, want_labels) = both(rows)
        assert images.shape == (len(rows), 4, 4, 3)
        np.testing.assert_array_equal(images, want_images)
        np.testing.assert_array_equal(got_labels, want_labels)
        np.testing.assert_array_equal(got_labels, [labels[r] for r in rows])
    *_, proven = raw_slice.read_raw_at(
        [str(path)], raw_layout(4 * 4 * 3), [0, 0], offsets[[0, 6]], [sizes[0], sizes[6]]
    )
    assert not proven.numpy()  # the short record is read, CRC checked, and never trusted


def fake_compiler(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake-cxx"
    script.write_text(f"#!/bin/sh\necho called >> {tmp_path / 'calls'}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_without_a_compiler_the_cause_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(raw_slice.COMPILER_ENV, "no-such-c++")
    library, why = raw_slice.built_library(tmp_path / "ops")
    assert library is None
    assert "no C++ compiler" in why and "CXX=no-such-c++" in why


def test_an_install_without_the_ops_source_reads_stock_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel that left ``raw_slice.cc`` out raised FileNotFoundError on every raw read."""
    monkeypatch.setattr(raw_slice, "SOURCE", tmp_path / "raw_slice.cc")
    library, why = raw_slice.built_library(tmp_path / "ops")
    assert library is None and f"the op's source {tmp_path / 'raw_slice.cc'} is missing" in why


def test_a_failed_build_is_said_once_and_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = fake_compiler(tmp_path, "echo 'fatal error: op.h: no such file' >&2\nexit 1")
    monkeypatch.setenv(raw_slice.COMPILER_ENV, str(compiler))
    first = raw_slice.built_library(tmp_path / "ops")
    second = raw_slice.built_library(tmp_path / "ops")
    assert first[0] is None and "exit 1" in first[1] and "op.h" in first[1]
    assert second[0] is None and second[1].startswith(first[1]) and "to try again" in second[1]
    assert (tmp_path / "calls").read_text().count("called") == 1
    assert not [p for p in (tmp_path / "ops").iterdir() if p.suffix != ".failed"]


def test_a_process_without_the_op_reads_stock_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(raw_slice, "built_library", lambda: (None, "no C++ compiler (test)"))
    raw_slice.loaded_op.cache_clear()
    try:
        got = [part.numpy() for part in raw_slice.record_ranges(records(), RANGES)]
        again = raw_slice.record_ranges(records(), RANGES)
    finally:
        raw_slice.loaded_op.cache_clear()
    err = capsys.readouterr().err
    assert err.count("read with stock TensorFlow ops") == 1 and "no C++ compiler (test)" in err
    for part, other in zip(got, again, strict=True):
        np.testing.assert_array_equal(part, other.numpy())


def test_a_build_lands_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that dies half way leaves no library behind for a later load to find."""
    compiler = fake_compiler(
        tmp_path,
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo partial > "$2"; shift; done\nexit 1',
    )
    monkeypatch.setenv(raw_slice.COMPILER_ENV, str(compiler))
    library, _why = raw_slice.built_library(tmp_path / "ops")
    assert library is None
    failed = raw_slice.library_path(tmp_path / "ops").with_suffix(".failed")
    assert os.listdir(tmp_path / "ops") == [failed.name]


def test_an_environment_without_room_for_the_build_reads_stock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only place for the build (an image's environment): said, never a crash."""
    monkeypatch.setenv(raw_slice.COMPILER_ENV, "true")
    (tmp_path / "ops").write_text("a file where the folder would go")
    library, why = raw_slice.built_library(tmp_path / "ops")
    assert library is None and f"cannot build into {tmp_path / 'ops'}" in why


def test_a_library_that_does_not_load_reads_stock_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library built for another machine or TensorFlow build: said with its path, never a
    crash of the read."""
    broken = tmp_path / "raw_slice-broken.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(raw_slice, "built_library", lambda: (broken, ""))
    raw_slice.loaded_op.cache_clear()
    try:
        assert raw_slice.loaded_op() is None
    finally:
        raw_slice.loaded_op.cache_clear()
    err = capsys.readouterr().err
    assert f"{broken} does not load" in err and "remove it to build it again" in err


def test_encoded_shards_never_ask_for_the_op(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """JPEG and PNG records are parsed, not cut: their reads neither load the op nor say it
    is missing."""
    monkeypatch.setattr(raw_slice, "built_library", lambda: (None, "no C++ compiler (test)"))
    raw_slice.loaded_op.cache_clear()
    try:
        for encoding in ("jpeg", "png"):
            schema = RecordSchema(8, 8, encoding)  # type: ignore[arg-type]
            assert raw_slice.range_read(schema) is schema
    finally:
        raw_slice.loaded_op.cache_clear()
    assert "stock TensorFlow ops" not in capsys.readouterr().err
