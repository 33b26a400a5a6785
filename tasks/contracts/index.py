"""The ingest index: the contract between ingest (its writer) and shard (its reader).

A module of its own so the shard stage depends on the index format, not on ingest's code:
editing how ingest checks or reports files never reshards.

Format (version 3): JSON Lines, so a reader never holds the whole index. Line 1 is the
header (``version``, ``source_dir``, ``classes``, ``verdict_key``, ``num_records``,
``num_verdicts``, and ``placement``: the rule the splits were placed under); then
``num_records`` lines, one accepted record each (``path``, ``label``, ``label_index``,
``sha256``, ``split``, ``format``, ``width``, ``height``, ``phash`` and ``thumb``: the
perceptual hash that finds near-duplicate candidates and the thumbnail that confirms them);
then ``num_verdicts`` lines, one decode verdict each (``[path, sha256, format, width, height,
reason, phash, thumb]``) that the next incremental ingest reuses. An index written before
``thumb`` existed lacks it (and its ``placement`` lacks ``confirmation``): ingest decodes and
places every image afresh and validation names the rerun. The shard planner streams the records
and remembers only each one's byte offset, so planning a million images stays small.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from pathlib import Path
from typing import IO, Any

INDEX_VERSION = 3
HEADER_KEYS = ("version", "source_dir", "classes", "verdict_key", "num_records", "num_verdicts")
# Lines read or written a chunk at a time: one JSON parse (as an array) or one write a chunk
# costs far less than one a line, and memory stays a chunk's worth.
CHUNK_LINES = 1024


def write_index(index_path: Path, index: dict[str, Any]) -> str:
    """Write ``index`` (header fields, ``records``, ``verdicts``) atomically, line by line;
    return the sha256 of the bytes written (ingest binds its stat signatures to it without
    reading the file back).

    Same data, same bytes (sorted keys): the index is a DVC output whose hash decides
    whether the shard stage reruns.
    """
    records: list[dict[str, Any]] = index["records"]
    verdicts: dict[str, list[Any]] = index.get("verdicts") or {}
    header = {
        "version": INDEX_VERSION,
        "source_dir": index["source_dir"],
        "classes": index["classes"],
        "verdict_key": index.get("verdict_key"),
        "num_records": len(records),
        "num_verdicts": len(verdicts),
        "placement": index.get("placement"),
    }
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_path.with_name(f".{index_path.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    values = chain([header], records, ([path, *v] for path, v in sorted(verdicts.items())))
    try:
        with open(tmp, "wb") as handle:
            while chunk := list(islice(values, CHUNK_LINES)):
                data = "".join(map(_line, chunk)).encode()
                digest.update(data)
                handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, index_path)
    finally:
        tmp.unlink(missing_ok=True)
    return digest.hexdigest()


# One encoder for every line. ``json.dumps`` with options builds a new encoder per call, and
# ``JSONEncoder.encode`` a new C encoder per call: either would be a large share of the
# write. The lines hold plain acyclic values, so no circular-reference check is needed.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)
# json's C encoder, built once with the options above: (markers: no circular check,
# default, string encoder, indent, key separator, item separator, sort_keys, skipkeys,
# allow_nan); None where Python was built without it.
_C_ENCODE = (
    json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        *(None, _ENCODER.default, json.encoder.encode_basestring_ascii, None),
        *(":", ",", True, False, True),
    )
    if json.encoder.c_make_encoder is not None  # type: ignore[attr-defined]
    else None
)


def _line(value: Any) -> str:
    """One index line: ``json.dumps(value, sort_keys=True, separators=(",", ":"))``."""
    if _C_ENCODE is None:
        return _ENCODER.encode(value) + "\n"
    return "".join(_C_ENCODE(value, 0)) + "\n"


def read_header(index_path: Path) -> dict[str, Any]:
    """The index's header line; a missing file or another format raises and names the fix."""
    with _open(index_path) as handle:
        return _header(index_path, handle)


