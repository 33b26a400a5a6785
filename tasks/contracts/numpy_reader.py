"""Shards for PyTorch, JAX and NumPy users: a reader that needs no TensorFlow.

:func:`iter_split` yields ``(uint8 HxWx3 NumPy image, int label)`` in manifest order, the same
images and labels as :func:`tasks.contracts.tf_reader.read_split` with ``training=False``, decoded
by the
same :class:`~tasks.schema.RecordSchema` that wrote them (``RecordSchema.parse``). The TFRecord
framing is read by :mod:`tasks.tfrecord`, every CRC checked.

The shard stage writes an offset index (``offsets.json``: per shard file, each record's
offset in the uncompressed stream, and where the last record ends), so
:func:`read_record` jumps straight to record ``i`` and ``iter_split(..., worker=k,
num_workers=n)`` starts worker ``k`` at its first record: neither scans the shards. GZIP
shards have the same index, but a GZIP stream cannot be entered in the middle: reaching an
offset decompresses everything before it in that shard.

An import-linter contract keeps TensorFlow out of this module's imports.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tasks.contracts.manifest import ShardManifest, load_manifest
from tasks.runtime.atomic import write_text
from tasks.schema import IMAGE_KEY, LABEL_KEY
from tasks.tfrecord import CorruptRecord, open_records, read_framed, record_offsets

OFFSETS_NAME = "offsets.json"
OFFSETS_VERSION = 1
# NVIDIA DALI's TFRecord reader wants an index per file: one "offset size" line per record
# (its tfrecord2idx's format), here `<shard file>.idx` beside the shard. Uncompressed sets
# only: DALI cannot enter a GZIP stream at an offset.
DALI_INDEX_SUFFIX = ".idx"


def offsets_json(
    manifest: ShardManifest,
    shards_dir: str | Path,
    known: dict[str, tuple[list[int], int]] | None = None,
) -> dict[str, Any]:
    """Each shard's record offsets and end, from its record headers only (no data is read).

    ``known`` (file -> offsets, end) are taken as they are: an append passes its base's
    index, checked against the base manifest, so only the new generation's headers are read.
    """
    gzip_compressed = manifest.compression == "gzip"
    known = known or {}
    shards: dict[str, Any] = {}
    for info in manifest.splits.values():
        for shard in info.shards:
            if shard.file in known:
                offsets, end = known[shard.file]
                shards[shard.file] = {"offsets": offsets, "end": end}
                continue
            path = Path(shards_dir) / shard.file
            found = record_offsets(path, gzip_compressed=gzip_compressed)
            if len(found) != shard.num_records:
                raise CorruptRecord(
                    f"{path}: holds {len(found)} records, the manifest says {shard.num_records}"
                )
            end = found[-1][0] + found[-1][1] if found else 0
            shards[shard.file] = {"offsets": [offset for offset, _ in found], "end": end}
    return {"version": OFFSETS_VERSION, "fingerprint": manifest.fingerprint, "shards": shards}


def write_record_index(
    manifest: ShardManifest, shards_dir: str | Path, base: ShardManifest | None = None
) -> None:
    """Write ``offsets.json`` for the manifest's shards (atomic; same shards, same bytes).

    With ``base`` (an append), the base's shards keep the offsets its own index holds when
    that index indexes the base manifest and the shard's entry checks out against it;
    otherwise, or without a base, the shard's headers are read (a cost that grows with the
    base, on every append). Written a shard at a time, the base's index read the same way, so a
    million offsets never sit in memory at once (the bytes ``json.dumps(offsets_json(...),
    sort_keys=True, separators=(",", ":"))`` gives).
    """
    shards_dir = Path(shards_dir)
    gzip_compressed = manifest.compression == "gzip"
    files = sorted(shard.file for info in manifest.splits.values() for shard in info.shards)
    counts = {s.file: s.num_records for info in manifest.splits.values() for s in info.shards}
    base_shards = {s.file: s for info in base.splits.values() for s in info.shards} if base else {}
    known = _base_entries(shards_dir, base)
    pending: tuple[str, Any] | None = None
    path = shards_dir / OFFSETS_NAME
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(f'{{"fingerprint":{json.dumps(manifest.fingerprint)},"shards":{{')
            for n, file in enumerate(files):
                entry = None
                if file in base_shards and base is not None:
                    while pending is None or pending[0] < file:
                        pending = next(known, None) or ("\U0010ffff", None)
                    if pending[0] == file:
                        entry = _checked_entry(pending[1], base_shards[file], base)
                if entry is None:
                    entry = read_entry(shards_dir / file, counts[file], gzip_compressed)
                offsets, end = entry
                if not gzip_compressed:
                    write_dali_index(shards_dir / dali_index_file(file), offsets, end)
                handle.write(
                    f'{"," if n else ""}{json.dumps(file)}:{{"end":{end},"offsets":'
                    f"{json.dumps(offsets, separators=(',', ':'))}}}"
                )
            handle.write(f'}},"version":{OFFSETS_VERSION}}}\n')
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        known.close()
        tmp.unlink(missing_ok=True)


def dali_index_file(shard_file: str) -> str:
    """The DALI index of ``shard_file`` (a path relative to the shard folder)."""
    return shard_file + DALI_INDEX_SUFFIX


def dali_index_files(manifest: ShardManifest) -> set[str]:
    """Every DALI index the shard folder holds for ``manifest`` (none for GZIP shards)."""
    if manifest.compression != "none":
        return set()
    return {dali_index_file(s.file) for info in manifest.splits.values() for s in info.shards}


def dali_index_text(offsets: list[int], end: int) -> str:
    """One ``offset size`` line per record: each record's framed bytes, header to footer
    (none for a shard left without records)."""
    bounds = [*offsets[1:], end] if offsets else []
    return "".join(f"{start} {stop - start}\n" for start, stop in zip(offsets, bounds, strict=True))


def write_dali_index(path: Path, offsets: list[int], end: int) -> None:
    """Write ``path`` unless it already holds this index: a rerun keeps the file it wrote."""
    text = dali_index_text(offsets, end)
    try:
        if path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    write_text(path, text)


def dali_index_problem(shard_path: Path, index_path: Path) -> str | None:
    """What is wrong with ``index_path`` as the DALI index of ``shard_path`` (its lines
    against the shard's own framing), or None."""
    try:
        text = index_path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        return f"DALI index unreadable or missing ({error.__class__.__name__})"
    try:
        framing = record_offsets(shard_path)
    except CorruptRecord as error:  # the records check names the record
        return f"the shard's own framing does not hold ({error})"
    expected = "".join(f"{start} {size}\n" for start, size in framing)
    if text != expected:
        return f"DALI index does not match the shard's {len(framing)} records' framing"
    return None


def read_entry(path: Path, num_records: int, gzip_compressed: bool) -> tuple[list[int], int]:
    """A shard's record offsets and end, from its record headers."""
    found = record_offsets(path, gzip_compressed=gzip_compressed)
    if len(found) != num_records:
        raise CorruptRecord(f"{path}: holds {len(found)} records, the manifest says {num_records}")
    end = found[-1][0] + found[-1][1] if found else 0
    return [offset for offset, _ in found], end


def _checked_entry(value: Any, shard: Any, manifest: ShardManifest) -> tuple[list[int], int] | None:
    """An offset index entry, when it checks out against the manifest's shard; else None."""
    try:
        offsets, end = list(map(int, value["offsets"])), int(value["end"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(offsets) != shard.num_records or (manifest.compression == "none" and end != shard.bytes):
        return None
    return offsets, end


def _base_entries(
    shards_dir: Path, base: ShardManifest | None
) -> Generator[tuple[str, Any], None, None]:
    """(shard file, entry) of the base's ``offsets.json`` in file order, read a piece at a
    time; nothing without a base, or when it is missing, unreadable or indexes another
    shard set."""
    if base is None:
        return
    try:
        with open(shards_dir / OFFSETS_NAME, encoding="utf-8") as handle:
            reader = _JsonPieces(handle)
            reader.expect("{")
            reader.expect('"fingerprint"')
            reader.expect(":")
            if reader.value() != base.fingerprint:
                return
            reader.expect(",")
            reader.expect('"shards"')
            reader.expect(":")
            reader.expect("{")
            first = True
            while not reader.next_is("}"):
                if not first:
                    reader.expect(",")
                first = False
                name = reader.value()
                reader.expect(":")
                yield str(name), reader.value()
    except (OSError, ValueError):
        return


class _JsonPieces:
    """Reads JSON values one at a time from a text stream (whitespace between allowed)."""

    def __init__(self, handle: Any, chunk: int = 1 << 20) -> None:
        self.handle, self.chunk = handle, chunk
        self.buffer, self.at, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def _more(self) -> bool:
        if self.eof:
            return False
        piece = self.handle.read(self.chunk)
        self.eof = not piece
        self.buffer = self.buffer[self.at :] + piece
        self.at = 0
        return bool(piece)

    def _skip_space(self) -> None:
        while True:
            while self.at < len(self.buffer) and self.buffer[self.at] in " \t\r\n":
                self.at += 1
            if self.at < len(self.buffer) or not self._more():
                return

    def next_is(self, text: str) -> bool:
        self._skip_space()
        while len(self.buffer) - self.at < len(text) and self._more():
            pass
        if self.buffer.startswith(text, self.at):
            self.at += len(text)
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.next_is(text):
            raise ValueError(f"expected {text!r}")

    def value(self) -> Any:
        self._skip_space()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.at)
            except ValueError:
                if not self._more():
                    raise
                continue
            if end == len(self.buffer) and self._more():  # a number may go on
                continue
            self.at = end
            return value


def checked_offsets(
    shards_dir: str | Path, manifest: ShardManifest
) -> dict[str, tuple[list[int], int]]:
    """(offsets, end) per shard file from ``offsets.json``, checked against the manifest."""
    path = Path(shards_dir) / OFFSETS_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path}: no offset index for these shards; rerun the shard stage")
    try:
        data = json.loads(path.read_text())
        shards = {
            name: (list(map(int, v["offsets"])), int(v["end"]))
            for name, v in data["shards"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{path}: not an offset index ({error!r}); rerun the shard stage"
        ) from error
    if data.get("fingerprint") != manifest.fingerprint:
        raise ValueError(
            f"{path}: indexes shard set {data.get('fingerprint')}, the manifest is "
            f"{manifest.fingerprint} (stale index); rerun the shard stage"
        )
    offsets = {}
    for info in manifest.splits.values():
        for shard in info.shards:
            found, end = shards.get(shard.file, ([], -1))
            if len(found) != shard.num_records or (
                manifest.compression == "none" and end != shard.bytes
            ):
                raise ValueError(
                    f"{path}: indexes {len(found)} records ending at byte {end} for "
                    f"{shard.file}; the manifest has {shard.num_records} records in "
                    f"{shard.bytes} bytes (stale index); rerun the shard stage"
                )
            offsets[shard.file] = (found, end)
    return offsets


class SplitReader:
    """One split's records by position (manifest order), through the offset index."""

    def __init__(
        self, shards_dir: str | Path, split: str, *, manifest: ShardManifest | None = None
    ) -> None:
        self.shards_dir = Path(shards_dir)
        self.manifest = manifest or load_manifest(self.shards_dir)
        self.schema = self.manifest.record_schema
        self.gzip = self.manifest.compression == "gzip"
        self.shards = self.manifest.split(split).shards
        by_file = checked_offsets(self.shards_dir, self.manifest)
        self.offsets = [by_file[shard.file][0] for shard in self.shards]
        self.ends = [by_file[shard.file][1] for shard in self.shards]
        self.starts = [0]  # position of each shard's first record within the split
        for shard in self.shards:
            self.starts.append(self.starts[-1] + shard.num_records)

    def __len__(self) -> int:
        return self.starts[-1]

    def features(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """Parsed records ``start`` to ``stop`` (exclusive): each shard opened once, one seek.

        Each record must end where the index says the next begins (or the shard ends): an
        offset that lands on another record's boundary passes every CRC, so this is what
        catches an edited or stale ``offsets.json`` before a wrong record is returned."""
        stop = len(self) if stop is None else min(stop, len(self))
        position = start
        while position < stop:
            number = bisect.bisect_right(self.starts, position) - 1
            shard = self.shards[number]
            path = self.shards_dir / shard.file
            with open_records(path, gzip_compressed=self.gzip) as handle:
                offsets = self.offsets[number]
                handle.seek(offsets[position - self.starts[number]])
                while position < min(stop, self.starts[number + 1]):
                    record = position - self.starts[number]
                    features = self._parse(handle, path, record)
                    boundary = (
                        offsets[record + 1] if record + 1 < len(offsets) else self.ends[number]
                    )
                    if handle.tell() != boundary:
                        raise CorruptRecord(
                            f"{path}: record {record} ends at byte {handle.tell()}, where "
                            f"{OFFSETS_NAME} puts the next at {boundary} (an edited or stale "
                            "index); rerun the shard stage"
                        )
                    yield features
                    position += 1

    def __getitem__(self, position: int) -> dict[str, Any]:
        if not 0 <= position < len(self):
            raise IndexError(f"record {position} out of range (split has {len(self)})")
        return next(self.features(position, position + 1))

    def _parse(self, handle: Any, path: Path, record: int) -> dict[str, Any]:
        try:
            data = read_framed(handle)
            if data is None:
                raise CorruptRecord("file ends before the manifest's last record")
            return self.schema.parse(data)
        except (ValueError, OSError) as error:  # framing, schema or image decoding
            raise CorruptRecord(f"{path}: record {record}: {error}") from error


def worker_range(total: int, worker: int, num_workers: int) -> tuple[int, int]:
    """The contiguous slice of ``total`` records that worker ``worker`` of ``num_workers`` reads.

    Cut like the shard plan (``i * n // k``), so slices differ in size by at most one and
    together cover every record exactly once.
    """
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} of {num_workers}: need 0 <= worker < num_workers")
    return worker * total // num_workers, (worker + 1) * total // num_workers


def iter_split(
    shards_dir: str | Path,
    split: str,
    *,
    worker: int = 0,
    num_workers: int = 1,
    manifest: ShardManifest | None = None,
) -> Iterator[tuple[np.ndarray, int]]:
    """``(image uint8 [H, W, 3], label)`` of one split in manifest order, without TensorFlow.

    With ``num_workers`` > 1, worker ``worker`` yields only its contiguous share of the split
    (see :func:`worker_range`), starting by a seek, so data-loader workers never overlap.
    """
    reader = SplitReader(shards_dir, split, manifest=manifest)
    start, stop = worker_range(len(reader), worker, num_workers)
    for features in reader.features(start, stop):
        yield features[IMAGE_KEY], features[LABEL_KEY]


def read_record(
    shards_dir: str | Path, split: str, position: int, *, manifest: ShardManifest | None = None
) -> tuple[np.ndarray, int]:
    """Record ``position`` of a split (manifest order) by a seek; use a SplitReader for many."""
    features = SplitReader(shards_dir, split, manifest=manifest)[position]
    return features[IMAGE_KEY], features[LABEL_KEY]
