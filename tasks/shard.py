"""Shard stage: preprocess every indexed image once and write TFRecord shards plus a manifest.

The plan is a pure function of the ingest index and :class:`ShardParams`: each split's records
are ordered by a seeded hash of their content and cut into contiguous shards, so the same
inputs and params give byte-identical shards and ``manifest.json`` whatever the number of
workers. Each shard is an independent work unit (:class:`ShardSpec` -> :func:`write_shard`);
:func:`shard_stage` is the one orchestration (plan, prepare, write, finalize), and the flow in
``flows/shard.py`` hands it a writer that runs each shard on its Prefect task runner.

Memory: the index is read as a stream (JSON Lines, :mod:`tasks.index`); the plan keeps 8
bytes a record (order key prefix + byte offset into the index, :class:`ShardPlan`) and reads
a shard's records back only when that shard is dispatched, hashed or listed, so planning a
million images costs about what planning ten thousand does.

Preprocessing: :func:`tasks.images.preprocess_bytes` (decode, EXIF, RGB, resize policy: the
code prediction reuses), then the record schema's encoder. Its version
(:func:`tasks.images.preprocessing_version`) is part of every spec, so the plan hash, and with
it every shard, follows the code and the pixel libraries; a worker whose version differs from
the plan's refuses to write.

Crash safety: a shard is written to ``.{name}.tmp-{pid}``, fsynced and renamed; a plan file
(``.plan.json``) lets a rerun of the same plan keep finished shards; ``manifest.json`` is
written last, so a killed run never looks complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, overload

import numpy as np

from tasks import data_diff
from tasks.atomic import write_json, write_text
from tasks.heap import paused_gc
from tasks.images import preprocess_bytes, preprocessing_version
from tasks.index import iter_records, read_header, read_records_at
from tasks.manifest import (
    MANIFEST_NAME,
    PLAN_NAME,
    SPLITS,
    Generation,
    ShardFile,
    ShardManifest,
    SplitInfo,
    build_manifest,
    file_sha256,
    generation_folder,
    load_manifest,
    records_file_name,
    stream_records,
)
from tasks.params import ShardParams
from tasks.pool import prestart_pool
from tasks.records import write_record_index
from tasks.schema import RecordSchema
from tasks.tfds_metadata import write_tfds_metadata
from tasks.tfrecord import TFRecordWriter

PLAN_VERSION = 2
SIZE_SAMPLE = 32  # records encoded to estimate the size of a JPEG/PNG record
RECORD_OVERHEAD = 16 + 120  # TFRecord framing (length + 2 CRCs) + Example keys, label, hash


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


# -- preprocessing ---------------------------------------------------------------------------


def preprocess(
    source_dir: str, record: ShardRecord, schema: RecordSchema, policy: str, draft: bool
) -> bytes:
    """Read, check, decode, resize and encode one source image; returns the image feature."""
    path = Path(source_dir) / record.path
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise ValueError(f"{path}: content changed since ingest (sha256 differs); rerun ingest")
    # Ingest already enforced the size limits; the same preprocessing, limits off.
    size = (schema.height, schema.width)
    pixels = preprocess_bytes(data, size, policy, max_pixels=sys.maxsize, draft=draft)
    return schema.encode_image(pixels)


# -- planning --------------------------------------------------------------------------------


def order_digest(seed: int, content_hash: str) -> bytes:
    """Seeded hash that fixes a record's position within its split."""
    return hashlib.sha256(f"{seed}:{content_hash}".encode()).digest()


def order_key(seed: int, content_hash: str) -> str:
    """:func:`order_digest` as hex (the same order: hex and bytes sort alike)."""
    return order_digest(seed, content_hash).hex()


def shard_name(split: str, index: int, num_shards: int) -> str:
    """TFDS-style file name, e.g. ``train.tfrecord-00000-of-00008``."""
    return f"{split}.tfrecord-{index:05d}-of-{num_shards:05d}"


