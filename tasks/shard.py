"""Shard stage: preprocess every indexed image once and write TFRecord shards plus a manifest.

The plan is a pure function of the ingest index and :class:`ShardParams`: each split's records
are ordered by a seeded hash of their content and cut into contiguous shards, so the same
inputs and params give byte-identical shards and ``manifest.json`` whatever the number of
workers. Each shard is an independent work unit (:class:`ShardSpec` -> :func:`write_shard`),
so any runner (a process pool here, Prefect/Dask elsewhere) can write them.

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
import multiprocessing
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.atomic import write_json, write_text
from tasks.images import preprocess_bytes, preprocessing_version
from tasks.index import load_index
from tasks.manifest import (
    MANIFEST_NAME,
    SPLITS,
    ShardFile,
    ShardManifest,
    SplitInfo,
    build_manifest,
    file_sha256,
    load_manifest,
)
from tasks.params import ShardParams
from tasks.records import write_record_index
from tasks.schema import RecordSchema
from tasks.tfds_metadata import write_tfds_metadata
from tasks.tfrecord import TFRecordWriter

PLAN_NAME = ".plan.json"
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

    @property
    def record_schema(self) -> RecordSchema:
        return RecordSchema.from_dict(self.schema)


# -- preprocessing ---------------------------------------------------------------------------


def preprocess(source_dir: str, record: ShardRecord, schema: RecordSchema, policy: str) -> bytes:
    """Read, check, decode, resize and encode one source image; returns the image feature."""
    path = Path(source_dir) / record.path
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise ValueError(f"{path}: content changed since ingest (sha256 differs); rerun ingest")
    # Ingest already enforced the size limits; the same preprocessing, limits off.
    size = (schema.height, schema.width)
    return schema.encode_image(preprocess_bytes(data, size, policy, max_pixels=sys.maxsize))


# -- planning --------------------------------------------------------------------------------


def order_key(seed: int, content_hash: str) -> str:
    """Seeded hash that fixes a record's position within its split."""
    return hashlib.sha256(f"{seed}:{content_hash}".encode()).hexdigest()


def shard_name(split: str, index: int, num_shards: int) -> str:
    """TFDS-style file name, e.g. ``train.tfrecord-00000-of-00008``."""
    return f"{split}.tfrecord-{index:05d}-of-{num_shards:05d}"


def schema_from_params(params: ShardParams) -> RecordSchema:
    height, width = params.image_size
    return RecordSchema(height, width, params.encoding, jpeg_quality=params.jpeg_quality)


def ordered_records(params: ShardParams, index: dict[str, Any]) -> dict[str, list[ShardRecord]]:
    """Each split's records, in seeded-hash order (ties, impossible after ingest, by path)."""
    by_split: dict[str, list[tuple[str, str, ShardRecord]]] = {s: [] for s in SPLITS}
    for rec in index["records"]:
        if rec["split"] not in by_split:
            raise ValueError(f"index record {rec['path']}: unknown split {rec['split']!r}")
        item = ShardRecord(rec["path"], int(rec["label_index"]), rec["sha256"])
        by_split[rec["split"]].append((order_key(params.seed, item.sha256), item.path, item))
    return {s: [item for *_, item in sorted(items)] for s, items in by_split.items()}


def estimate_record_bytes(params: ShardParams, index: dict[str, Any]) -> float:
    """Estimated serialized size of one record: exact image size for raw, sampled otherwise."""
    schema = schema_from_params(params)
    paths = [len(r["path"].encode()) for r in index["records"]] or [0]
    overhead = RECORD_OVERHEAD + sum(paths) / len(paths)
    if schema.encoding == "raw":
        return schema.height * schema.width * schema.channels + overhead
    everything = [
        ShardRecord(r["path"], int(r["label_index"]), r["sha256"]) for r in index["records"]
    ]
    sample = sorted(everything, key=lambda r: order_key(params.seed, r.sha256))[:SIZE_SAMPLE]
    sizes = [len(preprocess(index["source_dir"], r, schema, params.resize)) for r in sample]
    return (sum(sizes) / len(sizes) if sizes else 0) + overhead


