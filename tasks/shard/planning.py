"""Planning: the index scanned once, records ordered by seeded order keys, cut into shards.

The plan is a pure function of the ingest index and :class:`ShardParams`: each split's records
are ordered by a seeded hash of their content and cut into contiguous shards, so the same
inputs and params give byte-identical shards and ``manifest.json`` whatever the number of
workers. Each shard is an independent work unit (:class:`ShardSpec` ->
:func:`tasks.shard.writing.write_shard`).

Memory: the index is read as a stream (JSON Lines, :mod:`tasks.contracts.index`); the plan keeps 8
bytes a record (order key prefix + byte offset into the index, :class:`ShardPlan`) and reads
a shard's records back only when that shard is dispatched, hashed or listed, so planning a
million images costs about what planning ten thousand does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, overload

import numpy as np

from tasks.contracts import shard_changes as data_diff
from tasks.contracts.index import iter_records, read_header, read_records_at
from tasks.contracts.manifest import SPLITS, ShardManifest
from tasks.images import preprocessing_version
from tasks.runtime.params import ShardParams
from tasks.shard.spec import ShardRecord, ShardSpec, preprocess, schema_from_params

PLAN_VERSION = 2


SIZE_SAMPLE = 32  # records encoded to estimate the size of a JPEG/PNG record


RECORD_OVERHEAD = 16 + 120  # TFRecord framing (length + 2 CRCs) + Example keys, label, hash

# An append's packed order keys wait on disk this many at a time (32 KiB), until the pass
# ends and tells which records are new (see scan_index).
PENDING_CHUNK = 1 << 12


def order_digest(seed: int, content_hash: str) -> bytes:
    """Seeded hash that fixes a record's position within its split."""
    return hashlib.sha256(f"{seed}:{content_hash}".encode()).digest()


def order_key(seed: int, content_hash: str) -> str:
    """:func:`order_digest` as hex (the same order: hex and bytes sort alike)."""
    return order_digest(seed, content_hash).hex()


def shard_name(split: str, index: int, num_shards: int) -> str:
    """TFDS-style file name, e.g. ``train.tfrecord-00000-of-00008``."""
    return f"{split}.tfrecord-{index:05d}-of-{num_shards:05d}"


@dataclass(frozen=True)
class IndexScan:
    """One streamed pass over the index: each split's records in shard order, compactly.

    ``order[split]`` packs, per record, the top bits of its seeded order key above its byte
    offset in the index (see :func:`pack_bits`): 8 bytes a record, sorted. Nothing else about
    a record stays in memory; :class:`ShardPlan` reads a shard's records back when needed.
    """

    order: dict[str, np.ndarray]
    offset_bits: int
    records: int  # every record of the index (excluded ones too)
    mean_path_bytes: float
    sample: tuple[ShardRecord, ...]  # the SIZE_SAMPLE first records in order key, all splits


def pack_bits(index_bytes: int) -> int:
    """Bits an offset into an index of ``index_bytes`` needs; the rest hold the order key."""
    bits = max(1, int(index_bytes).bit_length())
    if bits > 48:
        raise ValueError(f"index of {index_bytes} bytes: too large to plan (over 256 TiB)")
    return bits


