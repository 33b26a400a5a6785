"""Forgetting images: the pieces of ``shardflow forget`` (:mod:`flows.forget.orchestration`),
each one idempotent, so a rerun after a kill at any point completes the job.

- :func:`plan_forget`: the content hashes to remove (the images named and, unless exact,
  their near-duplicate groups) and the source files holding them;
- :func:`rewrite_shards`: only the shard files that hold them are rewritten, without their
  records (every other shard keeps its bytes), with the record lists, the offset index,
  the TFDS metadata, the manifest (a new fingerprint) and, last, the membership;
- :func:`scrub_files`: every file under the given folders (the DVC cache and remote,
  ``.dvc/tmp``, ``.shardflow``) that holds a forgotten image by identity
  (:mod:`tasks.erasure.identity`) is removed; what the working tree needs never is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.contracts import shard_changes as data_diff
from tasks.contracts.content import file_sha256
from tasks.contracts.index import load_index, write_index
from tasks.contracts.manifest import (
    MANIFEST_NAME,
    MEMBERSHIP_NAME,
    ShardManifest,
    SplitInfo,
    load_manifest,
    stream_records,
)
from tasks.contracts.membership import Membership, write_membership
from tasks.contracts.numpy_reader import write_record_index
from tasks.contracts.shard_blocks import write_block_list
from tasks.contracts.tfds_metadata import write_tfds_metadata
from tasks.erasure.identity import Forgotten, holds, mentions
from tasks.erasure.lineage import IndexView, resolve
from tasks.erasure.lost_revisions import object_id
from tasks.runtime.atomic import write_json, write_text
from tasks.runtime.refusals import Refused
from tasks.schema import HASH_KEY, LABEL_KEY
from tasks.tfrecord import TFRecordWriter, open_records, read_framed


class ForgetRefused(Refused):
    """A forget that cannot go ahead as asked."""


@dataclass(frozen=True)
class ForgetPlan:
    """What one ``shardflow forget`` removes."""

    asked: list[str]  # the content hashes named
    hashes: list[str]  # those and their near-duplicates (unless exact), sorted
    sources: list[str]  # their files, relative to source_dir (never written to the record)


def plan_forget(
    images: Iterable[str],
    *,
    layout: Any,
    source_dir: Path,
    distance: int,
    exact: bool,
) -> ForgetPlan:
    """The hashes and source files to remove for ``images`` (paths or content hashes)."""
    with IndexView(layout.index) as index:
        asked = sorted({resolve(image, layout, source_dir, index) for image in images})
        hashes = set(asked)
        if not exact:
            for sha in asked:
                hashes.update(index.group(sha, distance))
    refuse_degenerate(sorted(hashes), layout)
    return ForgetPlan(asked, sorted(hashes), sorted(_files_holding(layout.index, hashes)))


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def refuse_degenerate(hashes: list[str], layout: Any) -> None:
    """Refuse content that is no image's identity: an empty file's (every empty file has
    it: a lock, a marker) or that of a file the project keeps to run (its locks, DVC's own
    files, its configuration). Forgetting it would remove every file with that content."""
    from tasks.contracts.index import iter_records

    kept = project_contents(layout.root)
    for sha in hashes:
        if sha != EMPTY_SHA256 and sha not in kept:
            continue
        what = "an empty file's" if sha == EMPTY_SHA256 else "that of a file the project keeps"
        records = Path(layout.index).is_file() and any(
            r["sha256"] == sha for _, r in iter_records(layout.index)
        )
        was = "a record" if records else "quarantined by ingest, never a record"
        raise ForgetRefused(
            f"{sha}: its content is {what}, not one image's: no erasure can tell this "
            f"image from the files the project needs (the file was {was})",
            fix="delete the file from ingest.source_dir by hand; nothing of it is in the "
            "shards unless it was a record",
        )


def project_contents(root: Path) -> set[str]:
    """The content hashes of the small files the project needs to run: its locks, DVC's
    files and temporary markers, its configuration."""
    root = Path(root)
    files = [root / n for n in ("dvc.lock", "dvc.yaml", "params.yaml", ".dvcignore")]
    files += [root / ".dvc" / "config", *(root / ".dvc" / "tmp").glob("*")]
    files += list((root / ".shardflow").glob("*.lock*"))
    return {file_sha256(f) for f in files if f.is_file() and not f.is_symlink()}


def check_agreement(layout: Any, source_dir: Path) -> None:
    """Refuse, before anything changes, a project whose shards, params and index do not
    describe one dataset: the index read from another folder than ``ingest.source_dir``,
    shards built from another index (their records and its records differ in number), or
    a membership that is not the manifest's."""
    from tasks.contracts.index import read_header

    fix = "shardflow run (rebuilds the index and shards from params.yaml), then rerun forget"
    if not Path(layout.index).is_file():
        raise ForgetRefused(f"{layout.index}: no ingest index to find the images in", fix=fix)
    header = read_header(layout.index)
    indexed = Path(layout.root) / str(header.get("source_dir", ""))
    if indexed.resolve() != Path(source_dir).resolve():
        raise ForgetRefused(
            f"{layout.index} was read from {header.get('source_dir')}, params.yaml's "
            f"ingest.source_dir is {source_dir}: they describe different datasets",
            fix=fix,
        )
    try:
        manifest = load_manifest(layout.shards_dir)
        with Membership(Path(layout.shards_dir) / MEMBERSHIP_NAME) as membership:
            held, fingerprint = membership.count, membership.fingerprint
    except (OSError, ValueError) as error:
        raise ForgetRefused(f"{layout.shards_dir}: {error}", fix=fix) from error
    if fingerprint != manifest.fingerprint or held != manifest.total_records:
        raise ForgetRefused(
            f"{layout.shards_dir}: its membership is not its manifest's set", fix=fix
        )
    if int(header.get("num_records", -1)) != manifest.total_records:
        raise ForgetRefused(
            f"{layout.shards_dir} holds {manifest.total_records} record(s), {layout.index} "
            f"{header.get('num_records')}: the shards were built from another index",
            fix=fix,
        )


