"""The record schema: one object that yields both the serializer and the parse spec.

Writer (``tasks.shard``) and every reader (``tasks.contracts.tf_reader``, validation, benchmarks)
build
their view of a ``tf.train.Example`` from the same :class:`RecordSchema`, so a key or dtype
drift between them cannot happen silently.

This module's code is part of :func:`tasks.images.preprocessing_version` (the encoder decides
a ``jpeg``/``png`` record's bytes): its code tokens count, its comments, docstrings and layout
do not, so editing prose here never reshards anyone's data while a code change always does.
"""

from __future__ import annotations

import functools
import hashlib
import io
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

SCHEMA_VERSION = 1
Encoding = Literal["raw", "jpeg", "png"]

# Feature keys, in one place. Every reader and writer goes through RecordSchema.
IMAGE_KEY = "image"
LABEL_KEY = "label"
HASH_KEY = "content_hash"
SOURCE_KEY = "source"


class SchemaError(ValueError):
    """A record or schema does not match what the manifest declares."""


# ``content_hash`` is a sha256 hex digest: its length fixes where a raw record's image starts.
HASH_HEX_CHARS = hashlib.sha256().digest_size * 2
# Bytes of the ``source`` entry checked after the label: entry tag, 1-byte length, key field.
_SOURCE_HEAD = 2 + 2 + len(SOURCE_KEY)


@dataclass(frozen=True)
class RawLayout:
    """Where image and label bytes sit in a raw record as ``tasks.tfrecord`` writes it.

    ``encode_example`` writes keys in sorted order, so a raw record is ``content_hash``
    (64 hex chars), ``image`` (exactly H*W*C bytes), ``label``, ``source``: the image starts
    at a fixed offset. Reading it there skips the copy ``parse_example`` makes of every image.
    It is only trusted where a record's own bytes prove it: ``head`` (everything before the
    image) and ``tail`` (the label entry and the start of the ``source`` entry) must equal
    the template on the bits ``*_mask`` selects. Unchecked bits are the varying ones: the
    outer length (only its varint continuation bits are fixed), the hash value, the label
    value (its high bit must be clear: a 1-byte varint, labels 0..127).
    """

    image_offset: int
    image_bytes: int
    label_offset: int
    head: bytes
    head_mask: bytes
    tail: bytes
    tail_mask: bytes

    @property
    def tail_offset(self) -> int:
        return self.image_offset + self.image_bytes

    @property
    def length(self) -> int:
        """Bytes of each record to decode: everything up to the end of the checked tail."""
        return self.tail_offset + len(self.tail)


def _bytes_match(actual: Any, template: bytes, mask: bytes) -> Any:
    """True (scalar tensor) when every row of uint8 ``actual`` equals ``template`` on ``mask``."""
    import tensorflow as tf

    mask_bits = np.frombuffer(mask, np.uint8)
    want = np.frombuffer(template, np.uint8) & mask_bits
    return tf.reduce_all(tf.equal(tf.bitwise.bitwise_and(actual, mask_bits), want))


def _entry(key: str, value: bytes | int) -> bytes:
    """One feature-map entry exactly as ``encode_example`` writes it inside a record.

    A one-feature record is ``0x0a``, a varint length, then the entry: strip the first two.
    """
    from tasks.tfrecord import encode_example

    record = encode_example({key: value})
    start = 1
    while record[start] & 0x80:  # varint continuation bit
        start += 1
    return record[start + 1 :]


