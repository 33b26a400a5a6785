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
import shutil
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
    Generation,
    ShardFile,
    ShardManifest,
    SplitInfo,
    build_manifest,
    file_sha256,
    generation_folder,
    load_manifest,
    load_records,
    records_file_name,
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


def order_key(seed: int, content_hash: str) -> str:
    """Seeded hash that fixes a record's position within its split."""
    return hashlib.sha256(f"{seed}:{content_hash}".encode()).hexdigest()


def shard_name(split: str, index: int, num_shards: int) -> str:
    """TFDS-style file name, e.g. ``train.tfrecord-00000-of-00008``."""
    return f"{split}.tfrecord-{index:05d}-of-{num_shards:05d}"


def schema_from_params(params: ShardParams) -> RecordSchema:
    height, width = params.image_size
    return RecordSchema(height, width, params.encoding, jpeg_quality=params.jpeg_quality)


def ordered_records(
    params: ShardParams,
    index: dict[str, Any],
    *,
    classes: list[str] | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> dict[str, list[ShardRecord]]:
    """Each split's records, in seeded-hash order (ties, impossible after ingest, by path).

    ``classes`` (append) gives the label indices by class name instead of the index's own
    (sorted) numbering; records whose content hash is in ``exclude`` are left out.
    """
    by_split: dict[str, list[tuple[str, str, ShardRecord]]] = {s: [] for s in SPLITS}
    for rec in index["records"]:
        if rec["split"] not in by_split:
            raise ValueError(f"index record {rec['path']}: unknown split {rec['split']!r}")
        if rec["sha256"] in exclude:
            continue
        label = int(rec["label_index"]) if classes is None else classes.index(rec["label"])
        item = ShardRecord(rec["path"], label, rec["sha256"])
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
    sizes = [
        len(preprocess(index["source_dir"], r, schema, params.resize, params.draft_decode))
        for r in sample
    ]
    return (sum(sizes) / len(sizes) if sizes else 0) + overhead


def plan_shards(params: ShardParams, index: dict[str, Any]) -> list[ShardSpec]:
    """Cut each split into contiguous shards of about ``target_shard_mb``; deterministic.

    The target is MiB of uncompressed records (GZIP shards come out smaller); every
    non-empty split gets at least one shard, and no shard is empty.
    """
    return cut_shards(params, index, ordered_records(params, index), folder="")


def cut_shards(
    params: ShardParams,
    index: dict[str, Any],
    by_split: dict[str, list[ShardRecord]],
    *,
    folder: str,
) -> list[ShardSpec]:
    """Cut ordered records into shard specs whose files live under ``folder`` (a generation)."""
    schema = schema_from_params(params).to_dict()
    version = preprocessing_version()
    per_shard = params.target_shard_mb * (1 << 20)
    record_bytes = estimate_record_bytes(params, index) if index["records"] else 1.0
    specs = []
    for split, records in by_split.items():
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
                    file=folder + shard_name(split, i, num_shards),
                    records=chunk,
                    source_dir=str(index["source_dir"]),
                    schema=schema,
                    resize=params.resize,
                    compression=params.compression,
                    preprocessing_version=version,
                    draft=params.draft_decode,
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
    sha256, so a shard damaged after it was written is rewritten rather than reused. A
    rebuild is generation 0 alone: every appended generation's folder goes too.
    """
    shards_dir.mkdir(parents=True, exist_ok=True)
    same_plan = _same_plan(specs, shards_dir)
    recorded = _recorded_shards(shards_dir) if same_plan else {}
    (shards_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for folder in sorted(shards_dir.glob("gen-*")):
        shutil.rmtree(folder)
    return _keep_finished(specs, shards_dir, shards_dir, same_plan, recorded)


def prepare_generation_dir(
    specs: list[ShardSpec], shards_dir: Path, plan: StagePlan
) -> list[ShardSpec]:
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
    same_plan = _same_plan(specs, folder)
    return _keep_finished(specs, shards_dir, folder, same_plan, {})


def _same_plan(specs: list[ShardSpec], folder: Path) -> bool:
    plan_path = folder / PLAN_NAME
    return plan_path.exists() and _read_plan_hash(plan_path) == plan_hash(specs)


def _keep_finished(
    specs: list[ShardSpec],
    shards_dir: Path,
    folder: Path,
    same_plan: bool,
    recorded: dict[str, ShardFile],
) -> list[ShardSpec]:
    """In ``folder``: drop temporaries and shards of another plan; record this plan."""
    wanted = {s.file for s in specs}
    for stale in folder.glob(".*.tmp-*"):
        stale.unlink()
    for old in folder.glob("*.tfrecord-*"):
        name = old.relative_to(shards_dir).as_posix()
        if not same_plan or name not in wanted or not _matches(old, recorded.get(name)):
            old.unlink()
    write_json(folder / PLAN_NAME, {"plan_hash": plan_hash(specs), "shards": len(specs)})
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


class RebuildNeeded(ValueError):
    """``shard.mode: append`` cannot express this change; ``shard.mode: rebuild`` can."""


REBUILD_HINT = "set shard.mode: rebuild in params.yaml (or run `make compact`)"


@dataclass
class StagePlan:
    """What one run of the shard stage writes, and what it builds on."""

    mode: str
    number: int  # the generation this run writes
    specs: list[ShardSpec]
    classes: list[str]  # the new manifest's classes: the base's first, new ones appended
    sizes: dict[str, tuple[int, int]]  # content hash -> (width, height) recorded at ingest
    paths: dict[str, str]  # content hash -> its path in the current sources
    base: ShardManifest | None  # append: the manifest appended to
    previous: ShardManifest | None  # the manifest found before this run: the diff's "before"
    previous_records: dict[str, list[dict[str, Any]]] | None


def plan_stage(params: ShardParams, index_path: Path, shards_dir: Path) -> StagePlan:
    """Plan a rebuild (generation 0 from the index) or an append (a new generation)."""
    shards_dir = Path(shards_dir)
    index = load_index(Path(index_path))
    previous, previous_records = _previous(shards_dir)
    sizes = {r["sha256"]: (int(r["width"]), int(r["height"])) for r in index["records"]}
    paths = {r["sha256"]: r["path"] for r in index["records"]}
    if params.mode == "rebuild":
        specs = plan_shards(params, index)
        classes, number, base = list(index["classes"]), 0, None
    else:
        base = load_base(shards_dir)
        check_compatible(base, params, shards_dir)
        try:
            base_records = load_records(shards_dir, base)
        except ValueError as error:
            raise RebuildNeeded(f"{error}; {REBUILD_HINT}") from error
        exclude = check_nothing_removed(index, base, base_records, shards_dir)
        classes = base.classes + sorted(set(index["classes"]) - set(base.classes))
        number = len(base.generations)
        ordered = ordered_records(params, index, classes=classes, exclude=exclude)
        specs = cut_shards(params, index, ordered, folder=generation_folder(number))
        previous, previous_records = base, base_records
    del index["records"]  # the plan holds what writing needs; keep peak memory flat
    return StagePlan(
        params.mode, number, specs, classes, sizes, paths, base, previous, previous_records
    )


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
        "preprocessing_version": preprocessing_version(),
    }
    then = {
        "schema": dict(base.schema_),
        "compression": base.compression,
        "resize": base.resize,
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
    index: dict[str, Any],
    base: ShardManifest,
    base_records: dict[str, list[dict[str, Any]]],
    shards_dir: Path,
) -> set[str]:
    """Content hashes already in the base; refuses when a base record is gone or moved.

    Append never removes or rewrites a record: an image deleted or edited since the base
    (its old content is gone), or moved to another class or split, needs a rebuild.
    """
    current = {r["sha256"]: r for r in index["records"]}
    split_of = {s.file: split for split, info in base.splits.items() for s in info.shards}
    problems = []
    for file, entries in base_records.items():
        for entry in entries:
            now = current.get(entry["sha256"])
            label = base.classes[int(entry["label_index"])]
            if now is None:
                problems.append(f"{entry['path']} removed or changed")
            elif now["label"] != label or now["split"] != split_of[file]:
                problems.append(
                    f"{entry['path']} moved from {label}/{split_of[file]} to "
                    f"{now['label']}/{now['split']}"
                )
    if problems:
        raise RebuildNeeded(
            f"{shards_dir}: {len(problems)} record(s) of the base shard set no longer match "
            f"the sources ({'; '.join(problems[:5])}); append only adds records: "
            f"{REBUILD_HINT}"
        )
    return {entry["sha256"] for entries in base_records.values() for entry in entries}


def _previous(
    shards_dir: Path,
) -> tuple[ShardManifest | None, dict[str, list[dict[str, Any]]] | None]:
    """The manifest already in ``shards_dir`` and its record lists, where readable."""
    try:
        previous = load_manifest(shards_dir)
    except (OSError, ValueError):
        return None, None
    try:
        return previous, load_records(shards_dir, previous)
    except (OSError, ValueError, KeyError):
        return previous, None


def prepare(plan: StagePlan, shards_dir: Path) -> list[ShardSpec]:
    """Ready ``shards_dir`` for the plan; return the specs whose shard is still missing."""
    if plan.base is None:
        return prepare_shards_dir(plan.specs, Path(shards_dir))
    if not plan.specs:
        return []  # nothing new: no generation, the base stays exactly as it is
    return prepare_generation_dir(plan.specs, Path(shards_dir), plan)


def finalize_manifest(
    params: ShardParams, plan: StagePlan, results: list[ShardFile], shards_dir: Path
) -> ShardManifest:
    """Write the generation's record list, then the manifest (last, atomically).

    The manifest lists the base's shards (unchanged) followed by the new generation's, per
    split; the fingerprint covers every generation. An append that adds nothing leaves the
    base manifest as it is.
    """
    shards_dir = Path(shards_dir)
    base, specs = plan.base, plan.specs
    if base is not None and not specs:
        return base
    by_file = {r.file: r for r in results}
    splits = {}
    for split in SPLITS:
        split_specs = [s for s in specs if s.split == split]
        shards = list(base.splits[split].shards) if base and split in base.splits else []
        counts = (
            Counter(base.splits[split].class_counts) if base and split in base.splits else Counter()
        )
        for spec in split_specs:
            result = by_file.get(spec.file)
            if result is None or result.num_records != len(spec.records):
                raise ValueError(f"{shards_dir / spec.file}: no matching write result for the plan")
            shards.append(result)
        counts.update(plan.classes[r.label_index] for s in split_specs for r in s.records)
        splits[split] = SplitInfo(
            num_records=sum(s.num_records for s in shards),
            class_counts={name: counts.get(name, 0) for name in plan.classes},
            shards=shards,
        )
    generation = write_generation_records(plan, shards_dir)
    manifest = build_manifest(
        schema_from_params(params),
        plan.classes,
        params.compression,
        splits,
        resize=params.resize,
        preprocessing_version=specs[0].preprocessing_version if specs else preprocessing_version(),
        generations=[*(base.generations if base else []), generation],
    )
    write_record_index(manifest, Path(shards_dir))  # offsets for readers without TensorFlow
    write_tfds_metadata(manifest, Path(shards_dir))  # tfds.builder_from_directory(shards_dir)
    write_text(shards_dir / MANIFEST_NAME, manifest.to_json())
    return manifest


def write_generation_records(plan: StagePlan, shards_dir: Path) -> Generation:
    """Write what this generation added (per shard, in file order) and describe it.

    The record lists let an append see the base's records, validation check old shards
    by hash, and the data diff compare versions, all without re-reading a shard.
    """
    per_file = {
        spec.file: [
            {
                "sha256": r.sha256,
                "path": r.path,
                "label_index": r.label_index,
                "width": plan.sizes[r.sha256][0],
                "height": plan.sizes[r.sha256][1],
            }
            for r in spec.records
        ]
        for spec in plan.specs
    }
    name = records_file_name(plan.number)
    write_json(shards_dir / name, {"generation": plan.number, "shards": per_file})
    old = set(plan.base.classes) if plan.base else set()
    return Generation(
        number=plan.number,
        base_fingerprint=plan.base.fingerprint if plan.base else None,
        records_file=name,
        records_sha256=file_sha256(shards_dir / name),
        new_classes=[c for c in plan.classes if c not in old],
        num_records={
            split: sum(len(s.records) for s in plan.specs if s.split == split) for split in SPLITS
        },
        shards=[spec.file for spec in plan.specs],
    )


def records_of(
    manifest: ShardManifest, plan: StagePlan, shards_dir: Path
) -> dict[str, list[dict[str, Any]]]:
    """Every generation's record lists of the manifest just written (the diff's "after")."""
    if plan.base is not None and plan.previous_records is not None and not plan.specs:
        return plan.previous_records
    return load_records(shards_dir, manifest)


def run_shard(
    params: ShardParams,
    index_path: Path,
    shards_dir: Path,
    *,
    workers: int | None = None,
    diff_path: Path | None = None,
) -> ShardManifest:
    """Shard the ingest index into ``shards_dir``; resumes a killed run of the same plan.

    With ``diff_path``, also writes the data diff against the manifest found before (JSON
    there, Markdown next to it).
    """
    shards_dir = Path(shards_dir)
    plan = plan_stage(params, index_path, shards_dir)
    missing = prepare(plan, shards_dir)
    written = {r.file: r for r in write_shards(missing, shards_dir, workers or params.workers)}
    results = [written.get(s.file) or describe_shard(s, shards_dir) for s in plan.specs]
    manifest = finalize_manifest(params, plan, results, shards_dir)
    if diff_path is not None:
        write_stage_diff(plan, manifest, shards_dir, diff_path)
    return manifest


def write_stage_diff(
    plan: StagePlan, manifest: ShardManifest, shards_dir: Path, diff_path: Path
) -> dict[str, Any]:
    """The data diff of this run (previous manifest -> this one), written as JSON + Markdown."""
    from tasks import data_diff

    diff = data_diff.compute(
        plan.previous,
        plan.previous_records,
        manifest,
        records_of(manifest, plan, shards_dir),
        mode=plan.mode,
        current_paths=plan.paths,
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