def _files_holding(index_path: Path, hashes: set[str]) -> set[str]:
    return set(files_by_path(index_path, hashes))


def files_by_path(index_path: Path, hashes: Iterable[str]) -> dict[str, str]:
    """Every source file the index knows with one of ``hashes`` as its content, and that
    hash: the records, and the files read but not admitted (a byte-identical copy filed as
    a duplicate, a copy quarantined under another label), whose verdicts hold their hash."""
    from tasks.contracts.index import iter_records, iter_verdicts

    wanted = set(hashes)
    if not Path(index_path).exists():
        return {}
    found = {
        str(record["path"]): str(record["sha256"])
        for _, record in iter_records(index_path)
        if record["sha256"] in wanted
    }
    found |= {
        path: str(verdict[0]) for path, verdict in iter_verdicts(index_path) if verdict[0] in wanted
    }
    return found


def may_write(folder: Path, root: Path) -> bool:
    """Whether the project may delete files in ``folder``: one inside its root (a run never
    writes outside its repository) that this process can write."""
    folder, root = Path(folder).resolve(), Path(root).resolve()
    return folder.is_relative_to(root) and os.access(folder, os.W_OK)


def remove_sources(source_dir: Path, plan: ForgetPlan, *, root: Path) -> list[str]:
    """Delete the plan's source files (those still there) from the folders the project may
    write (:func:`may_write`); the others stay where they are, kept out by the exclusion
    list (:mod:`tasks.contracts.exclusions`, written before this). The files deleted."""
    removed = []
    for relative in plan.sources:
        path = source_dir / relative
        if not may_write(path.parent, root):
            continue
        if path.is_file() and file_sha256(path) in plan.hashes:
            path.unlink()
            removed.append(relative)
    return removed


