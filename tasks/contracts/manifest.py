"""The shard manifest: what a shard set holds, and the fingerprint that names it.

Written by the shard stage, read by validation and by every reader. It holds no timestamps
or absolute paths, so the same inputs and params give a byte-identical manifest.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, Field

from tasks.contracts.content import SPLITS as SPLITS  # re-exported: the manifest's splits
from tasks.contracts.content import file_sha256 as file_sha256  # re-exported: shards' hash
from tasks.schema import RecordSchema

MANIFEST_NAME = "manifest.json"
# The shard stage's resume record (the plan it is writing), in the top folder and in each
# generation's.
PLAN_NAME = ".plan.json"
# Where each record of the set is, by content hash (tasks.contracts.membership): outside the
# fingerprint.
MEMBERSHIP_NAME = "membership.bin"
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


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

    @property
    def total_records(self) -> int:
        return sum(info.num_records for info in self.splits.values())

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
    return parse_manifest(path.read_text(), where=str(path))


def parse_manifest(text: str, *, where: str) -> ShardManifest:
    """A manifest from its JSON text (``where`` names its file or object in errors)."""
    try:
        manifest = ShardManifest.model_validate_json(text)
    except ValueError as error:
        raise ValueError(
            f"{where}: not a manifest this code reads ({error}); rerun the shard stage"
        ) from error
    if manifest.fingerprint != manifest.compute_fingerprint():
        raise ValueError(f"{where}: fingerprint does not match its contents (edited by hand?)")
    return manifest


def own_files(manifest: ShardManifest) -> set[str]:
    """Every file of the shard folder the manifest accounts for, as POSIX paths relative to
    it: the manifest, its membership, every shard, and each generation's record list and plan
    record."""
    files = {MANIFEST_NAME, PLAN_NAME, MEMBERSHIP_NAME}
    files.update(shard.file for info in manifest.splits.values() for shard in info.shards)
    for generation in manifest.generations:
        files.add(generation.records_file)
        files.add(f"{generation_folder(generation.number)}{PLAN_NAME}")
    return files


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
    per_file: dict[str, list[dict[str, Any]]] = {}
    for file, record in stream_records(shards_dir, manifest):
        per_file.setdefault(file, []).append(record)
    return per_file


def stream_records(
    shards_dir: str | Path,
    manifest: ShardManifest,
    generations: list[Generation] | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(shard file, record)`` of every generation's record list (or of ``generations``),
    in file order.

    What :func:`load_records` returns, streamed: parsed as one document, every record's
    dict would be in memory at once; streamed one shard's list at a time, as fast. Each
    file's sha256 is checked as it is read; a mismatch raises once the file is read, before
    the iteration ends, so a consumer that runs it to the end never keeps what an edited
    list said.
    """
    if not manifest.generations:
        raise ValueError(
            f"{Path(shards_dir) / MANIFEST_NAME}: written before shard generations (no record "
            "lists); rebuild the shard set (shard.mode: rebuild)"
        )
    for generation in manifest.generations if generations is None else generations:
        path = Path(shards_dir) / generation.records_file
        if not path.is_file():
            raise FileNotFoundError(f"{path}: records of generation {generation.number} missing")
        edited = ValueError(f"{path}: sha256 differs from the manifest (edited or damaged)")
        with open(path, "rb") as handle:
            stream = _JsonStream(handle, path)
            try:
                yield from stream.shard_records()
            except ValueError as error:  # not a list this code wrote: say why first
                if stream.sha256() != generation.records_sha256:
                    raise edited from error
                raise
            if stream.sha256() != generation.records_sha256:
                raise edited


class _JsonStream:
    """Reads ``{..., "shards": {file: [record, ...], ...}, ...}`` a shard's list at a time.

    Each value is parsed by :meth:`json.JSONDecoder.raw_decode` from a window of the file
    (1 MiB reads); the window grows only while a value does not fit, so memory holds one
    read and one shard's list, whatever the file's size. Every byte read is hashed.
    """

    CHUNK = 1 << 20

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self.handle, self.path = handle, path
        self.digest = hashlib.sha256()
        self.decoder = json.JSONDecoder()
        self.text_decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.eof = "", 0, False

    def sha256(self) -> str:
        while self._fill():  # hash whatever follows the document too
            self.pos = len(self.buf)
        return self.digest.hexdigest()

    def shard_records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        self._expect("{")
        for key in self._members("}"):
            if key != "shards":
                self._value()
                continue
            self._expect("{")
            for file in self._members("}"):
                records = self._value()  # one shard's list: a few thousand records at most
                if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                    raise self._error(f"the records of {file!r} are not a list of objects")
                for record in records:
                    yield file, record
        if self._peek(end_ok=True):
            raise self._error("data after the document")

    def _members(self, close: str) -> Iterator[str]:
        """The keys of an object whose opening brace was read; the caller reads each value."""
        if self._peek() == close:
            self.pos += 1
            return
        while True:
            key = self._value()
            if not isinstance(key, str):
                raise self._error("an object key is not a string")
            self._expect(":")
            yield key
            if self._separator(close):
                return

    def _separator(self, close: str) -> bool:
        """True at ``close`` (consumed), False at a comma (consumed)."""
        char = self._peek()
        self.pos += 1
        if char == close:
            return True
        if char != ",":
            raise self._error(f"expected ',' or {close!r}, found {char!r}")
        return False

    def _expect(self, char: str) -> None:
        found = self._peek()
        if found != char:
            raise self._error(f"expected {char!r}, found {found!r}")
        self.pos += 1

    def _peek(self, end_ok: bool = False) -> str:
        """The next character that is not JSON whitespace (\"\" at the end when ``end_ok``)."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                if end_ok:
                    return ""
                raise self._error("unexpected end of file")

    def _value(self) -> Any:
        self._peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as error:
                if self._fill():
                    continue
                raise self._error(f"not JSON ({error.msg})") from error
            if end == len(self.buf) and self._fill():
                continue  # a number may go on in the next read
            self.pos = end
            return value

    def _fill(self) -> bool:
        """Read more of the file into the window; False at its end."""
        if self.eof:
            return False
        chunk = self.handle.read(self.CHUNK)
        self.digest.update(chunk)
        try:
            text = self.text_decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as error:
            raise self._error(f"not UTF-8: {error.reason}") from error
        self.eof = not chunk
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return bool(chunk) or bool(text)

    def _error(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: not a record list ({what}); rebuild the shard set")
