"""Validation's checks of what re-reading the shards found (``tasks.validate.stage`` reads them):
coverage, labels, class counts, leakage, the ingest index and near-duplicates. Each is a
function of the manifest and the records read (and the index file), returning one named
report entry (:func:`check`) that fails with its problems listed, never raising.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.contracts.manifest import SPLITS, ShardManifest

MAX_EXAMPLES = 20  # failures listed per check; the counts are always complete


@dataclass
class ShardContents:
    """What re-reading one shard found: labels and hashes in file order, and any error."""

    split: str
    file: str
    labels: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None  # {"file", "record_index", "error"}
    sample: list[list[Any]] = field(default_factory=list)  # first records, for the cross-check


def check(name: str, problems: list[Any], ok: str, bad: str, **details: Any) -> dict[str, Any]:
    """One report entry; fails when ``problems`` is non-empty (the first few are listed)."""
    details = {**details, "problems": len(problems)}
    if problems:
        details["examples"] = problems[:MAX_EXAMPLES]
    return {
        "name": name,
        "passed": not problems,
        "message": bad if problems else ok,
        "details": details,
    }


# -- content checks --------------------------------------------------------------------------


def check_coverage(manifest: ShardManifest, contents: list[ShardContents]) -> dict[str, Any]:
    """What training and evaluation need of the set: two classes or more, records in every
    split (training validates on ``val``, evaluation scores ``test``), and train records of
    every class (a class the model never trains on cannot be learned).

    ``ingest.splits`` puts every fraction above zero, but each class keeps its share of every
    split in whole images, so a small set can leave a split empty (36 images at
    0.98/0.01/0.01 left val and test without one; training then failed inside tf.data), and
    a class of a few images can land wholly outside train. One class folder trained a model
    that always answers it.
    """
    total = sum(len(t.labels) for t in contents)
    per_split = labels_per_split(contents)
    problems: list[dict[str, Any]] = []
    if len(manifest.classes) < 2:
        problems.append({"classes": list(manifest.classes)})
    problems += [{"split": split, "records": 0} for split in SPLITS if not per_split[split]]
    if per_split["train"]:
        problems += [
            {"split": "train", "class": name, "records": 0}
            for index, name in enumerate(manifest.classes)
            if not per_split["train"][index]
        ]
    reasons = [_coverage_reason(p) for p in problems]
    message = (
        f"{'; '.join(reasons[:5])} (of {total} images; each class keeps its ingest.splits "
        "fraction of every split, so a class of fewer images than 1/fraction gives that split "
        "none): add images or class folders, or raise an empty split's fraction in "
        "ingest.splits"
    )
    ok = f"{len(manifest.classes)} classes, every split holds records, every class trains"
    return check("coverage", problems, ok, message)


def _coverage_reason(problem: dict[str, Any]) -> str:
    if "classes" in problem:
        return f"{len(problem['classes'])} class(es) {problem['classes']}: a classifier needs two"
    if "class" in problem:
        return f"class {problem['class']!r} has no train records"
    return f"split {problem['split']!r} holds no records"


def check_labels(manifest: ShardManifest, contents: list[ShardContents]) -> dict[str, Any]:
    """Every label indexes into the manifest's classes."""
    num_classes = len(manifest.classes)
    problems = [
        {"file": t.file, "record_index": i, "label": label}
        for t in contents
        for i, label in enumerate(t.labels)
        if not 0 <= label < num_classes
    ]
    message = f"{len(problems)} labels outside [0, {num_classes})" + "".join(
        f"; {p['file']} record {p['record_index']}: label {p['label']}" for p in problems[:3]
    )
    return check(
        "labels", problems, f"all labels in [0, {num_classes})", message, num_classes=num_classes
    )


def labels_per_split(contents: list[ShardContents]) -> dict[str, Counter[int]]:
    """Records read per split and class index (every split present, empty or not)."""
    per_split = {split: Counter[int]() for split in SPLITS}
    for target in contents:
        per_split.setdefault(target.split, Counter()).update(target.labels)
    return per_split


def check_class_counts(manifest: ShardManifest, contents: list[ShardContents]) -> dict[str, Any]:
    """Per split and class, the records read equal the manifest's class_counts."""
    problems: list[dict[str, Any]] = []
    per_split = labels_per_split(contents)
    for split, info in manifest.splits.items():
        seen = per_split.get(split, Counter())
        for index, name in enumerate(manifest.classes):
            declared = info.class_counts.get(name, 0)
            if seen[index] != declared:
                problems.append(
                    {"split": split, "class": name, "manifest": declared, "found": seen[index]}
                )
    message = "; ".join(
        f"{p['split']}/{p['class']}: manifest {p['manifest']}, found {p['found']}"
        for p in problems[:5]
    )
    return check("class_counts", problems, "class counts match the manifest", message)