def plan_shards(params: ShardParams, index: dict[str, Any]) -> list[ShardSpec]:
    """Cut each split into contiguous shards of about ``target_shard_mb``; deterministic.

    The target is MiB of uncompressed records (GZIP shards come out smaller); every
    non-empty split gets at least one shard, and no shard is empty.
    """
    schema = schema_from_params(params).to_dict()
    version = preprocessing_version()
    per_shard = params.target_shard_mb * (1 << 20)
    record_bytes = estimate_record_bytes(params, index) if index["records"] else 1.0
    specs = []
    for split, records in ordered_records(params, index).items():
        if not records:
            continue
        n = len(records)
        num_shards = min(n, max(1, math.ceil(n * record_bytes / per_shard)))
        for i in range(num_shards):
            chunk = tuple(records[i * n // num_shards : (i + 1) * n // num_shards])
            specs.append(
                ShardSpec(
                    split=split,
                    index=i,
                    num_shards=num_shards,
                    file=shard_name(split, i, num_shards),
                    records=chunk,
                    source_dir=str(index["source_dir"]),
                    schema=schema,
                    resize=params.resize,
                    compression=params.compression,
                    preprocessing_version=version,
                )
            )
    return specs


def plan_hash(specs: list[ShardSpec]) -> str:
    """sha256 of everything that decides shard bytes (not source_dir: bytes don't depend on it)."""
    # Streamed spec by spec: a 50k-record plan never exists as one JSON string in memory.
    digest = hashlib.sha256(f"shard-plan-v{PLAN_VERSION}".encode())
    for spec in specs:
        body = {k: v for k, v in asdict(spec).items() if k != "source_dir"}
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
    tmp = shards_dir / f".{spec.file}.tmp-{os.getpid()}"
    try:
        # No TensorFlow in shard workers: tasks.tfrecord writes the same framing.
        with TFRecordWriter(tmp, gzip_compress=spec.compression == "gzip") as writer:
            for record in spec.records:
                image = preprocess(spec.source_dir, record, schema, spec.resize)
                writer.write(
                    schema.serialize(image, record.label_index, record.sha256, record.path)
                )
        _fsync(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return describe_shard(spec, shards_dir)


def describe_shard(spec: ShardSpec, shards_dir: Path) -> ShardFile:
    """The manifest entry of a written shard (hashes the file)."""
    path = Path(shards_dir) / spec.file
    return ShardFile(
        file=spec.file,
        num_records=len(spec.records),
        bytes=path.stat().st_size,
        sha256=file_sha256(path),
    )


def prepare_shards_dir(specs: list[ShardSpec], shards_dir: Path) -> list[ShardSpec]:
    """Get ``shards_dir`` ready for ``specs``; return the specs whose shard is still missing.

    Always removes temporaries and the manifest (rewritten last). Finished shards are kept
    only when ``.plan.json`` records the same plan; otherwise every shard file goes. When the
    previous manifest survives, a kept shard must also still match its recorded size and
    sha256, so a shard damaged after it was written is rewritten rather than reused.
    """
    shards_dir.mkdir(parents=True, exist_ok=True)
    digest = plan_hash(specs)
    plan_path = shards_dir / PLAN_NAME
    same_plan = plan_path.exists() and _read_plan_hash(plan_path) == digest
    wanted = {s.file for s in specs}
    recorded = _recorded_shards(shards_dir) if same_plan else {}
    (shards_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for stale in shards_dir.glob(".*.tmp-*"):
        stale.unlink()
    for old in shards_dir.glob("*.tfrecord-*"):
        if not same_plan or old.name not in wanted or not _matches(old, recorded.get(old.name)):
            old.unlink()
    write_json(plan_path, {"plan_hash": digest, "shards": len(specs)})
    return [s for s in specs if not (shards_dir / s.file).exists()]


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


def write_shards(specs: list[ShardSpec], shards_dir: Path, workers: int) -> list[ShardFile]:
    """Write shards inline (one worker) or in spawned processes; results in spec order."""
    from tqdm import tqdm

    results: dict[str, ShardFile] = {}
    with tqdm(total=len(specs), desc="shard", unit="shard", mininterval=1.0) as bar:
        if workers <= 1 or len(specs) < 2:
            for spec in specs:
                results[spec.file] = write_shard(spec, shards_dir)
                bar.update(1)
        else:
            # TensorFlow and fork() do not mix: spawn fresh interpreters.
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
                futures = {pool.submit(write_shard, spec, shards_dir): spec for spec in specs}
                for future in as_completed(futures):
                    results[futures[future].file] = future.result()
                    bar.update(1)
    return [results[spec.file] for spec in specs]


def finalize_manifest(
    params: ShardParams,
    index: dict[str, Any],
    specs: list[ShardSpec],
    results: list[ShardFile],
    shards_dir: Path,
) -> ShardManifest:
    """Build the manifest from the plan and the written shards; write it last, atomically."""
    by_file = {r.file: r for r in results}
    classes: list[str] = list(index["classes"])
    splits = {}
    for split in SPLITS:
        split_specs = [s for s in specs if s.split == split]
        shards = []
        for spec in split_specs:
            result = by_file.get(spec.file)
            if result is None or result.num_records != len(spec.records):
                raise ValueError(f"{shards_dir / spec.file}: no matching write result for the plan")
            shards.append(result)
        labels = Counter(r.label_index for s in split_specs for r in s.records)
        splits[split] = SplitInfo(
            num_records=sum(len(s.records) for s in split_specs),
            class_counts={name: labels.get(i, 0) for i, name in enumerate(classes)},
            shards=shards,
        )
    manifest = build_manifest(
        schema_from_params(params),
        classes,
        params.compression,
        splits,
        resize=params.resize,
        preprocessing_version=specs[0].preprocessing_version if specs else preprocessing_version(),
    )
    write_record_index(manifest, Path(shards_dir))  # offsets for readers without TensorFlow
    write_tfds_metadata(manifest, Path(shards_dir))  # tfds.builder_from_directory(shards_dir)
    write_text(Path(shards_dir) / MANIFEST_NAME, manifest.to_json())
    return manifest


def run_shard(
    params: ShardParams, index_path: Path, shards_dir: Path, *, workers: int | None = None
) -> ShardManifest:
    """Shard the ingest index into ``shards_dir``; resumes a killed run of the same plan."""
    shards_dir = Path(shards_dir)
    index = load_index(Path(index_path))
    specs = plan_shards(params, index)
    del index["records"]  # the plan holds what writing needs; keep peak memory flat
    missing = prepare_shards_dir(specs, shards_dir)
    written = {r.file: r for r in write_shards(missing, shards_dir, workers or params.workers)}
    results = [written.get(s.file) or describe_shard(s, shards_dir) for s in specs]
    return finalize_manifest(params, index, specs, results, shards_dir)


# -- file helpers ----------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _read_plan_hash(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text()).get("plan_hash"))
    except (OSError, ValueError, AttributeError):
        return None