def records_holding(index_path: Path, hashes: set[str]) -> int:
    """How many records of the ingest index have one of ``hashes`` as their content."""
    from tasks.contracts.index import iter_records

    if not Path(index_path).exists():
        return 0
    return sum(record["sha256"] in hashes for _, record in iter_records(index_path))


def rewrite_index(index_path: Path, hashes: set[str]) -> int:
    """The ingest index without the records and verdicts of ``hashes``; records dropped."""
    if not Path(index_path).exists():
        return 0
    index = load_index(index_path)
    kept = [r for r in index["records"] if r["sha256"] not in hashes]
    dropped = len(index["records"]) - len(kept)
    verdicts = {p: v for p, v in index["verdicts"].items() if v[0] not in hashes}
    if dropped or len(verdicts) != len(index["verdicts"]):
        write_index(index_path, {**index, "records": kept, "verdicts": verdicts})
    return dropped


def affected_shards(shards_dir: Path, hashes: Iterable[str]) -> list[str]:
    """The shard files that hold any of ``hashes``, from the set's membership (rewritten
    last, so a rerun after a kill still finds the files it was rewriting)."""
    path = Path(shards_dir) / MEMBERSHIP_NAME
    if not path.is_file():
        raise ForgetRefused(
            f"{path}: the shard set has no membership to find the images in",
            fix="shardflow run (the shard stage writes it), then rerun forget",
        )
    with Membership(path) as membership:
        return sorted({m.shard_file for sha in hashes for m in membership.find(sha)})


