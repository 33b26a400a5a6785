"""TFRecord files and ``tf.train.Example`` bytes without importing TensorFlow.

Shard workers only decode, resize and encode images; importing TensorFlow into each of them
costs seconds and ~750 MB. This module writes the same bytes TensorFlow would: the Example
wire format with map entries sorted by key (what ``SerializeToString(deterministic=True)``
does) and the TFRecord framing (length, masked CRC32C, data, masked CRC32C). Tests check both
byte-for-byte against TensorFlow. The reading half (framing with CRC checks, Example decoding)
serves readers without TensorFlow (``tasks.contracts.numpy_reader``); Shardflow's own training
reads with
``tf.data`` (``tasks.contracts.tf_reader``).
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import google_crc32c

FeatureValue = bytes | int


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 two's complement, as protobuf encodes negative int64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _feature(value: FeatureValue) -> bytes:
    if isinstance(value, bytes):
        return _field(1, _field(1, value))  # Feature.bytes_list { value: [value] }
    if isinstance(value, int):
        return _field(3, _field(1, _varint(value)))  # Feature.int64_list, packed
    raise TypeError(f"feature values must be bytes or int, got {type(value).__name__}")


def encode_example(features: Mapping[str, FeatureValue]) -> bytes:
    """Serialize one ``tf.train.Example`` of single-value features, keys in sorted order."""
    entries = b"".join(
        _field(1, _field(1, key.encode()) + _field(2, _feature(features[key])))
        for key in sorted(features)
    )
    return _field(1, entries)  # Example.features { feature: map<string, Feature> }


def _masked_crc(data: bytes) -> bytes:
    crc = google_crc32c.value(data)
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    return struct.pack("<I", masked)


def frame_record(data: bytes) -> bytes:
    """One TFRecord: uint64 length, masked CRC32C of it, the data, masked CRC32C of the data."""
    length = struct.pack("<Q", len(data))
    return length + _masked_crc(length) + data + _masked_crc(data)


class TFRecordWriter:
    """Write framed records to ``path``; ``gzip=True`` matches ``compression_type="GZIP"``.

    GZIP output has a zero timestamp and no file name, so it is deterministic.
    """

    def __init__(self, path: str | Path, *, gzip_compress: bool = False) -> None:
        self._raw: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._out: BinaryIO = (
            gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0, compresslevel=6)  # type: ignore[assignment]
            if gzip_compress
            else self._raw
        )

    def write(self, record: bytes) -> None:
        self._out.write(frame_record(record))

    def close(self) -> None:
        if self._out is not self._raw:
            self._out.close()
        self._raw.flush()
        self._raw.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- reading ---------------------------------------------------------------------------------
#
# The mirror image of the writer above, for readers that must not import TensorFlow
# (``tasks.contracts.numpy_reader``: PyTorch, JAX and NumPy users). Every length and CRC is checked.

HEADER_BYTES = 12  # uint64 length + masked CRC32C of the length
FOOTER_BYTES = 4  # masked CRC32C of the data


class CorruptRecord(ValueError):
    """A TFRecord's framing or its ``tf.train.Example`` bytes are not what they claim to be."""


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decode the varint at ``pos``; returns (value, position after it)."""
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            break
    raise CorruptRecord("malformed varint in Example bytes")


def _fields(data: bytes) -> list[tuple[int, bytes | int]]:
    """(field number, payload) of each field: varints (wire type 0) and length-delimited (2)."""
    out: list[tuple[int, bytes | int]] = []
    pos = 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            out.append((number, value))
        elif wire == 2:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise CorruptRecord("a length-delimited field runs past the end of the record")
            out.append((number, data[pos : pos + size]))
            pos += size
        else:
            raise CorruptRecord(f"unexpected wire type {wire} in Example bytes")
    return out


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_feature(key: str, data: bytes) -> FeatureValue:
    """One ``Feature`` holding a single bytes or int64 value (what ``encode_example`` writes)."""
    values: list[FeatureValue] = []
    for number, payload in _fields(data):
        if number == 1 and isinstance(payload, bytes):  # bytes_list
            values += [v for n, v in _fields(payload) if n == 1 and isinstance(v, bytes)]
        elif number == 3 and isinstance(payload, bytes):  # int64_list
            for n, v in _fields(payload):
                if n != 1:
                    continue
                if isinstance(v, int):  # unpacked
                    values.append(_int64(v))
                else:  # packed
                    pos = 0
                    while pos < len(v):
                        item, pos = _read_varint(v, pos)
                        values.append(_int64(item))
        else:
            raise CorruptRecord(f"feature {key!r}: only bytes and int64 features are supported")
    if len(values) != 1:
        raise CorruptRecord(f"feature {key!r} holds {len(values)} values, expected exactly 1")
    return values[0]


def decode_example(data: bytes) -> dict[str, FeatureValue]:
    """Parse ``tf.train.Example`` bytes of single-value features (the inverse of encode_example)."""
    features: dict[str, FeatureValue] = {}
    for number, payload in _fields(data):
        if number != 1 or not isinstance(payload, bytes):
            raise CorruptRecord(f"unexpected field {number} in Example bytes")
        for entry_number, entry in _fields(payload):
            if entry_number != 1 or not isinstance(entry, bytes):
                raise CorruptRecord(f"unexpected field {entry_number} in Example.features")
            parts = dict(_fields(entry))
            key, value = parts.get(1, b""), parts.get(2, b"")
            if not isinstance(key, bytes) or not isinstance(value, bytes):
                raise CorruptRecord("malformed feature map entry in Example bytes")
            try:
                name = key.decode()
            except UnicodeDecodeError as error:
                raise CorruptRecord(f"a feature key is not UTF-8 ({key[:20]!r})") from error
            features[name] = _decode_feature(name, value)
    return features


def is_canonical(data: bytes, features: Mapping[str, FeatureValue]) -> bool:
    """Whether ``data`` is exactly what :func:`encode_example` writes for ``features``: each
    feature once, in key order, nothing else. Any other layout (a feature repeated, an entry
    after the last, entries out of order) decodes here as protobuf does (the last entry of a
    key wins) but a reader at fixed offsets would take the first: two readers, two records."""
    return encode_example(features) == data


def read_framed(handle: BinaryIO) -> bytes | None:
    """The next record's data from ``handle`` (CRCs checked), or None at a clean end of file."""
    header = handle.read(HEADER_BYTES)
    if not header:
        return None
    if len(header) < HEADER_BYTES:
        raise CorruptRecord(f"truncated record header ({len(header)} of {HEADER_BYTES} bytes)")
    if _masked_crc(header[:8]) != header[8:]:
        raise CorruptRecord("length CRC mismatch (not a record boundary, or a damaged file)")
    (length,) = struct.unpack("<Q", header[:8])
    data = _read_at_most(handle, length)
    footer = handle.read(FOOTER_BYTES)
    if len(data) < length or len(footer) < FOOTER_BYTES:
        raise CorruptRecord(f"truncated record ({len(data)} of {length} data bytes)")
    if _masked_crc(data) != footer:
        raise CorruptRecord("data CRC mismatch (damaged record)")
    return data