def _open(index_path: Path) -> IO[bytes]:
    if not index_path.exists():
        raise FileNotFoundError(f"{index_path}: no ingest index; run the ingest stage first")
    return open(index_path, "rb")


def _header(index_path: Path, handle: IO[bytes]) -> dict[str, Any]:
    first = handle.readline()
    try:
        header = json.loads(first)
    except ValueError:
        header = None
    version = header.get("version") if isinstance(header, dict) else None
    if version != INDEX_VERSION or not all(k in header for k in HEADER_KEYS):  # type: ignore[operator]
        raise ValueError(
            f"{index_path}: not an ingest index of version {INDEX_VERSION} (found "
            f"{'version ' + str(version) if version is not None else 'another format'}); "
            "rerun the ingest stage"
        )
    assert isinstance(header, dict)
    return header


def iter_records(index_path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(byte offset, record) of every accepted record, in index order, a chunk at a time."""
    with _open(index_path) as handle:
        header = _header(index_path, handle)
        total = int(header["num_records"])
        offset = handle.tell()
        for start in range(0, total, CHUNK_LINES):
            lines = [handle.readline() for _ in range(min(CHUNK_LINES, total - start))]
            if not lines[-1].endswith(b"\n"):
                ended = start + sum(1 for line in lines if line.endswith(b"\n"))
                raise ValueError(
                    f"{index_path}: {total} records announced, file ends at record {ended}; "
                    "rerun the ingest stage"
                )
            for line, record in zip(lines, _records(index_path, lines, offset), strict=True):
                yield offset, record
                offset += len(line)


def _records(index_path: Path, lines: list[bytes], offset: int) -> list[dict[str, Any]]:
    """The records of consecutive ``lines`` starting at byte ``offset``; a bad one is named."""
    try:
        records = json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError:
        records = None
    if (
        not isinstance(records, list)
        or len(records) != len(lines)
        or not all(isinstance(r, dict) for r in records)
    ):  # find the culprit line by line, for its byte offset
        records = []
        for line in lines:
            records.append(_record(index_path, line, offset))
            offset += len(line)
    return records


def read_records_at(index_path: Path, offsets: Iterable[int]) -> Iterator[dict[str, Any]]:
    """The records at ``offsets`` (from :func:`iter_records`), in the order given."""
    with _open(index_path) as handle:
        for offset in offsets:
            handle.seek(int(offset))
            yield _record(index_path, handle.readline(), int(offset))


def _record(index_path: Path, line: bytes, offset: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{index_path}, byte {offset}: not a JSON record ({error})") from error
    if not isinstance(record, dict):
        raise ValueError(f"{index_path}, byte {offset}: a record must be a JSON object")
    return record


def iter_verdicts(index_path: Path) -> Iterator[tuple[str, list[Any]]]:
    """(path, [sha256, format, width, height, reason, phash]) of every file ingest read.

    The verdict lines are parsed as one JSON array: one parser call instead of one a line.
    Their caller keeps them all anyway. (``phash`` is last,
    in verdicts written since near-duplicate placement.)
    """
    with _open(index_path) as handle:
        header = _header(index_path, handle)
        for _ in range(int(header["num_records"])):
            handle.readline()
        lines = [handle.readline() for _ in range(int(header["num_verdicts"]))]
    for path, *verdict in json.loads(b"[" + b",".join(lines) + b"]"):
        yield path, verdict


def load_index(index_path: Path) -> dict[str, Any]:
    """The whole index as one dict (header fields, ``records``, ``verdicts``).

    For readers that want every record at once (validation, tests); the shard stage
    streams with :func:`iter_records` instead.
    """
    header = read_header(index_path)
    return {
        **{k: header[k] for k in ("version", "source_dir", "classes", "verdict_key")},
        "placement": header.get("placement"),
        "records": [record for _, record in iter_records(index_path)],
        "verdicts": dict(iter_verdicts(index_path)),
    }