@functools.cache
def raw_layout(image_bytes: int) -> RawLayout:
    """The layout of a raw record with ``image_bytes`` of pixels, derived from the writer.

    Built from the same ``encode_example`` that writes shards, so a change to the writer
    changes the template instead of silently invalidating hard-coded offsets.
    """
    from tasks.tfrecord import encode_example

    hash_entry = _entry(HASH_KEY, b"0" * HASH_HEX_CHARS)
    image_entry = _entry(IMAGE_KEY, bytes(image_bytes))
    label_entry = _entry(LABEL_KEY, 0)
    source_entry = _entry(SOURCE_KEY, b"")
    entries = hash_entry + image_entry + label_entry + source_entry
    record = encode_example(
        {
            HASH_KEY: b"0" * HASH_HEX_CHARS,
            IMAGE_KEY: bytes(image_bytes),
            LABEL_KEY: 0,
            SOURCE_KEY: b"",
        }
    )
    if not record.endswith(entries):
        raise SchemaError("encode_example no longer writes feature entries in sorted key order")
    outer = record[: len(record) - len(entries)]
    image_head = image_entry[:-image_bytes]
    head = outer + hash_entry + image_head
    head_mask = (
        b"\xff"
        + b"\x80" * (len(outer) - 1)
        + b"\xff" * (len(hash_entry) - HASH_HEX_CHARS)
        + b"\x00" * HASH_HEX_CHARS
        + b"\xff" * len(image_head)
    )
    tail = label_entry + source_entry[:_SOURCE_HEAD]
    tail_mask = (
        b"\xff" * (len(label_entry) - 1) + b"\x80" + b"\xff\x80" + b"\xff" * (_SOURCE_HEAD - 2)
    )
    return RawLayout(
        image_offset=len(head),
        image_bytes=image_bytes,
        label_offset=len(head) + image_bytes + len(label_entry) - 1,
        head=head,
        head_mask=head_mask,
        tail=tail,
        tail_mask=tail_mask,
    )