def schema_from_params(params: ShardParams) -> RecordSchema:
    height, width = params.image_size
    return RecordSchema(height, width, params.encoding, jpeg_quality=params.jpeg_quality)


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
    exclude: np.ndarray | None = None,
    sample: bool = False,
    offset_bits: int | None = None,
    visit: Callable[[dict[str, Any]], None] | None = None,
) -> IndexScan:
    """Stream the index once: each split's records in seeded-hash order (ties by path).

    Records whose content hash (as 32 bytes) is in ``exclude`` (append: the base's, as a
    ``S32`` array) are left out, all at once when the scan ends; ``classes`` (append) must
    name every record's label. ``sample`` keeps the
    :data:`SIZE_SAMPLE` records with the smallest order keys (for the size estimate).
    ``visit`` sees every record (excluded ones too) as it streams past.
    """
    bits = pack_bits(index_path.stat().st_size) if offset_bits is None else offset_bits
    packed = {s: array("Q") for s in SPLITS}
    digests = {s: bytearray() for s in SPLITS} if exclude is not None else None
    count = path_bytes = 0
    first: list[tuple[str, int, ShardRecord]] = []
    for offset, rec in iter_records(index_path):
        if rec["split"] not in packed:
            raise ValueError(f"{index_path}: record {rec['path']}: unknown split {rec['split']!r}")
        if classes is not None and rec["label"] not in classes:
            raise ValueError(f"{index_path}: record {rec['path']}: unknown class {rec['label']!r}")
        if visit is not None:
            visit(rec)
        count += 1
        path_bytes += len(rec["path"].encode())
        digest = order_digest(params.seed, rec["sha256"])
        if sample:
            first.append((digest.hex(), count, _shard_record(rec, None)))
            if len(first) >= 4 * SIZE_SAMPLE:
                first = sorted(first)[:SIZE_SAMPLE]
        if digests is not None:
            digests[rec["split"]] += bytes.fromhex(rec["sha256"])
        top = int.from_bytes(digest[:8], "big") >> bits
        packed[rec["split"]].append((top << bits) | offset)
    if digests is not None and exclude is not None:
        for split, values in packed.items():
            keep = data_diff.missing_from(np.frombuffer(digests.pop(split), dtype="S32"), exclude)
            packed[split] = array("Q", np.frombuffer(values, dtype=np.uint64)[keep].tobytes())
    order = {s: _sorted_split(index_path, params.seed, v, bits) for s, v in packed.items()}
    return IndexScan(
        order=order,
        offset_bits=bits,
        records=count,
        mean_path_bytes=path_bytes / count if count else 0.0,
        sample=tuple(r for *_, r in sorted(first)[:SIZE_SAMPLE]),
    )


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


def _shard_record(rec: dict[str, Any], classes: list[str] | tuple[str, ...] | None) -> ShardRecord:
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
        records = tuple(_shard_record(r, self.classes) for r in self.index_records(slot))
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
) -> ShardPlan:
    """Cut ordered records into shard slots whose files live under ``folder`` (a generation)."""
    source_dir = str(header["source_dir"])
    common = {
        "source_dir": source_dir,
        "schema": schema_from_params(params).to_dict(),
        "resize": params.resize,
        "compression": params.compression,
        "preprocessing_version": preprocessing_version(),
        "draft": params.draft_decode,
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


def plan_hash(specs: Iterable[ShardSpec]) -> str:
    """sha256 of everything that decides shard bytes (not source_dir: bytes don't depend on it)."""
    # Streamed spec by spec: a large plan never exists as one JSON string, nor as all its specs.
    digest = hashlib.sha256(f"shard-plan-v{PLAN_VERSION}".encode())
    for spec in specs:
        # asdict(spec) without source_dir, minus asdict's deep copies (same JSON, faster)
        body = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "source_dir"}
        body["records"] = [vars(r) for r in spec.records]
        digest.update(json.dumps(body, sort_keys=True).encode())
    return digest.hexdigest()


# -- writing ---------------------------------------------------------------------------------


