"""Which shard set holds which image: the membership the shard stage records with each set.

``membership.bin`` sits in the shard folder beside ``offsets.json`` and, like it, outside the
fingerprint (the manifest names what the set holds; this file answers where a record is,
without re-reading a record list). Format: one JSON header line (``version``,
``fingerprint``, ``files``: the shard files, ``count``), then ``count`` fixed-size entries
sorted by content hash: the raw sha256 (32 bytes), the split (1 byte, an index into
:data:`tasks.contracts.content.SPLITS`), the generation (2 bytes), the shard file (4 bytes, an index
into ``files``) and the record's index in that file (4 bytes), big-endian. A lookup is a
binary search over a memory map: a million images answer in microseconds, and the file
(43 bytes an image) is read only where the search lands.

Each set's membership is also kept by fingerprint under ``.shardflow/membership/`` (a copy
of the same bytes), so ``shardflow lineage`` can say which of the sets training runs recorded
held an image after the shard folder has moved on. ``shardflow forget`` keeps these copies,
rewritten without the forgotten hashes (:func:`remove_from_membership`): lineage and later
erasures still find every run's set.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.contracts.content import SPLITS
from tasks.contracts.manifest import MEMBERSHIP_NAME, ShardManifest, stream_records

MEMBERSHIP_VERSION = 1
ENTRY = struct.Struct(">32sBHII")  # sha256, split, generation, shard file, record index


@dataclass(frozen=True)
class Member:
    """Where one record of a shard set is."""

    sha256: str
    split: str
    generation: int
    shard_file: str
    record_index: int


def membership_entries(shards_dir: Path, manifest: ShardManifest) -> list[bytes]:
    """Every record's packed entry, sorted by content hash (from the set's record lists)."""
    files = sorted(s.file for info in manifest.splits.values() for s in info.shards)
    file_index = {file: n for n, file in enumerate(files)}
    split_of = {s.file: split for split, info in manifest.splits.items() for s in info.shards}
    generation_of = {file: g.number for g in manifest.generations for file in g.shards}
    entries, position = [], dict.fromkeys(files, 0)
    for file, record in stream_records(shards_dir, manifest):
        entries.append(
            ENTRY.pack(
                bytes.fromhex(record["sha256"]),
                SPLITS.index(split_of[file]),
                generation_of[file],
                file_index[file],
                position[file],
            )
        )
        position[file] += 1
    entries.sort()
    return entries


def write_membership(manifest: ShardManifest, shards_dir: Path) -> Path:
    """Write ``membership.bin`` for the set in ``shards_dir`` (atomic; same set, same bytes)."""
    shards_dir = Path(shards_dir)
    files = sorted(s.file for info in manifest.splits.values() for s in info.shards)
    entries = b"".join(membership_entries(shards_dir, manifest))
    path = shards_dir / MEMBERSHIP_NAME
    write_membership_file(path, manifest.fingerprint, files, entries)
    return path


def write_membership_file(path: Path, fingerprint: str, files: list[str], entries: bytes) -> None:
    """A membership file of ``entries`` (packed, sorted by hash) naming ``files``."""
    header = {
        "version": MEMBERSHIP_VERSION,
        "fingerprint": fingerprint,
        "files": files,
        "count": len(entries) // ENTRY.size,
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n")
            handle.write(entries)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def archive_membership(shards_dir: Path, archive_dir: Path, fingerprint: str) -> None:
    """Keep a copy of the set's membership under its fingerprint (written once, by rename)."""
    target = Path(archive_dir) / f"{fingerprint}.bin"
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(Path(shards_dir) / MEMBERSHIP_NAME, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


class Membership:
    """A membership file opened for lookups (a context manager: the map is closed on exit)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            line = handle.readline()
            try:
                header = json.loads(line)
            except ValueError:
                header = None
            if not isinstance(header, dict) or header.get("version") != MEMBERSHIP_VERSION:
                raise ValueError(
                    f"{self.path}: not a membership file of version {MEMBERSHIP_VERSION}; "
                    "rerun the shard stage (`shardflow run`) to write it"
                )
            self.fingerprint: str = header["fingerprint"]
            self.files: list[str] = header["files"]
            self.count: int = int(header["count"])
            self.start = len(line)
            size = os.fstat(handle.fileno()).st_size
            if size != self.start + self.count * ENTRY.size:
                raise ValueError(f"{self.path}: {size} bytes, its header says otherwise")
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.map is not None:
            self.map.close()

    def _key(self, n: int) -> bytes:
        assert self.map is not None
        at = self.start + n * ENTRY.size
        return self.map[at : at + 32]

    def find(self, sha256: str) -> list[Member]:
        """Every record of the set with this content hash (none, or one: ingest keeps one
        file of each content)."""
        if self.map is None or not self.count:
            return []
        key = bytes.fromhex(sha256)
        low, high = 0, self.count
        while low < high:  # the first entry whose hash is not below key
            middle = (low + high) // 2
            if self._key(middle) < key:
                low = middle + 1
            else:
                high = middle
        found = []
        while low < self.count and self._key(low) == key:
            at = self.start + low * ENTRY.size
            _, split, generation, file, index = ENTRY.unpack(self.map[at : at + ENTRY.size])
            found.append(Member(sha256, SPLITS[split], generation, self.files[file], index))
            low += 1
        return found

    def hashes(self) -> Iterator[str]:
        """Every content hash of the set, in hash order."""
        for n in range(self.count):
            yield self._key(n).hex()


def remove_from_membership(path: Path, hashes: set[str] | frozenset[str]) -> bool:
    """Rewrite a membership file without the entries of ``hashes`` (its fingerprint and
    files kept: it still says which set a run used, and where every other record was);
    whether it changed. Atomic, and a no-op once done."""
    with Membership(path) as membership:
        size, start = ENTRY.size, membership.start
        data = membership.map[start:] if membership.map is not None else b""
        fingerprint, files = membership.fingerprint, membership.files
    entries = [data[n * size : (n + 1) * size] for n in range(len(data) // size)]
    kept = [entry for entry in entries if entry[:32].hex() not in hashes]
    if len(kept) == len(entries):
        return False
    write_membership_file(Path(path), fingerprint, files, b"".join(kept))
    return True


def find_in(paths: Iterable[Path], sha256: str) -> dict[str, list[Member]]:
    """Fingerprint -> the records with ``sha256``, over the membership files at ``paths``
    (those that hold it only)."""
    held: dict[str, list[Member]] = {}
    for path in paths:
        with Membership(path) as membership:
            found = membership.find(sha256)
        if found:
            held[membership.fingerprint] = found
    return held