def read_framed_at(fd: int, offset: int, size: int, where: str) -> bytes:
    """The data of the record framed in bytes ``[offset, offset + size)`` of the open file
    ``fd`` (one positional read), CRCs checked and its length the one ``size`` implies; an
    error naming ``where`` (file, byte) otherwise. The stock twin of the positional-read op
    (``tasks.contracts.raw_slice``): the same bytes, or the same refusal."""
    if size < HEADER_BYTES + FOOTER_BYTES:
        raise CorruptRecord(f"{where}: no record fits in {size} bytes (a stale offset index?)")
    framed = os.pread(fd, size, offset)
    if len(framed) < size:
        raise CorruptRecord(
            f"{where}: the file ends inside the record (a truncated shard or a stale offset index)"
        )
    (length,) = struct.unpack("<Q", framed[:8])
    if length != size - HEADER_BYTES - FOOTER_BYTES:
        raise CorruptRecord(
            f"{where}: the record says {length} bytes, the offset index "
            f"{size - HEADER_BYTES - FOOTER_BYTES} (a stale offset index?)"
        )
    if _masked_crc(framed[:8]) != framed[8:HEADER_BYTES]:
        raise CorruptRecord(f"{where}: the length's CRC does not match")
    data = framed[HEADER_BYTES:-FOOTER_BYTES]
    if _masked_crc(data) != framed[-FOOTER_BYTES:]:
        raise CorruptRecord(f"{where}: the data's CRC does not match (a damaged shard)")
    return data


_CHUNK = 1 << 24  # a declared length is read this much at a time: never allocated whole


def _read_at_most(handle: BinaryIO, length: int) -> bytes:
    """Up to ``length`` bytes of ``handle``, read in chunks, so a damaged or crafted length
    (2**40) ends as a short read where the file does, never as one huge allocation."""
    if length <= _CHUNK:
        return handle.read(length)
    parts, left = [], length
    while left > 0:
        part = handle.read(min(left, _CHUNK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def open_records(path: str | Path, *, gzip_compressed: bool = False) -> BinaryIO:
    """Open a TFRecord file for reading; GZIP files are decompressed as they are read, and
    damaged compressed data raises :class:`CorruptRecord` like damaged framing does."""
    if gzip_compressed:
        return _CheckedGzipFile(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


class _CheckedGzipFile(gzip.GzipFile):
    """A GZIP reader whose decompression errors (``zlib.error``, a stream cut short) are
    :class:`CorruptRecord`: one damaged byte in a compressed shard is bad data, to be named
    with its file and record, never a crash of the reader or of validation."""

    def read(self, size: int | None = -1) -> bytes:
        try:
            return super().read(size)
        except (zlib.error, EOFError) as error:
            raise CorruptRecord(f"damaged GZIP data ({error})") from error

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return super().seek(offset, whence)
        except (zlib.error, EOFError) as error:
            raise CorruptRecord(f"damaged GZIP data ({error})") from error


def record_offsets(path: str | Path, *, gzip_compressed: bool = False) -> list[tuple[int, int]]:
    """(offset, framed length) of every record, reading only headers and seeking over data.

    Offsets are positions in the uncompressed stream. Each length is checked against its CRC,
    and the file must end exactly after the last record.
    """
    offsets: list[tuple[int, int]] = []
    # A plain file seeks past its end without complaint, so its size bounds every record;
    # a GZIP stream stops at the end of its data, so its position does.
    size = None if gzip_compressed else os.path.getsize(path)
    with open_records(path, gzip_compressed=gzip_compressed) as handle:
        while header := handle.read(HEADER_BYTES):
            where = f"{path}: record {len(offsets)}"
            if len(header) < HEADER_BYTES or _masked_crc(header[:8]) != header[8:]:
                raise CorruptRecord(f"{where}: truncated or damaged record header")
            (length,) = struct.unpack("<Q", header[:8])
            start = handle.tell() - HEADER_BYTES
            framed = HEADER_BYTES + length + FOOTER_BYTES
            handle.seek(length + FOOTER_BYTES, 1)
            end = handle.tell() if size is None else min(size, start + framed)
            if end - start != framed:
                raise CorruptRecord(f"{where}: truncated record")
            offsets.append((start, framed))
    return offsets