def filter_shard(path: Path, hashes: set[str], manifest: ShardManifest) -> Counter[int]:
    """Rewrite one shard without the records of ``hashes`` (atomic, a no-op when it holds
    none); the labels of the records removed."""
    schema, gzip_compressed = manifest.record_schema, manifest.compression == "gzip"
    kept, removed = [], Counter[int]()
    with open_records(path, gzip_compressed=gzip_compressed) as handle:
        while (data := read_framed(handle)) is not None:
            features = schema.parse(data)
            if features[HASH_KEY] in hashes:
                removed[int(features[LABEL_KEY])] += 1
            else:
                kept.append(data)
    if removed:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with TFRecordWriter(tmp, gzip_compress=gzip_compressed) as writer:
                for data in kept:
                    writer.write(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return removed


def rewrite_shards(
    shards_dir: Path, hashes: set[str], *, diff_path: Path | None = None
) -> ShardManifest:
    """The shard set without ``hashes``: the files holding them rewritten, every other file
    kept; then the record lists, offsets, TFDS metadata, the manifest and the membership.
    With ``diff_path``, the data diff of the change is written there (counts only, like the
    shard stage's: no record of a forgotten image is named)."""
    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    before = _table(shards_dir, manifest) if diff_path is not None else None
    try:
        new = _rewrite(shards_dir, manifest, hashes)
        if diff_path is not None:
            after = _table(shards_dir, new)
            try:
                diff = data_diff.compute(
                    manifest, before, new, after or data_diff.Table(), mode="forget"
                )
            finally:
                if after is not None:
                    after.close()
            data_diff.write(diff, diff_path)
    finally:
        if before is not None:
            before.close()
    return new


def _table(shards_dir: Path, manifest: ShardManifest) -> data_diff.SpilledTable | None:
    """The set's records as the data diff's table; None where its lists no longer match its
    manifest (a rerun after a kill that had rewritten them: the diff says it did not know)."""
    try:
        rows = data_diff.rows(manifest, stream_records(shards_dir, manifest))
        return data_diff.SpilledTable.of(shards_dir, rows, expected=manifest.total_records)
    except (OSError, ValueError):
        return None


def _rewrite(shards_dir: Path, manifest: ShardManifest, hashes: set[str]) -> ShardManifest:
    for file in affected_shards(shards_dir, hashes):
        filter_shard(shards_dir / file, hashes, manifest)
    split_of = {s.file: split for split, info in manifest.splits.items() for s in info.shards}
    generations = [_rewrite_records(shards_dir, g, hashes, split_of) for g in manifest.generations]
    counts = _class_counts(shards_dir, generations, manifest)
    splits = {}
    for split, info in manifest.splits.items():
        shards = [_describe(shards_dir, shard.file) for shard in info.shards]
        splits[split] = SplitInfo(
            num_records=sum(s.num_records for s in shards),
            class_counts={c: counts[split].get(c, 0) for c in manifest.classes},
            shards=shards,
        )
    new = manifest.model_copy(update={"splits": splits, "generations": generations})
    new.fingerprint = new.compute_fingerprint()
    write_record_index(new, shards_dir)
    write_block_list(new, shards_dir, manifest)  # untouched shards keep their entries
    write_tfds_metadata(new, shards_dir)
    write_text(shards_dir / MANIFEST_NAME, new.to_json())
    write_membership(new, shards_dir)
    return new


def _describe(shards_dir: Path, file: str) -> Any:
    from tasks.shard.writing import describe_shard
    from tasks.tfrecord import record_offsets

    count = len(record_offsets(shards_dir / file))
    return describe_shard(file, count, shards_dir)


def _rewrite_records(
    shards_dir: Path, generation: Any, hashes: set[str], split_of: dict[str, str]
) -> Any:
    """A generation's record list without ``hashes`` (read whole: a rerun may find it
    rewritten already, its sha256 no longer the old manifest's)."""
    path = shards_dir / generation.records_file
    document = json.loads(path.read_text())
    shards = {
        file: [r for r in records if r["sha256"] not in hashes]
        for file, records in document["shards"].items()
    }
    if shards != document["shards"]:
        write_json(path, {**document, "shards": shards})
    added: Counter[str] = Counter()
    for file, records in shards.items():
        added[split_of[file]] += len(records)
    return generation.model_copy(
        update={
            "records_sha256": file_sha256(path),
            "num_records": {split: added.get(split, 0) for split in generation.num_records},
        }
    )


def _class_counts(
    shards_dir: Path, generations: list[Any], manifest: ShardManifest
) -> dict[str, Counter[str]]:
    """Records per split and class, from the (rewritten) record lists."""
    split_of = {s.file: split for split, info in manifest.splits.items() for s in info.shards}
    counts: dict[str, Counter[str]] = {split: Counter() for split in manifest.splits}
    for generation in generations:
        document = json.loads((shards_dir / generation.records_file).read_text())
        for file, records in document["shards"].items():
            for record in records:
                counts[split_of[file]][manifest.classes[record["label_index"]]] += 1
    return counts


@dataclass(frozen=True)
class Scrubbed:
    """What a scrub removed, and the files it kept in which a byte search still finds a
    forgotten hash or path (reported, never removed on that ground)."""

    removed: list[str]
    mentioning: list[str]


def scrub_files(
    folders: Iterable[Path],
    forgotten: Forgotten,
    *,
    keep: set[Path] | frozenset[Path] = frozenset(),
    current: set[str] | frozenset[str] = frozenset(),
) -> Scrubbed:
    """Remove every file under ``folders`` that holds a forgotten image by identity
    (:func:`tasks.erasure.identity.holds`), but those in ``keep``, the empty ones and the
    DVC objects in ``current`` (those the working tree's outputs need)."""
    removed, mentioning = [], []
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        for root, _, names in os.walk(folder):
            for name in names:
                path = Path(root) / name
                if path in keep or path.is_symlink() or not path.is_file():
                    continue
                if object_id(str(path)) in current or not path.stat().st_size:
                    continue
                data = path.read_bytes()
                if holds(name, data, forgotten):
                    path.unlink()
                    removed.append(str(path))
                elif mentions(data, forgotten):
                    mentioning.append(str(path))
    return Scrubbed(sorted(removed), sorted(mentioning))