def scan_index(
    params: ShardParams,
    index_path: Path,
    *,
    classes: list[str] | None = None,
    exclude: Callable[[], np.ndarray] | None = None,
    sample: bool = False,
    offset_bits: int | None = None,
    visit: Callable[[dict[str, Any]], None] | None = None,
    spill_dir: Path | None = None,
) -> IndexScan:
    """Stream the index once: each split's records in seeded-hash order (ties by path).

    ``exclude`` (append), called once the pass ends, gives a mask over the index's records
    (in index order) of those to leave out: the base's, found by ``visit``'s table; each
    record's split is kept (1 byte) until then, which places the mask on each split's
    records (appended in index order). ``classes`` (append) must name every record's
    label. ``sample`` keeps the :data:`SIZE_SAMPLE` records with the smallest order keys
    (for the size estimate). ``visit`` sees every record (excluded ones too) as it streams.

    With ``exclude``, each record's packed order key waits in a temporary file in
    ``spill_dir`` (the stage passes the shard folder; by default the index's: nothing is
    written outside the repository; unlinked from the start, so a killed run leaves
    nothing), not in memory, until the mask is known: an append leaves out nearly every
    record, and those 8 bytes a record would be its largest growth with the data.
    """
    bits = pack_bits(index_path.stat().st_size) if offset_bits is None else offset_bits
    packed = {s: array("Q") for s in SPLITS}
    figures = ScanFigures(sample)
    with contextlib.ExitStack() as stack:
        pending = (
            PendingKeys(
                stack.enter_context(tempfile.TemporaryFile(dir=spill_dir or index_path.parent))
            )
            if exclude is not None
            else None
        )
        for offset, rec in iter_records(index_path):
            _refuse_unknown(index_path, rec, classes)
            if visit is not None:
                visit(rec)
            digest = order_digest(params.seed, rec["sha256"])
            figures.add(rec, digest)
            value = ((int.from_bytes(digest[:8], "big") >> bits) << bits) | offset
            if pending is None:
                packed[rec["split"]].append(value)
            else:
                pending.add(value, rec["split"])
        if pending is not None and exclude is not None:
            pending.take(exclude(), packed)
    order = {s: _sorted_split(index_path, params.seed, v, bits) for s, v in packed.items()}
    return IndexScan(
        order=order,
        offset_bits=bits,
        records=figures.count,
        mean_path_bytes=figures.path_bytes / figures.count if figures.count else 0.0,
        sample=tuple(r for *_, r in sorted(figures.first)[:SIZE_SAMPLE]),
    )


def _refuse_unknown(index_path: Path, rec: dict[str, Any], classes: list[str] | None) -> None:
    """A record whose split is none of :data:`SPLITS`, or whose label is not in ``classes``
    (when given), names itself: the index was edited or comes from elsewhere."""
    if rec["split"] not in SPLITS:
        raise ValueError(f"{index_path}: record {rec['path']}: unknown split {rec['split']!r}")
    if classes is not None and rec["label"] not in classes:
        raise ValueError(f"{index_path}: record {rec['path']}: unknown class {rec['label']!r}")


@dataclass
class ScanFigures:
    """What a scan counts as records stream past: how many, their path bytes, and (with
    ``sample``) those with the smallest order keys, cut back to :data:`SIZE_SAMPLE` once
    four times that wait: the sample never grows with the index."""

    sample: bool
    count: int = 0
    path_bytes: int = 0
    first: list[tuple[str, int, ShardRecord]] = field(default_factory=list)

    def add(self, rec: dict[str, Any], digest: bytes) -> None:
        self.count += 1
        self.path_bytes += len(rec["path"].encode())
        if self.sample:
            self.first.append((digest.hex(), self.count, shard_record(rec, None)))
            if len(self.first) >= 4 * SIZE_SAMPLE:
                self.first = sorted(self.first)[:SIZE_SAMPLE]


class PendingKeys:
    """Packed order keys waiting in an unlinked temporary file, written a chunk at a time,
    until the append's exclusion mask is known; each key's split waits beside it (1 byte)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.waiting = array("Q")
        self.split_codes = bytearray()

    def add(self, value: int, split: str) -> None:
        self.split_codes.append(SPLITS.index(split))
        self.waiting.append(value)
        if len(self.waiting) >= PENDING_CHUNK:
            self.file.write(self.waiting.tobytes())
            del self.waiting[:]

    def take(self, leave_out: np.ndarray, packed: dict[str, array[int]]) -> None:
        """Append to ``packed`` each waiting key but those ``leave_out`` masks."""
        self.file.write(self.waiting.tobytes())
        del self.waiting[:]
        codes = np.frombuffer(self.split_codes, dtype=np.uint8)
        _take_pending(self.file, leave_out, codes, packed)


def _take_pending(
    pending: IO[bytes], leave_out: np.ndarray, codes: np.ndarray, packed: dict[str, array[int]]
) -> None:
    """Read ``pending``'s packed order keys back (index order), a chunk at a time, and
    append to each split's array those ``leave_out`` does not mark; ``codes`` holds each
    record's split (its position in :data:`SPLITS`)."""
    pending.seek(0)
    start = 0
    while chunk := pending.read(8 * PENDING_CHUNK):
        values = np.frombuffer(chunk, dtype=np.uint64)
        end = start + len(values)
        keep, split_of = ~leave_out[start:end], codes[start:end]
        for code, split in enumerate(SPLITS):
            packed[split].frombytes(values[keep & (split_of == code)].tobytes())
        start = end
    if start != len(codes):
        raise ValueError(f"the append's order keys: {start} read back, {len(codes)} scanned")


