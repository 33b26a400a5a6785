"""The record schema: one object that yields both the serializer and the parse spec.

Writer (``tasks.shard``) and every reader (``tasks.reader``, validation, benchmarks) build
their view of a ``tf.train.Example`` from the same :class:`RecordSchema`, so a key or dtype
drift between them cannot happen silently.
"""

from __future__ import annotations

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

    # -- reading without TensorFlow (tasks.records) -----------------------------------------

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

    # -- reading with TensorFlow (tasks.reader, validation) --------------------------------

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

    def parse_batch(self, serialized: Any) -> dict[str, Any]:
        """Parse a batch of serialized examples into a dict of tensors (images decoded).

        Returns ``image`` uint8 [B, H, W, C], ``label`` int32 [B], ``content_hash`` and
        ``source`` string [B].
        """
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
        # parse_example keeps a static batch size (drop_remainder batches); reshape(-1) loses it.
        batch_size = features[LABEL_KEY].shape[0]
        images = tf.ensure_shape(images, (batch_size, *self.image_shape))
        return {
            IMAGE_KEY: images,
            LABEL_KEY: tf.cast(features[LABEL_KEY], tf.int32),
            HASH_KEY: features[HASH_KEY],
            SOURCE_KEY: features[SOURCE_KEY],
        }

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