def write_shard(spec: ShardSpec, shards_dir: Path) -> ShardFile:
    """Write one shard atomically (temp file, fsync, rename) and describe it.

    A pure function of the spec: rerunning it rewrites the same bytes.
    """
    shards_dir = Path(shards_dir)
    here = preprocessing_version()
    if here != spec.preprocessing_version:
        raise RuntimeError(
            f"{spec.file}: this worker's preprocessing version {here} is not the plan's "
            f"{spec.preprocessing_version} (other code, Pillow or NumPy here); its pixels would "
            "not be the ones the manifest records"
        )
    schema = spec.record_schema
    final = shards_dir / spec.file
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        # No TensorFlow in shard workers: tasks.tfrecord writes the same framing.
        with TFRecordWriter(tmp, gzip_compress=spec.compression == "gzip") as writer:
            for record in spec.records:
                image = preprocess(spec.source_dir, record, schema, spec.resize, spec.draft)
                writer.write(
                    schema.serialize(image, record.label_index, record.sha256, record.path)
                )
        _fsync(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return describe_shard(spec.file, len(spec.records), shards_dir)


def describe_shard(file: str, num_records: int, shards_dir: Path) -> ShardFile:
    """The manifest entry of a written shard (hashes the file)."""
    path = Path(shards_dir) / file
    return ShardFile(
        file=file,
        num_records=num_records,
        bytes=path.stat().st_size,
        sha256=file_sha256(path),
    )


def prepare_shards_dir(specs: ShardPlan, shards_dir: Path) -> ShardPlan:
    """Get ``shards_dir`` ready for ``specs``; return the specs whose shard is still missing.

    Always removes temporaries and the manifest (rewritten last). Finished shards are kept
    only when ``.plan.json`` records the same plan; otherwise every shard file goes. When the
    previous manifest survives, a kept shard must also still match its recorded size and
    sha256, so a shard damaged after it was written is rewritten rather than reused. A
    rebuild is generation 0 alone: every appended generation's folder goes too.
    """
    shards_dir.mkdir(parents=True, exist_ok=True)
    digest = plan_hash(specs)
    same_plan = _same_plan(digest, shards_dir)
    recorded = _recorded_shards(shards_dir) if same_plan else {}
    (shards_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for folder in sorted(shards_dir.glob("gen-*")):
        shutil.rmtree(folder)
    return _keep_finished(specs, digest, shards_dir, shards_dir, same_plan, recorded)


def prepare_generation_dir(specs: ShardPlan, shards_dir: Path, plan: StagePlan) -> ShardPlan:
    """Get the new generation's folder ready; never touch the base's files or its manifest.

    The base manifest stays in place until the new one replaces it, so a killed append
    leaves the base complete and a rerun appends the same generation again (keeping the
    shards it finished). Folders of generations the base does not list (an abandoned
    append on another base) are removed.
    """
    assert plan.base is not None
    folder = shards_dir / generation_folder(plan.number)
    listed = {generation_folder(g.number).rstrip("/") for g in plan.base.generations}
    for other in sorted(shards_dir.glob("gen-*")):
        if other.name not in listed and other != folder:
            shutil.rmtree(other)
    folder.mkdir(parents=True, exist_ok=True)
    digest = plan_hash(specs)
    return _keep_finished(specs, digest, shards_dir, folder, _same_plan(digest, folder), {})


def _same_plan(digest: str, folder: Path) -> bool:
    plan_path = folder / PLAN_NAME
    return plan_path.exists() and _read_plan_hash(plan_path) == digest


def _keep_finished(
    specs: ShardPlan,
    digest: str,
    shards_dir: Path,
    folder: Path,
    same_plan: bool,
    recorded: dict[str, ShardFile],
) -> ShardPlan:
    """In ``folder``: drop temporaries and shards of another plan; record this plan."""
    wanted = set(specs.files)
    for stale in folder.glob(".*.tmp-*"):
        stale.unlink()
    for old in folder.glob("*.tfrecord-*"):
        name = old.relative_to(shards_dir).as_posix()
        if not same_plan or name not in wanted or not _matches(old, recorded.get(name)):
            old.unlink()
    write_json(folder / PLAN_NAME, {"plan_hash": digest, "shards": len(specs)})
    return specs.subset(i for i, f in enumerate(specs.files) if not (shards_dir / f).exists())


def _recorded_shards(shards_dir: Path) -> dict[str, ShardFile]:
    """Shard entries of the previous (complete) run's manifest, if it is still there."""
    try:
        previous = load_manifest(shards_dir)
    except (OSError, ValueError):
        return {}
    return {f.file: f for split in previous.splits.values() for f in split.shards}


def _matches(path: Path, recorded: ShardFile | None) -> bool:
    """A shard with no manifest entry was renamed into place complete: trust it."""
    if recorded is None:
        return True
    return path.stat().st_size == recorded.bytes and file_sha256(path) == recorded.sha256


WriteMany = Callable[[Iterable[ShardSpec], Path], Iterable[ShardFile]]


def write_inline(specs: Iterable[ShardSpec], shards_dir: Path) -> Iterator[ShardFile]:
    """Write shards one after another in this process (the flow's runner parallelises)."""
    for spec in specs:
        yield write_shard(spec, shards_dir)


def write_batch(specs: list[ShardSpec], shards_dir: Path) -> list[ShardFile]:
    """A batch of shards, one after the other, in this process."""
    return list(write_inline(specs, shards_dir))


def warm_worker() -> None:
    """A shard worker's one-off start-up: this module's imports (done by unpickling this
    function) and a first preprocessing-version probe, before any shard is due."""
    preprocessing_version()


def pool_workers(params: ShardParams) -> int:
    """Worker processes the local runner spawns for ``params`` (0: the flow writes itself,
    with one worker or on Dask)."""
    return params.workers if params.runner == "local" and params.workers > 1 else 0


def run_params(params: ShardParams, *, compact: bool) -> ShardParams:
    """The params a shard run uses: ``compact`` rebuilds (every generation folds into one)
    whatever ``shard.mode`` says."""
    return params.model_copy(update={"mode": "rebuild"}) if compact else params


def workers_from_the_start(params: ShardParams) -> bool:
    """Whether the run's workers start with it: a rebuild with local workers. An append
    spawns workers only once its new shards prove worth them."""
    return pool_workers(params) > 0 and params.mode == "rebuild"


def prestart_workers(params: ShardParams) -> None:
    """Start a rebuild's workers before the stage's own imports (see
    :func:`tasks.pool.prestart_pool`); the stage's pool takes them."""
    if workers_from_the_start(params):
        prestart_pool(params.workers, warm=warm_worker)


class RebuildNeeded(ValueError):
    """``shard.mode: append`` cannot express this change; ``shard.mode: rebuild`` can."""


REBUILD_HINT = "set shard.mode: rebuild in params.yaml (or run `make compact`)"


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
    previous_records: data_diff.Table | None  # its records (None: unreadable)
    # append: base images now in the index under another name (the diff's duplicates)
    duplicates: list[dict[str, str]] = field(default_factory=list)


@paused_gc()
def plan_stage(params: ShardParams, index_path: Path, shards_dir: Path) -> StagePlan:
    """Plan a rebuild (generation 0 from the index) or an append (a new generation).

    An append reads the index once: the same pass that orders the new records notes every
    record's class, split and path, for the check that nothing in the base was removed and
    for the data diff's duplicates (at 50k images each extra pass cost about 0.3 s). The
    diff's "before" is kept as a compact table, not as the record lists.
    """
    shards_dir, index_path = Path(shards_dir), Path(index_path)
    header = read_header(index_path)
    sample = params.encoding != "raw"
    if params.mode == "rebuild":
        previous, previous_records = _previous(shards_dir)
        scan = scan_index(params, index_path, sample=sample)
        specs = cut_shards(params, index_path, header, scan, folder="", classes=None)
        classes = list(header["classes"])
        return StagePlan(
            params.mode, 0, specs, classes, index_path, None, previous, previous_records
        )
    base = load_base(shards_dir)
    check_compatible(base, params, shards_dir)
    try:  # the base's records as a table (43 bytes each), its lists read a shard at a time
        before = base_table(shards_dir, base)
    except ValueError as error:
        raise RebuildNeeded(f"{error}; {REBUILD_HINT}") from error
    classes = base.classes + sorted(set(header["classes"]) - set(base.classes))
    current = data_diff.Table()  # every index record, in index order

    def note(r: dict[str, Any]) -> None:
        current.add(r["sha256"], r["path"], r["split"], r["label"], r["width"], r["height"])

    scan = scan_index(
        params,
        index_path,
        classes=classes,
        exclude=before.hash_array(),
        sample=sample,
        visit=note,
    )
    duplicates = check_nothing_removed(current, base, before, shards_dir, index_path)
    current = data_diff.Table()  # the whole index's table is not needed past this point
    number = len(base.generations)
    specs = cut_shards(
        params, index_path, header, scan, folder=generation_folder(number), classes=classes
    )
    return StagePlan(
        params.mode, number, specs, classes, index_path, base, base, before, duplicates
    )


def base_table(shards_dir: Path, base: ShardManifest) -> data_diff.Table:
    """Every record of the base shard set, from its record lists (sha256 checked)."""
    records = data_diff.rows(base, stream_records(shards_dir, base))
    return data_diff.Table.of(records, expected=base.total_records)


def load_base(shards_dir: Path) -> ShardManifest:
    """The manifest an append builds on; missing, the stage stops and names the fix."""
    if not (shards_dir / MANIFEST_NAME).exists():
        raise FileNotFoundError(
            f"{shards_dir / MANIFEST_NAME}: shard.mode is append but the base shard set is "
            "not here; fetch it with `dvc pull data/shards` (a fresh clone has only its "
            "hash), or set shard.mode: rebuild to build the whole set again"
        )
    base = load_manifest(shards_dir)
    for info in base.splits.values():
        for shard in info.shards:
            path = shards_dir / shard.file
            if not path.is_file() or path.stat().st_size != shard.bytes:
                raise FileNotFoundError(
                    f"{path}: a base shard is missing or incomplete; fetch the base with "
                    "`dvc pull data/shards`, or set shard.mode: rebuild"
                )
    return base


def check_compatible(base: ShardManifest, params: ShardParams, shards_dir: Path) -> None:
    """An append must write records exactly like the base's: same schema and preprocessing."""
    now = {
        "schema": schema_from_params(params).to_dict(),
        "compression": params.compression,
        "resize": params.resize,
        # decoded at reduced size or not: one manifest flag tells serving which, for all
        "draft_decode": params.draft_decode,
        "preprocessing_version": preprocessing_version(),
    }
    then = {
        "schema": dict(base.schema_),
        "compression": base.compression,
        "resize": base.resize,
        "draft_decode": base.draft_decode,
        "preprocessing_version": base.preprocessing_version,
    }
    changed = [
        k for k in now if json.dumps(now[k], sort_keys=True) != json.dumps(then[k], sort_keys=True)
    ]
    if changed:
        raise RebuildNeeded(
            f"{shards_dir}: the base shards differ from what shard params and code write now "
            f"({', '.join(changed)}); an append cannot mix two kinds of record: {REBUILD_HINT}"
        )


def check_nothing_removed(
    current: data_diff.Table,
    base: ShardManifest,
    before: data_diff.Table,
    shards_dir: Path,
    index_path: Path,
) -> list[dict[str, str]]:
    """Refuse when a base record (``before``) is gone from the index (``current``, every
    index record in index order) or has moved to another class or split; return the base
    records whose content the index now holds under another path (the diff's duplicates:
    the append keeps the record it has, and the diff names both paths).

    Append never removes or rewrites a record: an image deleted or edited since the base
    (its old content is gone), quarantined now, or moved, needs a rebuild. Compared as
    columns (a binary search per base record); paths are read back only for the records a
    message or the duplicates name.
    """
    found, match, same = data_diff.locate(before, current)
    problems = np.flatnonzero(~same)
    if len(problems):
        shown = [int(i) for i in problems[:5]]
        paths = _paths_at((entry["path"] for _, entry in stream_records(shards_dir, base)), shown)
        reasons = []
        for i in shown:
            if not found[i]:
                reasons.append(
                    f"{paths[i]} removed, changed or quarantined (see the ingest report)"
                )
                continue
            j = int(match[i])
            was = f"{before.names[before.labels[i]]}/{SPLITS[before.splits[i]]}"
            to = f"{current.names[current.labels[j]]}/{SPLITS[current.splits[j]]}"
            reasons.append(f"{paths[i]} moved from {was} to {to}")
        raise RebuildNeeded(
            f"{shards_dir}: {len(problems)} record(s) of the base shard set no longer match "
            f"the sources ({'; '.join(reasons)}); append only adds records: "
            f"{REBUILD_HINT}"
        )
    renamed = [
        int(i)
        for i in np.flatnonzero(current.path_digest_array()[match] != before.path_digest_array())
    ]
    if not renamed:
        return []
    old = _paths_at((entry["path"] for _, entry in stream_records(shards_dir, base)), renamed)
    new = _paths_at((r["path"] for _, r in iter_records(index_path)), match[renamed])
    return [
        {"path": new[int(match[i])], "same_content_as": old[i]}
        for i in renamed
        if new[int(match[i])] != old[i]
    ]


def _paths_at(paths: Iterable[str], positions: Iterable[int]) -> dict[int, str]:
    """The paths at these positions of a stream of paths (read to its end)."""
    wanted = {int(p) for p in positions}
    return {i: path for i, path in enumerate(paths) if i in wanted}


def _previous(shards_dir: Path) -> tuple[ShardManifest | None, data_diff.Table | None]:
    """The manifest already in ``shards_dir`` and its records, where readable: read before
    a rebuild replaces them, streamed into a compact table."""
    try:
        previous = load_manifest(shards_dir)
    except (OSError, ValueError):
        return None, None
    try:
        records = data_diff.rows(previous, stream_records(shards_dir, previous))
        return previous, data_diff.Table.of(records, expected=previous.total_records)
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return previous, None


def prepare(plan: StagePlan, shards_dir: Path) -> ShardPlan:
    """Ready ``shards_dir`` for the plan; return the specs whose shard is still missing."""
    if plan.base is None:
        return prepare_shards_dir(plan.specs, Path(shards_dir))
    if not plan.specs:
        return plan.specs  # nothing new: no generation, the base stays exactly as it is
    return prepare_generation_dir(plan.specs, Path(shards_dir), plan)


def finalize_manifest(
    params: ShardParams, plan: StagePlan, results: list[ShardFile], shards_dir: Path
) -> ShardManifest:
    """Write the generation's record list, then the manifest (last, atomically).

    The manifest lists the base's shards (unchanged) followed by the new generation's, per
    split; the fingerprint covers every generation. An append that adds nothing leaves the
    base manifest as it is. ``results`` are in plan order.
    """
    shards_dir = Path(shards_dir)
    base, specs = plan.base, plan.specs
    if base is not None and not specs:
        return base
    if [r.file for r in results] != specs.files or any(
        r.num_records != slot.num_records for r, slot in zip(results, specs.slots, strict=True)
    ):
        raise ValueError(f"{shards_dir}: the write results do not match the plan's shards")
    splits = {}
    counts_now = write_generation_records(plan, shards_dir)
    for split in SPLITS:
        shards = list(base.splits[split].shards) if base and split in base.splits else []
        counts = (
            Counter(base.splits[split].class_counts) if base and split in base.splits else Counter()
        )
        shards += [r for r, slot in zip(results, specs.slots, strict=True) if slot.split == split]
        counts.update({plan.classes[i]: n for i, n in counts_now[split].items()})
        splits[split] = SplitInfo(
            num_records=sum(s.num_records for s in shards),
            class_counts={name: counts.get(name, 0) for name in plan.classes},
            shards=shards,
        )
    generation = describe_generation(plan, shards_dir)
    manifest = build_manifest(
        schema_from_params(params),
        plan.classes,
        params.compression,
        splits,
        resize=params.resize,
        draft_decode=params.draft_decode,
        preprocessing_version=specs.common["preprocessing_version"]
        if specs
        else preprocessing_version(),
        generations=[*(base.generations if base else []), generation],
    )
    # offsets for readers without TensorFlow; an append reuses the base's (checked)
    write_record_index(manifest, Path(shards_dir), base)
    write_tfds_metadata(manifest, Path(shards_dir))  # tfds.builder_from_directory(shards_dir)
    write_text(shards_dir / MANIFEST_NAME, manifest.to_json())
    return manifest


def write_generation_records(plan: StagePlan, shards_dir: Path) -> dict[str, Counter[int]]:
    """Write what this generation added (per shard, in file order); count labels per split.

    The record lists let an append see the base's records, validation check old shards
    by hash, and the data diff compare versions, all without re-reading a shard. Written
    shard by shard (the bytes :func:`tasks.atomic.write_json` would write for the whole
    document), so a million records never sit in memory at once.
    """
    counts: dict[str, Counter[int]] = {split: Counter() for split in SPLITS}
    path = shards_dir / records_file_name(plan.number)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    order = sorted(range(len(plan.specs)), key=lambda i: plan.specs.slots[i].file)
    try:
        with open(tmp, "w") as handle:
            handle.write(f'{{\n  "generation": {plan.number},\n  "shards": {{')
            for n, i in enumerate(order):
                slot = plan.specs.slots[i]
                entries = []
                for rec in plan.specs.index_records(slot):
                    label = _shard_record(rec, plan.specs.classes).label_index
                    counts[slot.split][label] += 1
                    entries.append(
                        {
                            "sha256": rec["sha256"],
                            "path": rec["path"],
                            "label_index": label,
                            "width": int(rec["width"]),
                            "height": int(rec["height"]),
                        }
                    )
                body = json.dumps(entries, indent=2, sort_keys=True).replace("\n", "\n    ")
                handle.write(f"{',' if n else ''}\n    {json.dumps(slot.file)}: {body}")
            handle.write("\n  }\n}\n" if order else "}\n}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def describe_generation(plan: StagePlan, shards_dir: Path) -> Generation:
    """The manifest entry of the generation whose record list was just written."""
    name = records_file_name(plan.number)
    old = set(plan.base.classes) if plan.base else set()
    slots = plan.specs.slots
    return Generation(
        number=plan.number,
        base_fingerprint=plan.base.fingerprint if plan.base else None,
        records_file=name,
        records_sha256=file_sha256(shards_dir / name),
        new_classes=[c for c in plan.classes if c not in old],
        num_records={
            split: sum(s.num_records for s in slots if s.split == split) for split in SPLITS
        },
        shards=plan.specs.files,
    )


@dataclass(frozen=True)
class StageRun:
    """What one run of the shard stage did."""

    plan: StagePlan
    written: int  # shards written by this run (the others were kept from a killed run)
    manifest: ShardManifest
    diff: dict[str, Any] | None


def shard_stage(
    params: ShardParams,
    index_path: Path,
    shards_dir: Path,
    *,
    write_many: WriteMany = write_inline,
    diff_path: Path | None = None,
) -> StageRun:
    """The shard stage: plan, prepare, write the missing shards, finalize (and diff).

    The one orchestration there is: the flow (``flows/shard.py``, what `dvc repro` runs)
    calls it with ``write_many`` sending each shard to its Prefect task runner; tests of
    the pure pieces pass the inline writer. Resumes a killed run of the same plan. With
    ``diff_path``, also writes the data diff against the manifest found before (JSON
    there, Markdown next to it).
    """
    shards_dir = Path(shards_dir)
    plan = plan_stage(params, index_path, shards_dir)
    missing = prepare(plan, shards_dir)
    written = {r.file: r for r in write_many(missing, shards_dir)}
    results = [
        written.get(slot.file) or describe_shard(slot.file, slot.num_records, shards_dir)
        for slot in plan.specs.slots
    ]
    manifest = finalize_manifest(params, plan, results, shards_dir)
    diff = write_stage_diff(plan, manifest, shards_dir, diff_path) if diff_path else None
    return StageRun(plan, len(missing), manifest, diff)


def run_shard(
    params: ShardParams,
    index_path: Path,
    shards_dir: Path,
    *,
    write_many: WriteMany = write_inline,
    diff_path: Path | None = None,
) -> ShardManifest:
    """:func:`shard_stage`, returning only the manifest it wrote."""
    return shard_stage(
        params, index_path, shards_dir, write_many=write_many, diff_path=diff_path
    ).manifest


@paused_gc()
def write_stage_diff(
    plan: StagePlan, manifest: ShardManifest, shards_dir: Path, diff_path: Path
) -> dict[str, Any]:
    """The data diff of this run (previous manifest -> this one), written as JSON + Markdown.

    The "after" side streams the record lists (each checked by sha256) into a table: every
    generation's after a rebuild; after an append, the base's table (read while planning)
    plus the new generation's list only."""
    base = plan.previous_records if plan.base is not None else None
    if base is not None and manifest.generations[-1].number == plan.number:
        new = stream_records(shards_dir, manifest, manifest.generations[-1:])
        after = base.copy().extend(data_diff.rows(manifest, new))
    elif base is not None:
        after = base  # nothing was appended: the set is the base
    else:
        after = data_diff.Table.of(data_diff.rows(manifest, stream_records(shards_dir, manifest)))
    if len(after) != manifest.total_records:
        raise ValueError(
            f"{shards_dir}: record lists hold {len(after)} records, the manifest "
            f"{manifest.total_records}"
        )
    diff = data_diff.compute(
        plan.previous,
        plan.previous_records,
        manifest,
        after,
        mode=plan.mode,
        duplicates=plan.duplicates,
    )
    data_diff.write(diff, Path(diff_path))
    return diff


# -- file helpers ----------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _read_plan_hash(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text()).get("plan_hash"))
    except (OSError, ValueError, AttributeError):
        return None