def _sorted_split(index_path: Path, seed: int, values: array[int], bits: int) -> np.ndarray:
    """Sort packed (key prefix, offset) values in place; equal prefixes by full key, path."""
    order = np.frombuffer(values, dtype=np.uint64) if len(values) else np.zeros(0, np.uint64)
    order.sort()
    mask = np.uint64((1 << bits) - 1)
    step = 1 << 16  # tie search in chunks: no second full-size array
    start = 0
    while start < len(order) - 1:
        top = order[start : start + step + 1] >> np.uint64(bits)
        for i in np.flatnonzero(top[1:] == top[:-1]):
            _break_tie(index_path, seed, order, start + int(i), bits, mask)
        start += step
    return order


def _break_tie(
    index_path: Path, seed: int, order: np.ndarray, at: int, bits: int, mask: np.uint64
) -> None:
    """Order the run of equal key prefixes starting at or before ``at`` exactly."""
    top = int(order[at]) >> bits
    lo = at
    while lo > 0 and int(order[lo - 1]) >> bits == top:
        lo -= 1
    hi = at + 1
    while hi < len(order) and int(order[hi]) >> bits == top:
        hi += 1
    run = [int(v) for v in order[lo:hi]]
    records = read_records_at(index_path, (v & int(mask) for v in run))
    keyed = sorted(
        (order_key(seed, r["sha256"]), r["path"], v) for r, v in zip(records, run, strict=True)
    )
    order[lo:hi] = np.array([v for *_, v in keyed], dtype=np.uint64)


def shard_record(rec: dict[str, Any], classes: list[str] | tuple[str, ...] | None) -> ShardRecord:
    label = int(rec["label_index"]) if classes is None else classes.index(rec["label"])
    return ShardRecord(rec["path"], label, rec["sha256"])


def estimate_record_bytes(params: ShardParams, scan: IndexScan, source_dir: str) -> float:
    """Estimated serialized size of one record: exact image size for raw, sampled otherwise."""
    schema = schema_from_params(params)
    overhead = RECORD_OVERHEAD + scan.mean_path_bytes
    if schema.encoding == "raw":
        return schema.height * schema.width * schema.channels + overhead
    sizes = [
        len(preprocess(source_dir, r, schema, params.resize, params.draft_decode))
        for r in scan.sample
    ]
    return (sum(sizes) / len(sizes) if sizes else 0) + overhead


@dataclass(frozen=True)
class ShardSlot:
    """One planned shard before its records are read: their packed offsets, in order."""

    split: str
    index: int
    num_shards: int
    file: str
    packed: np.ndarray  # a view into IndexScan.order[split]

    @property
    def num_records(self) -> int:
        return len(self.packed)


class ShardPlan(Sequence[ShardSpec]):
    """The shard specs of a run, compact: a spec and its records exist only while used.

    Indexing or iterating reads a shard's records back from the index by offset, so a
    plan of a million records costs 8 bytes a record, not a million objects.
    """

    def __init__(
        self,
        index_path: Path,
        slots: list[ShardSlot],
        offset_bits: int,
        common: dict[str, Any],
        classes: list[str] | None,
    ) -> None:
        self.index_path = Path(index_path)
        self.slots = slots
        self.mask = (1 << offset_bits) - 1
        self.common = common  # ShardSpec fields shared by every shard
        self.classes = classes

    def __len__(self) -> int:
        return len(self.slots)

    @overload
    def __getitem__(self, i: int) -> ShardSpec: ...
    @overload
    def __getitem__(self, i: slice) -> ShardPlan: ...
    def __getitem__(self, i: int | slice) -> ShardSpec | ShardPlan:
        if isinstance(i, slice):
            return self.subset(range(len(self.slots))[i])
        slot = self.slots[i]
        records = tuple(shard_record(r, self.classes) for r in self.index_records(slot))
        return ShardSpec(
            split=slot.split,
            index=slot.index,
            num_shards=slot.num_shards,
            file=slot.file,
            records=records,
            **self.common,
        )

    def index_records(self, slot: ShardSlot) -> Iterator[dict[str, Any]]:
        """The index records of one shard, in shard order (all their fields)."""
        return read_records_at(self.index_path, (int(v) & self.mask for v in slot.packed))

    def subset(self, positions: Iterable[int]) -> ShardPlan:
        """The plan of only the shards at ``positions``."""
        slots = [self.slots[i] for i in positions]
        return ShardPlan(self.index_path, slots, self.mask.bit_length(), self.common, self.classes)

    @property
    def files(self) -> list[str]:
        return [slot.file for slot in self.slots]


