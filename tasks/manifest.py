"""The shard manifest: what a shard set holds, and the fingerprint that names it.

Written by the shard stage, read by validation and by every reader. It holds no timestamps
or absolute paths, so the same inputs and params give a byte-identical manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tasks.schema import RecordSchema

MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val", "test")


class ShardFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str  # name relative to the shard directory, e.g. train.tfrecord-00000-of-00004
    num_records: int
    bytes: int
    sha256: str


class SplitInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_records: int
    class_counts: dict[str, int]
    shards: list[ShardFile]


class ShardManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: dict[str, object] = Field(alias="schema")
    classes: list[str]
    compression: str  # "none" | "gzip"
    resize: str  # the resize policy the images went through (pad | crop | stretch)
    # tasks.images.preprocessing_version(): the code and libraries that computed the pixels
    preprocessing_version: str
    splits: dict[str, SplitInfo]
    fingerprint: str = ""

    @property
    def record_schema(self) -> RecordSchema:
        return RecordSchema.from_dict(dict(self.schema_))

    @property
    def compression_type(self) -> str:
        """The ``compression_type`` argument tf.data readers and writers take."""
        return "GZIP" if self.compression == "gzip" else ""

    def compute_fingerprint(self) -> str:
        """sha256 over schema, classes and every shard's name, size and content hash."""
        body = self.model_dump(mode="json", by_alias=True, exclude={"fingerprint"})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise KeyError(f"split {name!r} not in manifest (has: {sorted(self.splits)})")
        return self.splits[name]

    def to_json(self) -> str:
        data = self.model_dump(mode="json", by_alias=True)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def build_manifest(
    schema: RecordSchema,
    classes: list[str],
    compression: str,
    splits: dict[str, SplitInfo],
    *,
    resize: str,
    preprocessing_version: str,
) -> ShardManifest:
    manifest = ShardManifest.model_validate(
        {
            "schema": schema.to_dict(),
            "classes": classes,
            "compression": compression,
            "resize": resize,
            "preprocessing_version": preprocessing_version,
            "splits": splits,
        }
    )
    manifest.fingerprint = manifest.compute_fingerprint()
    return manifest


def load_manifest(shards_dir: str | Path) -> ShardManifest:
    """Load ``manifest.json`` from a shard directory, with errors that say what to do."""
    path = Path(shards_dir) / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path}: no shard manifest; run the shard stage first")
    try:
        manifest = ShardManifest.model_validate_json(path.read_text())
    except ValueError as error:
        raise ValueError(
            f"{path}: not a manifest this code reads ({error}); rerun the shard stage"
        ) from error
    if manifest.fingerprint != manifest.compute_fingerprint():
        raise ValueError(f"{path}: fingerprint does not match its contents (edited by hand?)")
    return manifest


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
