"""One shard's unit of work: its spec (picklable, so any runner can ship it), its records,
and the preprocessing of one record.

Preprocessing: :func:`tasks.images.preprocess_bytes` (decode, EXIF, RGB, resize policy: the
code prediction reuses), then the record schema's encoder. Its version
(:func:`tasks.images.preprocessing_version`) is part of every spec, so the plan hash, and with
it every shard, follows the code and the pixel libraries.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.images import preprocess_bytes
from tasks.params import ShardParams
from tasks.schema import RecordSchema


@dataclass(frozen=True)
class ShardRecord:
    """One input image of a shard: where it is, its class index and its content hash."""

    path: str  # relative to ShardSpec.source_dir
    label_index: int
    sha256: str


@dataclass(frozen=True)
class ShardSpec:
    """Everything needed to write one shard file; picklable, so any runner can ship it."""

    split: str
    index: int
    num_shards: int
    file: str
    records: tuple[ShardRecord, ...]
    source_dir: str
    schema: dict[str, Any]
    resize: str
    compression: str  # "none" | "gzip"
    preprocessing_version: str  # tasks.images.preprocessing_version() when planned
    draft: bool  # reduced-size JPEG decoding (shard.draft_decode)

    @property
    def record_schema(self) -> RecordSchema:
        return RecordSchema.from_dict(self.schema)


def schema_from_params(params: ShardParams) -> RecordSchema:
    height, width = params.image_size
    return RecordSchema(height, width, params.encoding, jpeg_quality=params.jpeg_quality)


# Where a record's source bytes come from when not from ``source_dir`` (a Dask worker without
# the stage's file system reads them from the staging prefix, :mod:`tasks.shard.staging`);
# it returns them only once their sha256 is the record's.
SourceReader = Callable[[ShardRecord], bytes]


def read_source(source_dir: str, record: ShardRecord) -> bytes:
    """A record's source file under ``source_dir``, checked against its ingest sha256."""
    path = Path(source_dir) / record.path
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise ValueError(f"{path}: content changed since ingest (sha256 differs); rerun ingest")
    return data


def preprocess(
    source_dir: str,
    record: ShardRecord,
    schema: RecordSchema,
    policy: str,
    draft: bool,
    read: SourceReader | None = None,
) -> bytes:
    """Read, check, decode, resize and encode one source image; returns the image feature.

    The bytes come from ``source_dir`` unless ``read`` fetches them (checked either way)."""
    data = read(record) if read is not None else read_source(source_dir, record)
    # Ingest already enforced the size limits; the same preprocessing, limits off.
    size = (schema.height, schema.width)
    pixels = preprocess_bytes(data, size, policy, max_pixels=sys.maxsize, draft=draft)
    return schema.encode_image(pixels)
