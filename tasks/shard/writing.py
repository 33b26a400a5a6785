"""Writing shards, and resuming a killed run of the same plan.

Crash safety: a shard is written to ``.{name}.tmp-{pid}``, fsynced and renamed; a plan file
(``.plan.json``) lets a rerun of the same plan keep finished shards; ``manifest.json`` is
written last (:mod:`tasks.shard.stage`), so a killed run never looks complete. A rebuild
writes into its own folder (:func:`tasks.contracts.shard_swap.rebuild_folder`), never into the shard
folder it replaces, and takes the finished shards of the same plan from either. A worker
whose preprocessing version differs from the plan's refuses to write.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tasks.contracts.manifest import (
    MANIFEST_NAME,
    PLAN_NAME,
    ShardFile,
    file_sha256,
    generation_folder,
    load_manifest,
)
from tasks.images import preprocessing_version
from tasks.runtime.atomic import write_json
from tasks.shard.planning import ShardPlan, StagePlan, plan_hash
from tasks.shard.spec import ShardSpec, SourceReader, preprocess
from tasks.tfrecord import TFRecordWriter


def write_shard(spec: ShardSpec, shards_dir: Path, read: SourceReader | None = None) -> ShardFile:
    """Write one shard atomically (temp file, fsync, rename) and describe it.

    A pure function of the spec: rerunning it rewrites the same bytes, whether the sources
    are read from ``spec.source_dir`` or by ``read`` (the same checked bytes).
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
                image = preprocess(
                    spec.source_dir, record, schema, spec.resize, spec.draft, spec.handoff, read
                )
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


def prepare(plan: StagePlan, shards_dir: Path, folder: Path) -> ShardPlan:
    """Ready ``folder`` (where the plan's shards go) for the plan; return the specs whose
    shard is still missing. A rebuild's ``folder`` is its own, an append's ``shards_dir``."""
    if plan.base is None:
        return prepare_rebuild_dir(plan.specs, Path(folder), Path(shards_dir))
    if not plan.specs:
        return plan.specs  # nothing new: no generation, the base stays exactly as it is
    return prepare_generation_dir(plan.specs, Path(shards_dir), plan)


def prepare_rebuild_dir(specs: ShardPlan, folder: Path, shards_dir: Path) -> ShardPlan:
    """Get a rebuild's ``folder`` ready for ``specs``; return the specs still missing there.

    ``shards_dir``, the set the rebuild replaces, is only read. In ``folder``: temporaries
    and the manifest (rewritten last) go; finished shards stay only when ``.plan.json``
    records the same plan (a killed rebuild's), and when that run's manifest survives, only
    those that still match their entry. Then the shards ``shards_dir`` holds of the same
    plan, each matching its manifest entry, are linked in: rerunning a finished rebuild
    encodes nothing.
    """
    folder.mkdir(parents=True, exist_ok=True)
    digest = plan_hash(specs)
    same_plan = _same_plan(digest, folder)
    recorded = _recorded_shards(folder) if same_plan else {}
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    missing = _keep_finished(specs, digest, folder, folder, same_plan, recorded)
    if not _same_plan(digest, shards_dir):
        return missing
    return _link_finished(missing, shards_dir, folder)


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


def _link_finished(specs: ShardPlan, shards_dir: Path, folder: Path) -> ShardPlan:
    """Link into ``folder`` each shard of ``specs`` that ``shards_dir`` holds as its manifest
    records it (size and sha256); return the specs still missing."""
    recorded = _recorded_shards(shards_dir)
    linked = set()
    for file in specs.files:
        source = shards_dir / file
        if file in recorded and source.is_file() and _matches(source, recorded[file]):
            _link(source, folder / file)
            linked.add(file)
    return specs.subset(i for i, f in enumerate(specs.files) if f not in linked)


def _link(source: Path, target: Path) -> None:
    """A hard link (the old set's name goes with the swap, the bytes stay); a copy renamed
    into place whole where the file system has none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def _recorded_shards(shards_dir: Path) -> dict[str, ShardFile]:
    """Shard entries of the manifest in ``shards_dir`` (a complete run's), if it is there."""
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


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _read_plan_hash(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text()).get("plan_hash"))
    except (OSError, ValueError, AttributeError):
        return None