def plan_shards(params: ShardParams, index_path: Path) -> ShardPlan:
    """Cut each split into contiguous shards of about ``target_shard_mb``; deterministic.

    The target is MiB of uncompressed records (GZIP shards come out smaller); every
    non-empty split gets at least one shard, and no shard is empty.
    """
    index_path = Path(index_path)
    header = read_header(index_path)
    scan = scan_index(params, index_path, sample=params.encoding != "raw")
    return cut_shards(params, index_path, header, scan, folder="", classes=None)


def cut_shards(
    params: ShardParams,
    index_path: Path,
    header: dict[str, Any],
    scan: IndexScan,
    *,
    folder: str,
    classes: list[str] | None,
    handoff: str | None = None,
) -> ShardPlan:
    """Cut ordered records into shard slots whose files live under ``folder`` (a generation);
    ``handoff``: where the writers find ingest's kept decodes (:mod:`tasks.contracts.handoff`)."""
    source_dir = str(header["source_dir"])
    common = {
        "source_dir": source_dir,
        "schema": schema_from_params(params).to_dict(),
        "resize": params.resize,
        "compression": params.compression,
        "preprocessing_version": preprocessing_version(),
        "draft": params.draft_decode,
        "handoff": handoff,
    }
    per_shard = params.target_shard_mb * (1 << 20)
    record_bytes = estimate_record_bytes(params, scan, source_dir) if scan.records else 1.0
    slots = []
    for split, order in scan.order.items():
        n = len(order)
        if not n:
            continue
        num_shards = min(n, max(1, math.ceil(n * record_bytes / per_shard)))
        for i in range(num_shards):
            slots.append(
                ShardSlot(
                    split=split,
                    index=i,
                    num_shards=num_shards,
                    file=folder + shard_name(split, i, num_shards),
                    packed=order[i * n // num_shards : (i + 1) * n // num_shards],
                )
            )
    return ShardPlan(index_path, slots, scan.offset_bits, common, classes)


WHERE_FROM = ("source_dir", "handoff")  # ShardSpec fields that never decide a shard's bytes


def plan_hash(specs: Iterable[ShardSpec]) -> str:
    """sha256 of everything that decides shard bytes (not source_dir or the hand-off folder:
    bytes don't depend on where the images or ingest's kept decodes are read from)."""
    # Streamed spec by spec: a large plan never exists as one JSON string, nor as all its specs.
    digest = hashlib.sha256(f"shard-plan-v{PLAN_VERSION}".encode())
    for spec in specs:
        # asdict(spec) without those two, minus asdict's deep copies (same JSON, faster)
        body = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in WHERE_FROM}
        body["records"] = [vars(r) for r in spec.records]
        digest.update(json.dumps(body, sort_keys=True).encode())
    return digest.hexdigest()


@dataclass
class StagePlan:
    """What one run of the shard stage writes, and what it builds on."""

    mode: str
    number: int  # the generation this run writes
    specs: ShardPlan
    classes: list[str]  # the new manifest's classes: the base's first, new ones appended
    index_path: Path  # the ingest index the plan reads records (and their sizes) from
    base: ShardManifest | None  # append: the manifest appended to
    previous: ShardManifest | None  # the manifest found before this run: the diff's "before"
    previous_records: data_diff.SpilledTable | None  # its records (None: unreadable)
    # append: base images now in the index under another name (the diff's duplicates)
    duplicates: list[dict[str, str]] = field(default_factory=list)
