"""One shard's unit of work: its spec (picklable, so any runner can ship it), its records,
and the preprocessing of one record.

Preprocessing: :func:`tasks.images.preprocess_bytes` (decode, EXIF, RGB, resize policy: the
code prediction reuses), then the record schema's encoder; or, for an image ingest decoded at
the scale this record needs, the pixels ingest made of that decode the same way
(:mod:`tasks.contracts.handoff`).
Its version (:func:`tasks.images.preprocessing_version`) is part of every spec, so the plan
hash, and with it every shard, follows the code and the pixel libraries.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.contracts import handoff as handoff_store
from tasks.images import preprocess_bytes
from tasks.runtime.params import ShardParams
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
    # the folder of ingest's kept decodes (tasks.contracts.handoff), or None; like source_dir, not
    # in
    # the plan hash: the shard's bytes are the same with or without it
    handoff: str | None = None

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
    return read_checked(Path(source_dir) / record.path, record.sha256)


def preprocess(
    source_dir: str,
    record: ShardRecord,
    schema: RecordSchema,
    policy: str,
    draft: bool,
    handoff: str | None = None,
    read: SourceReader | None = None,
) -> bytes:
    """Read, check, decode, resize and encode one source image; returns the image feature.

    The bytes come from ``source_dir`` unless ``read`` fetches them (checked either way).
    With ``handoff`` (the hand-off folder of the plan's preprocessing version), the pixels
    ingest made of the image for this very record size, policy and decoding are encoded
    instead (:func:`tasks.contracts.handoff.take`). The file is read and its sha256 checked unless
    the
    entry holds its stat signature, taken when ingest hashed it, and that still matches
    (what ``ingest.trust_file_stat`` trusts).
    """
    path = Path(source_dir) / record.path
    size = (schema.height, schema.width)
    target = handoff_store.Target(*size, policy, draft)
    entry = handoff_store.take(Path(handoff), record.sha256, target) if handoff else None
    if entry is None or read is not None or not entry.file_unchanged(path):
        data = read(record) if read is not None else read_checked(path, record.sha256)
        if entry is None:
            # Ingest already enforced the size limits; the same preprocessing, limits off.
            pixels = preprocess_bytes(data, size, policy, max_pixels=sys.maxsize, draft=draft)
            return schema.encode_image(pixels)
    return schema.encode_image(entry.pixels)


def read_checked(path: Path, sha256: str) -> bytes:
    """The file's bytes, refused when they are not those ingest indexed (or gone)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no such file here: removed since ingest (rerun ingest), or a worker "
            "that does not share the source folder (set shard.staging_url)"
        ) from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{path}: content changed since ingest (sha256 differs); rerun ingest")
    return data