def check_leakage(contents: list[ShardContents]) -> dict[str, Any]:
    """No content hash in two splits, and none twice within a split."""
    where: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for target in contents:
        for position, digest in enumerate(target.hashes):
            where[digest].append((target.split, target.file, position))
    problems: list[dict[str, Any]] = []
    for digest, places in where.items():
        if len(places) < 2:
            continue
        splits = sorted({split for split, _, _ in places})
        kind = (
            "leak across splits " + "/".join(splits)
            if len(splits) > 1
            else f"duplicate in {splits[0]}"
        )
        problems.append(
            {"content_hash": digest, "problem": kind, "records": [f"{f}#{i}" for _, f, i in places]}
        )
    leaks = sum(1 for p in problems if p["problem"].startswith("leak"))
    dupes = len(problems) - leaks
    message = f"{leaks} contents in more than one split, {dupes} duplicated within a split"
    return check(
        "leakage", problems, "no content in two splits or twice in one", message, leaks=leaks
    )


def check_index(
    index_path: Path, manifest: ShardManifest, contents: list[ShardContents]
) -> dict[str, Any]:
    """Every accepted index record is in the shards exactly once, with its split and label."""
    from tasks.contracts.index import iter_records, read_header

    try:  # the records only: the decode verdicts after them are ingest's business
        classes = read_header(index_path)["classes"]
        records = [record for _, record in iter_records(index_path)]
    except (OSError, ValueError) as exc:
        return check("index", [str(exc)], "", str(exc))
    found: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for target in contents:
        for digest, label in zip(target.hashes, target.labels, strict=True):
            found[digest].append((target.split, label))
    problems: list[dict[str, Any]] = []
    # By class name: an appended shard set keeps its classes' indices, new classes last.
    position = {name: i for i, name in enumerate(manifest.classes)}
    for record in records:
        seen = found.pop(record["sha256"], [])
        want = (record["split"], position.get(record["label"], -1))
        if seen != [want]:
            problems.append(
                {"path": record["path"], "index": list(want), "shards": [list(s) for s in seen]}
            )
    extra = [
        {"content_hash": digest, "shards": [list(s) for s in places]}
        for digest, places in found.items()
    ]
    if sorted(classes) != sorted(manifest.classes):
        problems.append({"problem": f"index classes {classes} != manifest {manifest.classes}"})
    message = (
        f"{len(problems)} index records missing or mismatched, "
        f"{len(extra)} shard records not in the index"
    )
    ok = f"all {len(records)} index records present once with their split and label"
    return check(
        "index",
        problems + extra,
        ok,
        message,
        index_records=len(records),
        missing_or_mismatched=len(problems),
        extra=len(extra),
    )


def check_near_duplicates(index_path: Path, contents: list[ShardContents]) -> dict[str, Any]:
    """No near-duplicate pair (ingest's relation: perceptual hashes within the distance it
    placed with, confirmed by the thumbnails, :func:`tasks.contracts.near_duplicates.is_near`)
    spans two splits: a resized or re-encoded copy of a training photo in test inflates test
    accuracy as surely as an exact copy does (``leakage`` catches those)."""
    from tasks.contracts.index import iter_records, read_header
    from tasks.contracts.near_duplicates import hamming, straddling_pairs

    try:
        placement = read_header(index_path).get("placement")
        by_hash = {str(r["sha256"]): r for _, r in iter_records(index_path)}
    except (OSError, ValueError) as exc:
        return check("near_duplicates", [str(exc)], "", str(exc))
    if not isinstance(placement, dict) or "confirmation" not in placement:
        problem = (
            f"{index_path} holds no near-duplicate thumbnails (written before confirmed "
            "near-duplicate placement): rerun the ingest stage, then rebuild the shards"
        )
        return check("near_duplicates", [problem], "", problem)
    distance = int(placement["near_duplicate_distance"])
    found = [
        (target.split, by_hash[digest])
        for target in contents
        for digest in target.hashes
        if by_hash.get(digest, {}).get("phash")  # a record unknown to the index: see `index`
    ]
    pairs = straddling_pairs(
        [r["phash"] for _, r in found],
        [s for s, _ in found],
        distance,
        [r["thumb"] for _, r in found],
    )
    problems: list[dict[str, Any]] = [
        {
            "paths": [found[i][1]["path"], found[j][1]["path"]],
            "splits": [found[i][0], found[j][0]],
            "distance": hamming(found[i][1]["phash"], found[j][1]["phash"]),
        }
        for i, j in pairs
    ]
    first = problems[0] if problems else None
    message = (
        f"{len(problems)} near-duplicate pairs span two splits (e.g. {first['paths'][0]} in "
        f"{first['splits'][0]}, {first['paths'][1]} in {first['splits'][1]}, "
        f"{first['distance']} bits apart); rebuild the shards (shard.mode: rebuild or "
        "`make compact`) after ingest so each group is placed in one split"
        if first
        else ""
    )
    ok = f"no near-duplicate pair (within {distance} bits) spans two splits"
    return check("near_duplicates", problems, ok, message, distance=distance)
