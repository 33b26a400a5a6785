"""The shard manifest: what a shard set holds, and the fingerprint that names it.

Written by the shard stage, read by validation and by every reader. It holds no timestamps
or absolute paths, so the same inputs and params give a byte-identical manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

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


class Generation(BaseModel):
    """One append to the shard set: the files it added and the records they hold.

    Generation 0 is what ``shard.mode: rebuild`` writes (shards at the top of the shard
    directory); generation ``n`` > 0 lives in ``gen-{n:05d}/``. A generation's files never
    change once written: later generations only add files, so DVC uploads only those.
    """

    model_config = ConfigDict(extra="forbid")

    number: int
    base_fingerprint: str | None  # the manifest this generation was appended to (None: 0)
    records_file: str  # per-shard record list (content hash, path, label, size), see shard.py
    records_sha256: str
    new_classes: list[str]  # classes this generation introduced (all of them for 0)
    num_records: dict[str, int]  # records added per split
    shards: list[str]  # the shard files it added, relative to the shard directory


class ShardManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: dict[str, object] = Field(alias="schema")
    classes: list[str]
    compression: str  # "none" | "gzip"
    resize: str  # the resize policy the images went through (pad | crop | stretch)
    draft_decode: bool  # JPEGs decoded at reduced size (shard.draft_decode): serving must match
    # tasks.images.preprocessing_version(): the code and libraries that computed the pixels
    preprocessing_version: str
    # splits[...].shards lists every shard of every generation (what readers read)
    splits: dict[str, SplitInfo]
    # empty only for manifests written before generations (and by test helpers)
    generations: list[Generation] = Field(default_factory=list)
    fingerprint: str = ""

    @property
    def record_schema(self) -> RecordSchema:
        return RecordSchema.from_dict(dict(self.schema_))

    @property
    def compression_type(self) -> str:
        """The ``compression_type`` argument tf.data readers and writers take."""
        return "GZIP" if self.compression == "gzip" else ""

    def compute_fingerprint(self) -> str:
        """sha256 over schema, classes, generations and every shard's name, size and hash."""
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
    draft_decode: bool,
    preprocessing_version: str,
    generations: list[Generation] | None = None,
) -> ShardManifest:
    manifest = ShardManifest.model_validate(
        {
            "generations": generations or [],
            "schema": schema.to_dict(),
            "classes": classes,
            "compression": compression,
            "resize": resize,
            "draft_decode": draft_decode,
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


def records_file_name(number: int) -> str:
    """Where generation ``number`` lists its records (generation 0 at the top, like its shards)."""
    return "records.json" if number == 0 else f"{generation_folder(number)}records.json"


def generation_folder(number: int) -> str:
    """Folder prefix of a generation's files: none for 0, ``gen-00001/`` for 1, and so on."""
    return "" if number == 0 else f"gen-{number:05d}/"


def load_records(
    shards_dir: str | Path, manifest: ShardManifest
) -> dict[str, list[dict[str, Any]]]:
    """Every generation's record list: shard file -> its records in file order.

    Each record is ``{"sha256", "path", "label_index", "width", "height"}``. A records file
    whose sha256 is not the manifest's raises: the lists stand in for re-reading old shards.
    """
    if not manifest.generations:
        raise ValueError(
            f"{Path(shards_dir) / MANIFEST_NAME}: written before shard generations (no record "
            "lists); rebuild the shard set (shard.mode: rebuild)"
        )
    per_file: dict[str, list[dict[str, Any]]] = {}
    for generation in manifest.generations:
        per_file.update(generation_records(shards_dir, generation))
    return per_file


def generation_records(
    shards_dir: str | Path, generation: Generation
) -> dict[str, list[dict[str, Any]]]:
    """One generation's record list (shard file -> records), checked against its sha256."""
    path = Path(shards_dir) / generation.records_file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: records of generation {generation.number} missing")
    if file_sha256(path) != generation.records_sha256:
        raise ValueError(f"{path}: sha256 differs from the manifest (edited or damaged)")
    shards: dict[str, list[dict[str, Any]]] = json.loads(path.read_text())["shards"]
    return shards


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