@dataclass(frozen=True)
class RecordSchema:
    """Layout of one record: image bytes at a fixed size, its label and its provenance.

    Features (all required, one value each):
      ``image``        bytes   raw uint8 HxWxC (``raw``) or an encoded JPEG/PNG
      ``label``        int64   class index into the manifest's ``classes``
      ``content_hash`` bytes   sha256 hex of the source file (leakage and duplicate checks)
      ``source``       bytes   source path relative to the ingest folder (error messages)
    """

    height: int
    width: int
    encoding: Encoding
    channels: int = 3
    jpeg_quality: int = 90
    version: int = SCHEMA_VERSION

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, self.channels)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "features": {
                IMAGE_KEY: "bytes",
                LABEL_KEY: "int64",
                HASH_KEY: "bytes",
                SOURCE_KEY: "bytes",
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecordSchema:
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise SchemaError(
                f"record schema version {version} is not supported (this code reads "
                f"version {SCHEMA_VERSION}); rerun the shard stage"
            )
        fields = {k: data[k] for k in ("height", "width", "encoding", "channels", "jpeg_quality")}
        return cls(**fields, version=version)

    # -- writing ---------------------------------------------------------------------------

    def encode_image(self, pixels: np.ndarray) -> bytes:
        """Encode a uint8 HxWxC array as this schema's image bytes (deterministic)."""
        if pixels.shape != self.image_shape or pixels.dtype != np.uint8:
            raise SchemaError(
                f"image has shape {pixels.shape} {pixels.dtype}, schema wants "
                f"{self.image_shape} uint8"
            )
        if self.encoding == "raw":
            return np.ascontiguousarray(pixels).tobytes()
        from PIL import Image

        buffer = io.BytesIO()
        image = Image.fromarray(pixels, mode="RGB")
        if self.encoding == "jpeg":
            # Fixed subsampling and no optimize pass keep bytes stable across runs.
            image.save(buffer, format="JPEG", quality=self.jpeg_quality, subsampling=0)
        else:
            image.save(buffer, format="PNG", compress_level=6)
        return buffer.getvalue()

    def serialize(self, image_bytes: bytes, label: int, content_hash: str, source: str) -> bytes:
        """One ``tf.train.Example`` as bytes, keys in sorted order (deterministic).

        Encoded without TensorFlow (see ``tasks.tfrecord``), byte-identical to
        ``tf.train.Example(...).SerializeToString(deterministic=True)``.
        """
        from tasks.tfrecord import encode_example

        return encode_example(
            {
                IMAGE_KEY: image_bytes,
                LABEL_KEY: int(label),
                HASH_KEY: content_hash.encode(),
                SOURCE_KEY: source.encode(),
            }
        )

    # -- reading without TensorFlow (tasks.contracts.numpy_reader) ---

    def parse(self, serialized: bytes) -> dict[str, Any]:
        """The mirror of :meth:`serialize`: one record's features, image decoded, no TensorFlow.

        Returns ``image`` uint8 ``image_shape`` (NumPy), ``label`` int, ``content_hash`` and
        ``source`` str: what :meth:`parse_single` gives as tensors.
        """
        from tasks.tfrecord import decode_example

        features = decode_example(serialized)
        expected = {IMAGE_KEY: bytes, LABEL_KEY: int, HASH_KEY: bytes, SOURCE_KEY: bytes}
        if set(features) != set(expected):
            raise SchemaError(
                f"record has features {sorted(features)}, schema wants {sorted(expected)}"
            )
        for key, kind in expected.items():
            if not isinstance(features[key], kind):
                raise SchemaError(f"feature {key!r} is not {kind.__name__}")
        return {
            IMAGE_KEY: self.decode(features[IMAGE_KEY]),  # type: ignore[arg-type]
            LABEL_KEY: features[LABEL_KEY],
            HASH_KEY: features[HASH_KEY].decode(),  # type: ignore[union-attr]
            SOURCE_KEY: features[SOURCE_KEY].decode(),  # type: ignore[union-attr]
        }

    def decode(self, image_bytes: bytes) -> np.ndarray:
        """The mirror of :meth:`encode_image`: image bytes to a writable uint8 HxWxC array."""
        if self.encoding == "raw":
            expected = self.height * self.width * self.channels
            if len(image_bytes) != expected:
                raise SchemaError(
                    f"raw image has {len(image_bytes)} bytes, schema wants {expected} "
                    f"({self.image_shape} uint8)"
                )
            return np.frombuffer(image_bytes, dtype=np.uint8).reshape(self.image_shape).copy()
        from PIL import Image

        with Image.open(io.BytesIO(image_bytes)) as image:
            if image.format != self.encoding.upper():
                raise SchemaError(f"image is {image.format}, schema wants {self.encoding}")
            pixels = np.array(image.convert("RGB"), dtype=np.uint8)  # a writable copy
        if pixels.shape != self.image_shape:
            raise SchemaError(f"image has shape {pixels.shape}, schema wants {self.image_shape}")
        return pixels

    # -- reading with TensorFlow (tasks.contracts.tf_reader, validation) ---

    def parse_spec(self) -> dict[str, Any]:
        import tensorflow as tf

        return {
            IMAGE_KEY: tf.io.FixedLenFeature([], tf.string),
            LABEL_KEY: tf.io.FixedLenFeature([], tf.int64),
            HASH_KEY: tf.io.FixedLenFeature([], tf.string),
            SOURCE_KEY: tf.io.FixedLenFeature([], tf.string),
        }

    def decode_image(self, image_bytes: Any) -> Any:
        """Decode one image feature to a uint8 tensor of static shape ``image_shape``."""
        import tensorflow as tf

        if self.encoding == "raw":
            pixels = tf.io.decode_raw(image_bytes, tf.uint8)
            pixels = tf.reshape(pixels, self.image_shape)
        elif self.encoding == "jpeg":
            pixels = tf.io.decode_jpeg(image_bytes, channels=self.channels)
        else:
            pixels = tf.io.decode_png(image_bytes, channels=self.channels)
        return tf.ensure_shape(pixels, self.image_shape)

    def parse_batch(self, serialized: Any, *, metadata: bool = True) -> dict[str, Any]:
        """Parse a batch of serialized examples into a dict of tensors (images decoded).

        Returns ``image`` uint8 [B, H, W, C], ``label`` int32 [B] and, with ``metadata``,
        ``content_hash`` and ``source`` string [B]. Training needs no metadata: leaving it out
        lets a raw batch skip ``parse_example`` entirely (see :meth:`_parse_raw_batch`).
        """
        if self.encoding == "raw":
            return self._parse_raw_batch(serialized, metadata=metadata)
        return self._parse_batch_general(serialized, metadata=metadata)

    def _parse_batch_general(self, serialized: Any, *, metadata: bool) -> dict[str, Any]:
        """``parse_example`` then decode: any record layout, every key checked by name."""
        import tensorflow as tf

        features = tf.io.parse_example(serialized, self.parse_spec())
        if self.encoding == "raw":
            # Fixed-length raw bytes decode as one vectorised op over the whole batch.
            pixels = tf.io.decode_raw(features[IMAGE_KEY], tf.uint8)
            images = tf.reshape(pixels, (-1, *self.image_shape))
        else:
            images = tf.map_fn(
                self.decode_image,
                features[IMAGE_KEY],
                fn_output_signature=tf.TensorSpec(self.image_shape, tf.uint8),
            )
        parsed = {
            IMAGE_KEY: self._static_batch(images, serialized),
            LABEL_KEY: tf.cast(features[LABEL_KEY], tf.int32),
        }
        if metadata:
            parsed |= {HASH_KEY: features[HASH_KEY], SOURCE_KEY: features[SOURCE_KEY]}
        return parsed

    def _parse_raw_batch(self, serialized: Any, *, metadata: bool) -> dict[str, Any]:
        """Raw pixels straight from the serialized bytes when every record proves the layout.

        ``parse_example`` copies each image into a string (and walks every record) before
        ``decode_raw`` copies it into pixels. Here ``decode_raw`` copies each record's first
        :attr:`RawLayout.length` bytes and the image and label are sliced out of those.
        The batch takes this path only if every record's bytes around the image match
        :func:`raw_layout`; any other batch (another writer's key order, a hash that is not
        sha256 hex, a label over 127, a long source path, a missing key) goes through
        :meth:`_parse_batch_general`, which reads it correctly or fails naming the key.
        """
        import tensorflow as tf

        layout, record_bytes, proven = self.raw_record_bytes(serialized)

        def fast() -> dict[str, Any]:
            pixels = record_bytes[:, layout.image_offset : layout.tail_offset]
            images = tf.reshape(pixels, (-1, *self.image_shape))
            parsed = {
                IMAGE_KEY: self._static_batch(images, serialized),
                LABEL_KEY: tf.cast(record_bytes[:, layout.label_offset], tf.int32),
            }
            if metadata:
                spec = {k: v for k, v in self.parse_spec().items() if k != IMAGE_KEY}
                features = tf.io.parse_example(serialized, spec)
                parsed |= {HASH_KEY: features[HASH_KEY], SOURCE_KEY: features[SOURCE_KEY]}
            return parsed

        return tf.cond(  # type: ignore[no-any-return]
            proven, fast, lambda: self._parse_batch_general(serialized, metadata=metadata)
        )

    def raw_record_bytes(self, serialized: Any) -> tuple[RawLayout, Any, Any]:
        """Each record's first ``layout.length`` bytes and whether the whole batch has the layout.

        Returns the :class:`RawLayout`, uint8 [B, length] and a scalar bool tensor that is true
        only when every record's head and tail bytes match the layout's template.
        """
        import tensorflow as tf

        layout = raw_layout(self.height * self.width * self.channels)
        record_bytes = tf.io.decode_raw(serialized, tf.uint8, fixed_length=layout.length)
        proven = tf.logical_and(
            _bytes_match(record_bytes[:, : layout.image_offset], layout.head, layout.head_mask),
            _bytes_match(record_bytes[:, layout.tail_offset :], layout.tail, layout.tail_mask),
        )
        return layout, record_bytes, proven

    def _static_batch(self, images: Any, serialized: Any) -> Any:
        """Keep a static batch size (drop_remainder batches); ``reshape(-1, ...)`` loses it."""
        import tensorflow as tf

        return tf.ensure_shape(images, (serialized.shape[0], *self.image_shape))

    def parse_single(self, serialized: Any) -> dict[str, Any]:
        """Parse one serialized example (validation walks records one at a time)."""
        import tensorflow as tf

        features = tf.io.parse_single_example(serialized, self.parse_spec())
        return {
            IMAGE_KEY: self.decode_image(features[IMAGE_KEY]),
            LABEL_KEY: tf.cast(features[LABEL_KEY], tf.int32),
            HASH_KEY: features[HASH_KEY],
            SOURCE_KEY: features[SOURCE_KEY],
        }
