"""Ingest stage: find every input image, check it decodes, assign splits, quarantine the rest.

Every file found ends up in exactly one bucket: accepted (in the index, with its split),
quarantined (with a reason), or a duplicate of an accepted file. The index it writes is the
shard stage's only input besides the image bytes themselves. One file's inspection is
:mod:`tasks.ingest.inspection`'s; this module runs it over every file (in workers when it pays),
reusing what the previous run found, and places every image in a split.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tasks.contracts import handoff as handoff_store
from tasks.contracts.content import SPLITS, display_name, file_sha256
from tasks.contracts.handoff import HandoffWriter, Target
from tasks.contracts.index import (
    INDEX_VERSION,
    iter_records,
    iter_verdicts,
    read_header,
    write_index,
)
from tasks.contracts.near_duplicates import Item, hash_version, place
from tasks.ingest.discovery import Candidate, Discovered, discover
from tasks.ingest.inspection import (
    Inspected,
    Locator,
    Signature,
    inspect_chunk,
    inspect_file,
    signature,
)
from tasks.runtime.atomic import write_json, write_text
from tasks.runtime.gc_pause import paused_gc
from tasks.runtime.params import IngestParams, SplitFractions
from tasks.runtime.processes import capped_workers, spawn_pool
from tasks.runtime.refusals import Refused
from tasks.runtime.worker_cost import check_seconds, worth_workers


def verdict_key(params: IngestParams) -> str:
    """What a decode verdict depends on besides the bytes: the limits, the decoder and the
    perceptual hash taken from the decode."""
    from tasks.images import preprocessing_version

    return (
        f"max_pixels={params.max_pixels};min_side={params.min_side};"
        f"max_file_mb={params.max_file_mb};draft={params.draft_check};{preprocessing_version()};"
        f"{hash_version()}"
    )


def previous_verdicts(index_path: Path, key: str) -> dict[str, list[Any]]:
    """The previous index's decode verdicts by path, if made under the same ``key``.

    Any problem reading it (missing, another version, other limits or decoder) means
    nothing is reused: an incremental ingest is only ever a faster full one.
    """
    try:
        if read_header(index_path).get("verdict_key") != key:
            return {}
        return dict(iter_verdicts(index_path))
    except (OSError, ValueError, TypeError):
        return {}


def verdicts_of(inspected: list[Inspected]) -> dict[str, list[Any]]:
    """Decode verdicts of every file that was read, for the next run to reuse."""
    return {
        i.path: [i.sha256, i.format, i.width, i.height, i.reason, i.phash]
        for i in inspected
        if i.sha256 is not None
    }


# A signature is trusted only when the file last changed this long before the run that
# recorded it started vetting: a write in the same timestamp tick as that run's stat could
# otherwise leave mtime and ctime as they were (git's "racily clean" files). 2 s covers the
# coarsest file system clocks (FAT).
RACE_MARGIN_NS = 2_000_000_000


def signatures_path(index_path: Path) -> Path:
    """Where ingest keeps the stat signatures of the files behind ``index_path``.

    Beside the index, not in it: inode and device numbers differ between machines, and the
    index is a DVC output whose bytes must not."""
    return index_path.with_name(index_path.stem + ".signatures.json")


def previous_signatures(index_path: Path, params: IngestParams) -> dict[str, Signature]:
    """path -> the stat signature under which the index's content hash for it was taken.

    Only for the very index it was written with (its sha256 is recorded): a replaced index
    (a `dvc pull`, a checkout) or a missing or unreadable file means no signature is
    trusted and every file is read and hashed. ``ingest.trust_file_stat: false`` turns
    this off.
    """
    if not params.trust_file_stat:
        return {}
    path = signatures_path(index_path)
    try:
        recorded = json.loads(path.read_text())
        if recorded.get("index_sha256") != file_sha256(index_path):
            return {}
        return {str(f[0]): (f[1], f[2], f[3], f[4], f[5]) for f in recorded["files"]}
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return {}


def write_signatures(
    index_path: Path, index_sha256: str, inspected: list[Inspected], started_ns: int
) -> None:
    """Record the signatures safe to trust next time, bound to the index just written (its
    sha256): files whose content was hashed (or trusted) and whose last change came
    :data:`RACE_MARGIN_NS` before this run began."""
    cutoff = started_ns - RACE_MARGIN_NS
    files = [
        [i.path, *i.signature]
        for i in inspected
        if i.sha256 is not None and i.signature is not None and max(i.signature[1:3]) < cutoff
    ]
    text = json.dumps({"index_sha256": index_sha256, "files": files}, separators=(",", ":"))
    write_text(signatures_path(index_path), text + "\n")


def assign_split(content_hash: str, fractions: SplitFractions, seed: int) -> str:
    """Split from a seeded hash of the content, so a file's split never depends on others.

    Each class is split independently at the same fractions, so every class is stratified
    in expectation; identical content always lands in the same split (no leakage).
    """
    key = hashlib.sha256(f"{seed}:{content_hash}".encode()).digest()
    u = int.from_bytes(key[:8], "big") / 2**64
    if u < fractions.train:
        return "train"
    if u < fractions.train + fractions.val:
        return "val"
    return "test"


CHUNK = 64  # files per job sent to a worker


def check_estimates(source_dir: Path, paths: Iterable[str]) -> Iterator[float]:
    """Estimated seconds to check each file at ``paths`` (from its size, before any decode:
    :func:`tasks.runtime.worker_cost.check_seconds`); files gone meanwhile count nothing."""
    for path in paths:
        try:
            yield check_seconds(os.lstat(os.path.join(source_dir, path)).st_size)
        except (OSError, ValueError):  # quarantined by the inspection itself
            continue


def inspect_all(
    source_dir: Path,
    candidates: list[Candidate],
    params: IngestParams,
    known: dict[str, list[Any]] | None = None,
    progress: Callable[[int, int], None] | None = None,
    trusted: dict[str, Signature] | None = None,
    handoff: tuple[Path, Target] | None = None,
) -> list[Inspected]:
    """Inspect every candidate; results in ``candidates`` order.

    New files are decoded in chunks by spawned workers when there are enough of them. A
    file with a ``known`` verdict (path -> previous verdict) is read and hashed here, while
    the workers decode: when its content still matches, the verdict is reused without a
    decode, and a round trip to a worker would cost more than the hash (measured: an
    incremental ingest of 20k files took 1.2-1.5 s in one process, 1.8-2.2 s through two
    workers). ``progress(done, total)`` is called as files finish (the flow moves its
    Prefect progress artifact with it).

    ``handoff``: the folder where the shard stage's pixels are kept and the shard params'
    target they are made for (:mod:`tasks.contracts.handoff`), ``ingest.handoff_mb`` in all. With
    workers, this process keeps a share of one worker's size and the chunks split the rest
    by their number of files, so the processes together never pass the bound.
    """
    from tqdm import tqdm

    known, trusted = known or {}, trusted or {}
    limits = (
        params.max_pixels,
        params.min_side,
        int(params.max_file_mb * 2**20),
        params.draft_check,
    )
    max_pixels, min_side, max_bytes, draft = limits
    fresh = [i for i, c in enumerate(candidates) if c.path not in known]
    chunks = [fresh[i : i + CHUNK] for i in range(0, len(fresh), CHUNK)]
    workers = capped_workers(params.workers, "ingest.workers") if len(chunks) >= 2 else 1
    parallel = len(chunks) >= 2 and worth_workers(
        check_estimates(source_dir, (candidates[i].path for i in fresh)),
        min(workers, len(chunks)),
    )
    # files whose stat may vouch for their bytes in the shard stage (write_signatures' rule)
    trusted_before = time.time_ns() - RACE_MARGIN_NS if params.trust_file_stat else None
    shares = handoff_shares(
        int(params.handoff_mb * 2**20), [len(c) for c in chunks], parallel, workers
    )
    results: list[Inspected | None] = [None] * len(candidates)
    done = 0
    with tqdm(total=len(candidates), desc="ingest", unit="img", mininterval=1.0) as bar:

        def finished(count: int) -> None:
            nonlocal done
            done += count
            bar.update(count)
            if progress:
                progress(done, len(candidates))

        with spawn_pool(min(workers, len(chunks))) if parallel else nullcontext() as pool:
            futures = (
                [
                    pool.submit(
                        inspect_chunk,
                        str(source_dir),
                        [candidates[i] for i in chunk],
                        limits,
                        (str(handoff[0]), share, handoff[1], trusted_before)
                        if handoff is not None
                        else None,
                    )
                    for chunk, share in zip(chunks, shares, strict=False)
                ]
                if pool is not None
                else []
            )
            here = [i for i, c in enumerate(candidates) if pool is None or c.path in known]
            locator = Locator(source_dir, max_bytes)
            writer = (
                HandoffWriter(handoff[0], shares[-1], handoff[1], trusted_before)
                if handoff is not None
                else None
            )
            for start in range(0, len(here), CHUNK):
                block = here[start : start + CHUNK]
                for i in block:
                    candidate = candidates[i]
                    results[i] = inspect_file(
                        locator,
                        candidate,
                        max_pixels,
                        min_side,
                        draft,
                        known.get(candidate.path),
                        trusted.get(candidate.path),
                        writer,
                    )
                finished(len(block))
            for chunk, future in zip(chunks, futures, strict=False):
                for i, item in zip(chunk, future.result(), strict=True):
                    results[i] = item
                finished(len(chunk))
    missing = [candidates[i].path for i, r in enumerate(results) if r is None]
    if missing:  # a bug, never a data problem
        raise AssertionError(f"ingest lost files: {missing[:5]} not inspected")
    return [r for r in results if r is not None]


def handoff_shares(budget: int, chunk_sizes: list[int], parallel: bool, workers: int) -> list[int]:
    """Bytes each unit of work may keep for the shard stage: one per chunk, then this
    process's (last); they sum to at most ``budget``. In one process it has it all."""
    if not parallel:
        return [0] * len(chunk_sizes) + [budget]
    here = budget // (min(workers, len(chunk_sizes)) + 1)
    files = max(1, sum(chunk_sizes))
    return [(budget - here) * n // files for n in chunk_sizes] + [here]


def placement_key(params: IngestParams) -> dict[str, Any]:
    """The rule a split was placed under: the hash, the near-duplicate distance, the hash
    split's seed and fractions. Placements are kept only while it stays the same."""
    return {
        "hash": hash_version(),
        "near_duplicate_distance": params.near_duplicate_distance,
        "seed": params.seed,
        "splits": params.splits.model_dump(),
    }


def previous_placements(index_path: Path, key: dict[str, Any]) -> dict[str, str]:
    """sha256 -> split of every image the previous index placed under the same rule.

    Those images are in shards: they never move. An index placed under another rule (or
    before near-duplicate placement) keeps nothing, so every image is placed afresh: a
    rebuild (``shard.mode: append`` refuses moved images and names the rebuild).
    """
    try:
        if read_header(index_path).get("placement") != key:
            return {}
        return {str(r["sha256"]): str(r["split"]) for _, r in iter_records(index_path)}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def build_index(
    inspected: list[Inspected],
    classes: list[str],
    params: IngestParams,
    placed: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Sort inspected files into accepted / quarantined / duplicate, with splits.

    ``placed`` (sha256 -> split, see :func:`previous_placements`) are images already in
    shards; every other image is placed by :func:`tasks.contracts.near_duplicates.place`."""
    quarantined = [
        {"path": i.path, "label": i.label, "reason": i.reason} for i in inspected if i.reason
    ]
    good = [i for i in inspected if i.reason is None]
    by_hash: dict[str, list[Inspected]] = defaultdict(list)
    for item in good:
        by_hash[str(item.sha256)].append(item)

    records: list[dict[str, Any]] = []
    duplicates: list[dict[str, Any]] = []
    for item in good:
        group = by_hash[str(item.sha256)]
        labels = sorted({g.label for g in group})
        if len(labels) > 1:
            quarantined.append(
                {
                    "path": item.path,
                    "label": item.label,
                    "reason": f"duplicate content with conflicting labels {labels}: "
                    + ", ".join(g.path for g in group),
                }
            )
            continue
        keeper = group[0]  # inputs are sorted by path, so the first path wins
        if item is not keeper:
            duplicates.append({"path": item.path, "label": item.label, "duplicate_of": keeper.path})
            continue
        records.append(
            {
                "path": item.path,
                "label": item.label,
                "label_index": classes.index(item.label),
                "sha256": item.sha256,
                "split": None,  # placed below, once every image's neighbours are known
                "format": item.format,
                "width": item.width,
                "height": item.height,
                "phash": item.phash,
            }
        )
    placement = place(
        [Item(r["sha256"], r["path"], r["label"], r["phash"]) for r in records],
        placed or {},
        params.near_duplicate_distance,
        lambda sha: assign_split(sha, params.splits, params.seed),
    )
    for record in records:
        reason = placement.unplaceable.get(record["sha256"])
        if reason is not None:
            quarantined.append({"path": record["path"], "label": record["label"], "reason": reason})
        record["split"] = placement.splits.get(record["sha256"])
    records = [r for r in records if r["split"] is not None]
    quarantined.sort(key=lambda q: q["path"])
    near_duplicates = {
        "distance": params.near_duplicate_distance,
        "group_count": len(placement.groups),
        "images_in_groups": sum(len(g["paths"]) for g in placement.groups),
        # a chain of near-duplicates is one group: a huge one skews the split fractions
        "largest_group": max((len(g["paths"]) for g in placement.groups), default=0),
        "label_conflict_count": len(placement.label_conflicts),
        "groups": placement.groups,
        # near-duplicates with different labels: one of them is probably mislabelled
        "label_conflicts": placement.label_conflicts,
    }
    return {
        "records": records,
        "quarantined": quarantined,
        "duplicates": duplicates,
        "near_duplicates": near_duplicates,
    }


# How this run reached its verdicts: in what run_ingest returns (the flow logs it), never in
# the report file, which evaluate depends on: a rerun that changed no verdict changes no byte.
RUN_COUNTS = ("reused_count", "decoded_count", "stat_trusted_count")


@paused_gc()
def run_ingest(
    params: IngestParams,
    index_path: Path,
    report_path: Path,
    progress: Callable[[int, int], None] | None = None,
    handoff: Path | None = None,
    target: Target | None = None,
    excluded: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Ingest ``params.source_dir``; write the index and the ingest report; return the report.

    ``progress(done, total)``: files inspected so far, see :func:`inspect_all`. ``handoff``:
    the hand-off root (``Layout.handoff``): emptied, then filled with the shard stage's pixels
    of this run's decodes for ``target`` (:meth:`tasks.contracts.handoff.Target.of` the shard
    params;
    none without one), up to ``ingest.handoff_mb`` (:mod:`tasks.contracts.handoff`). ``excluded``:
    content hashes never admitted (:mod:`tasks.contracts.exclusions`), counted and named nowhere."""
    source_dir = Path(params.source_dir)
    labels_csv = Path(params.labels_csv) if params.labels_csv else None
    discovered = discover(source_dir, labels_csv)
    candidates = discovered.candidates
    classes = sorted({c.label for c in candidates})
    key = verdict_key(params)
    known = previous_verdicts(index_path, key)
    placed = previous_placements(index_path, placement_key(params))
    trusted = previous_signatures(index_path, params) if known else {}
    started_ns = time.time_ns()
    kept = None
    if handoff is not None:
        from tasks.images import preprocessing_version

        handoff_store.clear(handoff)  # an earlier run's leftovers: never more than the bound
        if target is not None:
            kept = (handoff_store.folder_for(handoff, preprocessing_version()), target)
    inspected = inspect_all(source_dir, candidates, params, known, progress, trusted, kept)
    refuse_files_changed_since_read(source_dir, inspected)  # before the index changes
    inspected, excluded_count = drop_excluded(inspected, excluded, kept)
    sorted_out = build_index(inspected, classes, params, placed)
    records = sorted_out["records"]
    present = sorted({r["label"] for r in records})
    refuse_a_lost_set(inspected, set(present), params)  # before the index or any shard changes
    classes = [c for c in classes if c in present]  # a class whose files all failed is dropped
    dropped = classes_dropped(discovered, present)
    for record in records:
        record["label_index"] = classes.index(record["label"])

    counts = {c: {s: 0 for s in SPLITS} for c in classes}
    for record in records:
        counts[record["label"]][record["split"]] += 1
    report = {
        "source_dir": params.source_dir,
        "classes": classes,
        "classes_dropped": dropped,
        "files_found": len(candidates) + len(discovered.skipped),
        "accepted": len(records),
        "quarantined_count": len(sorted_out["quarantined"]),
        "duplicate_count": len(sorted_out["duplicates"]),
        "skipped_count": len(discovered.skipped),
        # files whose content is on the exclusion list (data/excluded.json): never named
        "excluded_count": excluded_count,
        # incremental ingest: verdicts reused from the previous index vs files decoded now
        "reused_count": sum(1 for i in inspected if i.reused),
        "decoded_count": sum(1 for i in inspected if i.sha256 is not None and not i.reused),
        # of the reused: content hash taken on an unchanged stat, the file was not read
        "stat_trusted_count": sum(1 for i in inspected if i.trusted),
        "counts": counts,
        "split_counts": {s: sum(counts[c][s] for c in classes) for s in SPLITS},
        "formats": dict(sorted(Counter(str(r["format"]) for r in records).items())),
        "quarantined": sorted_out["quarantined"],
        "duplicates": sorted_out["duplicates"],
        "skipped": discovered.skipped,
        # groups of near-duplicate images, each kept in one split
        "near_duplicates": sorted_out["near_duplicates"],
    }
    accounted = sum(
        report[k]
        for k in (
            "accepted",
            "quarantined_count",
            "duplicate_count",
            "skipped_count",
            "excluded_count",
        )
    )
    if accounted != report["files_found"]:  # a bug, never a data problem
        raise AssertionError(
            f"ingest lost files: {accounted} accounted of {report['files_found']} found"
        )
    index = {
        "version": INDEX_VERSION,
        "source_dir": params.source_dir,
        "classes": classes,
        "records": records,
        "verdict_key": key,
        "placement": placement_key(params),
        "verdicts": verdicts_of(inspected),
    }
    index_sha256 = write_index(index_path, index)
    write_signatures(index_path, index_sha256, inspected, started_ns)
    write_json(report_path, {k: v for k, v in report.items() if k not in RUN_COUNTS})
    return report


def drop_excluded(
    inspected: list[Inspected],
    excluded: frozenset[str],
    handoff: tuple[Path, Target] | None,
) -> tuple[list[Inspected], int]:
    """The inspected files but those whose content is excluded, and how many went. Their
    hand-off entries go too; nothing of them reaches the index, its verdicts or signatures,
    so each run hashes them again rather than keep their names."""
    if not excluded:
        return inspected, 0
    kept = [i for i in inspected if i.sha256 not in excluded]
    gone = {str(i.sha256) for i in inspected if i.sha256 in excluded}
    if handoff is not None:
        for sha in gone:
            handoff_store.entry_path(handoff[0], sha).unlink(missing_ok=True)
    return kept, len(inspected) - len(kept)


def classes_dropped(discovered: Discovered, present: Iterable[str]) -> list[dict[str, str]]:
    """The classes the source names that have no accepted image, each with why: the model
    will not know them, which the report must say rather than leave to be noticed."""
    files = Counter(candidate.label for candidate in discovered.candidates)
    dropped = []
    for label in sorted(set(discovered.labels) - set(present)):
        if files[label]:
            reason = f"none of its {files[label]} files accepted (quarantined or duplicates)"
        else:
            reason = "no files in its folder"
        dropped.append({"class": display_name(label), "reason": reason})
    return dropped


class SourceChangedDuringIngest(Refused):
    """A source file changed after ingest read it, while the stage still ran."""


def refuse_files_changed_since_read(source_dir: Path, inspected: list[Inspected]) -> None:
    """Refuse the run when a file's stat differs from the one taken as it was read: the
    index would hold the old content and the folder the new, which the shard stage refuses.
    Failing here writes no index, and DVC records nothing; the listing it compares
    (:mod:`tasks.ingest.source_check`) was taken before the stage, so the next run ingests again."""
    changed = []
    for item in inspected:
        if item.signature is None:
            continue
        try:
            now: Signature | None = signature(os.stat(source_dir / item.path))
        except OSError:
            now = None
        if now != item.signature:
            changed.append(item.path)
    if changed:
        shown = ", ".join(changed[:10]) + (
            f" and {len(changed) - 10} more" if len(changed) > 10 else ""
        )
        raise SourceChangedDuringIngest(
            f"{len(changed)} file(s) of ingest.source_dir={str(source_dir)!r} changed while "
            f"ingest read them: {shown}. Nothing was written (the ingest index is as it was)",
            fix="run again once nothing writes into the folder (`make run`): ingest reads anew",
        )


class SetWouldBeLost(Refused, ValueError):
    """Ingest would keep no image, or none of a class because of an ``ingest`` limit."""

    fix = "fix the files it names, or the ingest limit it names in params.yaml, then rerun"


_DIMENSIONS = re.compile(r"absurd dimensions (\d+)x(\d+) ")


def limit_of(reason: str, params: IngestParams) -> str | None:
    """The ``ingest`` limit (param=value) that quarantined a file for ``reason``, if one did."""
    if reason.startswith("file too large:"):
        return f"ingest.max_file_mb={params.max_file_mb:g}"
    if found := _DIMENSIONS.match(reason):
        small = min(int(found[1]), int(found[2])) < params.min_side
        return (
            f"ingest.min_side={params.min_side}"
            if small
            else f"ingest.max_pixels={params.max_pixels}"
        )
    return None


def refuse_a_lost_set(inspected: list[Inspected], present: set[str], params: IngestParams) -> None:
    """Refuse, before the index is rewritten, an ingest that keeps no image, or none of a
    class because a limit quarantined them: the shard stage would replace the set in use by
    it (an empty set failed validation only once `data/shards` had been rebuilt)."""
    files: Counter[str] = Counter(i.label for i in inspected)
    limited: dict[str, Counter[str]] = defaultdict(Counter)  # class -> limit -> files
    for item in inspected:
        if item.reason and item.label not in present and (limit := limit_of(item.reason, params)):
            limited[item.label][limit] += 1
    lost = sorted(limited) if present else sorted(files)
    if not lost:
        return
    causes = sum((limited[c] for c in lost), Counter[str]())
    named = ", ".join(f"class {c!r} ({files[c]} files)" for c in lost)
    what = f"no image of {named}" if present else f"0 of {files.total()} images"
    examples = "; ".join([f"{i.path}: {i.reason}" for i in inspected if i.reason][:3])
    why = "; ".join(f"{limit} quarantines {n} of them" for limit, n in causes.items())
    fix = "; change that limit in params.yaml" if why else ""
    why = why or f"every file quarantined or a conflicting duplicate, {examples}"
    raise SetWouldBeLost(
        f"ingest would keep {what}: {why}. Nothing was rewritten (the ingest index and "
        f"data/shards are as they were){fix}"
    )


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-class table (class, train, val, test, total) for artifacts and README."""
    rows = []
    for cls in report["classes"]:
        c = report["counts"][cls]
        rows.append({"class": cls, **c, "total": sum(c.values())})
    return rows
