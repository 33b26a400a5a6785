"""Ingest stage: find every input image, check it decodes, assign splits, quarantine the rest.

Every file found ends up in exactly one bucket: accepted (in the index, with its split),
quarantined (with a reason), or a duplicate of an accepted file. The index it writes is the
shard stage's only input besides the image bytes themselves. One file's inspection is
:mod:`tasks.ingest.inspection`'s; this module runs it over every file (in workers when it pays),
reusing what the previous run found, and places every image in a split.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tasks.contracts import handoff as handoff_store
from tasks.contracts.content import file_sha256
from tasks.contracts.handoff import HandoffWriter, Target
from tasks.contracts.index import (
    INDEX_VERSION,
    iter_records,
    iter_verdicts,
    read_header,
    write_index,
)
from tasks.contracts.near_duplicates import Item, confirmation_version, hash_version, place
from tasks.ingest.discovery import Candidate, discover
from tasks.ingest.inspection import (
    Inspected,
    Locator,
    Signature,
    inspect_chunk,
    inspect_file,
)
from tasks.ingest.refusals import refuse_a_lost_set, refuse_files_changed_since_read
from tasks.ingest.report import (
    DuplicateFile,
    NearDuplicates,
    QuarantinedFile,
    SortedFiles,
    VerdictCounts,
    build_report,
)
from tasks.runtime.atomic import write_json, write_text
from tasks.runtime.params import IngestParams
from tasks.runtime.processes import capped_workers, spawn_pool


def verdict_key(params: IngestParams) -> str:
    """What a decode verdict depends on besides the bytes: the limits, the decoder, and the
    perceptual hash and thumbnail taken from the decode."""
    from tasks.images import preprocessing_version

    return (
        f"max_pixels={params.max_pixels};min_side={params.min_side};"
        f"max_file_mb={params.max_file_mb};draft={params.draft_check};{preprocessing_version()};"
        f"{hash_version()};{confirmation_version()}"
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
        i.path: [i.sha256, i.format, i.width, i.height, i.reason, i.phash, i.thumb]
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


CHUNK = 64  # files per job sent to a worker


@dataclass(frozen=True)
class InspectionPlan:
    """How a run inspects its candidates: the decode limits, the chunks of new files for
    workers, and each unit of work's share of the hand-off bound."""

    limits: tuple[int, int, int, bool]  # max_pixels, min_side, max_bytes, draft
    chunks: list[list[int]]  # positions of the candidates without a known verdict
    workers: int
    parallel: bool
    shares: list[int]  # hand-off bytes: one per chunk, then this process's
    trusted_before: int | None  # files last changed before this may vouch by their stat

    @property
    def pool_size(self) -> int:
        return min(self.workers, len(self.chunks))


def plan_inspection(
    source_dir: Path, candidates: list[Candidate], params: IngestParams, known: dict[str, list[Any]]
) -> InspectionPlan:
    """Chunk the files without a ``known`` verdict; workers check them when there are two
    chunks or more and ``ingest.workers`` asks for two or more."""
    fresh = [i for i, c in enumerate(candidates) if c.path not in known]
    chunks = [fresh[i : i + CHUNK] for i in range(0, len(fresh), CHUNK)]
    workers = capped_workers(params.workers, "ingest.workers") if len(chunks) >= 2 else 1
    parallel = len(chunks) >= 2 and workers >= 2
    budget = int(params.handoff_mb * 2**20)
    return InspectionPlan(
        limits=(
            params.max_pixels,
            params.min_side,
            int(params.max_file_mb * 2**20),
            params.draft_check,
        ),
        chunks=chunks,
        workers=workers,
        parallel=parallel,
        shares=handoff_shares(budget, [len(c) for c in chunks], parallel, workers),
        # files whose stat may vouch for their bytes in the shard stage (write_signatures' rule)
        trusted_before=time.time_ns() - RACE_MARGIN_NS if params.trust_file_stat else None,
    )


class Tally:
    """Files inspected so far: moves the bar and tells ``progress(done, total)``."""

    def __init__(self, bar: Any, progress: Callable[[int, int], None] | None, total: int):
        self.bar, self.progress, self.total, self.done = bar, progress, total, 0

    def __call__(self, count: int) -> None:
        self.done += count
        self.bar.update(count)
        if self.progress:
            self.progress(self.done, self.total)


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
    decode, and a round trip to a worker would cost more than the hash.
    ``progress(done, total)`` is called as files finish (the flow moves its Prefect progress
    artifact with it).

    ``handoff``: the folder where the shard stage's pixels are kept and the shard params'
    target they are made for (:mod:`tasks.contracts.handoff`), ``ingest.handoff_mb`` in all. With
    workers, this process keeps a share of one worker's size and the chunks split the rest
    by their number of files, so the processes together never pass the bound.
    """
    from tqdm import tqdm

    known, trusted = known or {}, trusted or {}
    plan = plan_inspection(source_dir, candidates, params, known)
    results: list[Inspected | None] = [None] * len(candidates)
    with tqdm(total=len(candidates), desc="ingest", unit="img", mininterval=1.0) as bar:
        tally = Tally(bar, progress, len(candidates))
        with spawn_pool(plan.pool_size) if plan.parallel else nullcontext() as pool:
            futures = (
                [
                    pool.submit(
                        inspect_chunk,
                        str(source_dir),
                        [candidates[i] for i in chunk],
                        plan.limits,
                        (str(handoff[0]), share, handoff[1], plan.trusted_before)
                        if handoff is not None
                        else None,
                    )
                    for chunk, share in zip(plan.chunks, plan.shares, strict=False)
                ]
                if pool is not None
                else []
            )
            here = [i for i, c in enumerate(candidates) if pool is None or c.path in known]
            for block in inspect_here(source_dir, candidates, here, plan, known, trusted, handoff):
                for i, item in block:
                    results[i] = item
                tally(len(block))
            for chunk, future in zip(plan.chunks, futures, strict=False):
                for i, item in zip(chunk, future.result(), strict=True):
                    results[i] = item
                tally(len(chunk))
    missing = [candidates[i].path for i, r in enumerate(results) if r is None]
    if missing:  # a bug, never a data problem
        raise AssertionError(f"ingest lost files: {missing[:5]} not inspected")
    return [r for r in results if r is not None]


def inspect_here(
    source_dir: Path,
    candidates: list[Candidate],
    here: list[int],
    plan: InspectionPlan,
    known: dict[str, list[Any]],
    trusted: dict[str, Signature],
    handoff: tuple[Path, Target] | None,
) -> Iterator[list[tuple[int, Inspected]]]:
    """Inspect the candidates at positions ``here`` in this process, a chunk at a time
    (each chunk's ``(position, result)`` pairs, so progress moves as they finish)."""
    max_pixels, min_side, max_bytes, draft = plan.limits
    locator = Locator(source_dir, max_bytes)
    writer = (
        HandoffWriter(handoff[0], plan.shares[-1], handoff[1], plan.trusted_before)
        if handoff is not None
        else None
    )
    for start in range(0, len(here), CHUNK):
        yield [
            (
                i,
                inspect_file(
                    locator,
                    candidates[i],
                    max_pixels,
                    min_side,
                    draft,
                    known.get(candidates[i].path),
                    trusted.get(candidates[i].path),
                    writer,
                ),
            )
            for i in here[start : start + CHUNK]
        ]


def handoff_shares(budget: int, chunk_sizes: list[int], parallel: bool, workers: int) -> list[int]:
    """Bytes each unit of work may keep for the shard stage: one per chunk, then this
    process's (last); they sum to at most ``budget``. In one process it has it all."""
    if not parallel:
        return [0] * len(chunk_sizes) + [budget]
    here = budget // (min(workers, len(chunk_sizes)) + 1)
    files = max(1, sum(chunk_sizes))
    return [(budget - here) * n // files for n in chunk_sizes] + [here]


# How groups are given splits (tasks.contracts.near_duplicates.place): whole, each class
# keeping its share of every split. A new rule places every image afresh once.
PLACEMENT_RULE = "confirmed-groups;class-shares"


def placement_key(params: IngestParams) -> dict[str, Any]:
    """The rule a split was placed under: the hash and its confirmation, the near-duplicate
    distance, the placement rule, the seed and fractions. Placements are kept only while it
    stays the same."""
    return {
        "hash": hash_version(),
        "confirmation": confirmation_version(),
        "rule": PLACEMENT_RULE,
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
    sheets: Path | None = None,
) -> SortedFiles:
    """Sort inspected files into accepted / quarantined / duplicate, with splits.

    ``placed`` (sha256 -> split, see :func:`previous_placements`) are images already in
    shards; every other image is placed by :func:`tasks.contracts.near_duplicates.place`.
    ``sheets``: where the flagged groups' sheets go (the report names them)."""
    records, quarantined, duplicates = sort_by_content(inspected, classes)
    placement = place(
        [Item(r["sha256"], r["path"], r["label"], r["phash"], r["thumb"]) for r in records],
        placed or {},
        params.near_duplicate_distance,
        params.splits.model_dump(),
        params.seed,
    )
    for record in records:
        reason = placement.unplaceable.get(record["sha256"])
        if reason is not None:
            quarantined.append(
                QuarantinedFile(path=record["path"], label=record["label"], reason=reason)
            )
        record["split"] = placement.splits.get(record["sha256"])
    quarantined.sort(key=lambda q: q.path)
    return SortedFiles(
        records=[r for r in records if r["split"] is not None],
        quarantined=quarantined,
        duplicates=duplicates,
        near_duplicates=NearDuplicates.of(placement, params.near_duplicate_distance, sheets),
    )


def sort_by_content(
    inspected: list[Inspected], classes: list[str]
) -> tuple[list[dict[str, Any]], list[QuarantinedFile], list[DuplicateFile]]:
    """Index records (split not yet placed) of the first path of each content, the files
    quarantined and the duplicates of an accepted file. Content under two labels is
    quarantined in every copy: which label is right is the user's call."""
    quarantined = [
        QuarantinedFile(path=i.path, label=i.label, reason=i.reason) for i in inspected if i.reason
    ]
    good = [i for i in inspected if i.reason is None]
    by_hash: dict[str, list[Inspected]] = defaultdict(list)
    for item in good:
        by_hash[str(item.sha256)].append(item)
    records: list[dict[str, Any]] = []
    duplicates: list[DuplicateFile] = []
    for item in good:
        group = by_hash[str(item.sha256)]
        labels = sorted({g.label for g in group})
        if len(labels) > 1:
            reason = f"duplicate content with conflicting labels {labels}: " + ", ".join(
                g.path for g in group
            )
            quarantined.append(QuarantinedFile(path=item.path, label=item.label, reason=reason))
            continue
        keeper = group[0]  # inputs are sorted by path, so the first path wins
        if item is not keeper:
            duplicates.append(
                DuplicateFile(path=item.path, label=item.label, duplicate_of=keeper.path)
            )
            continue
        records.append(index_record(item, classes.index(item.label)))
    return records, quarantined, duplicates


def index_record(item: Inspected, label_index: int) -> dict[str, Any]:
    """The index's row (JSON) for an accepted image; its split is placed once every image's
    neighbours are known."""
    return {
        "path": item.path,
        "label": item.label,
        "label_index": label_index,
        "sha256": item.sha256,
        "split": None,
        "format": item.format,
        "width": item.width,
        "height": item.height,
        "phash": item.phash,
        "thumb": item.thumb,
    }


# How this run reached its verdicts: in what run_ingest returns (the flow logs it), never in
# the report file (:class:`tasks.ingest.report.VerdictCounts`).
RUN_COUNTS = tuple(f.name for f in fields(VerdictCounts))


@dataclass(frozen=True)
class PreviousRun:
    """What the previous index lets this run reuse: decode verdicts (path -> verdict) made
    under the same limits, splits (sha256 -> split) placed under the same rule, and stat
    signatures that vouch for a file's content hash (only with verdicts to reuse)."""

    verdicts: dict[str, list[Any]]
    placements: dict[str, str]
    signatures: dict[str, Signature]

    @classmethod
    def read(cls, index_path: Path, params: IngestParams) -> PreviousRun:
        verdicts = previous_verdicts(index_path, verdict_key(params))
        return cls(
            verdicts=verdicts,
            placements=previous_placements(index_path, placement_key(params)),
            signatures=previous_signatures(index_path, params) if verdicts else {},
        )


def run_ingest(
    params: IngestParams,
    index_path: Path,
    report_path: Path,
    progress: Callable[[int, int], None] | None = None,
    handoff: Path | None = None,
    target: Target | None = None,
    excluded: frozenset[str] = frozenset(),
    sheets: Path | None = None,
) -> dict[str, Any]:
    """Ingest ``params.source_dir``; write the index and the ingest report; return the report
    as JSON with this run's :class:`~tasks.ingest.report.VerdictCounts` (what the flow logs).

    ``progress(done, total)``: files inspected so far, see :func:`inspect_all`. ``handoff``:
    the hand-off root (``Layout.handoff``): emptied, then filled with the shard stage's pixels
    of this run's decodes for ``target`` (:meth:`tasks.contracts.handoff.Target.of` the shard
    params; none without one), up to ``ingest.handoff_mb`` (:mod:`tasks.contracts.handoff`).
    ``excluded``: content hashes never admitted (:mod:`tasks.contracts.exclusions`), counted
    and named nowhere."""
    source_dir = Path(params.source_dir)
    discovered = discover(source_dir, Path(params.labels_csv) if params.labels_csv else None)
    previous = PreviousRun.read(index_path, params)
    started_ns = time.time_ns()
    kept = emptied_handoff(handoff, target)
    inspected = inspect_all(
        source_dir,
        discovered.candidates,
        params,
        previous.verdicts,
        progress,
        previous.signatures,
        kept,
    )
    refuse_files_changed_since_read(source_dir, inspected)  # before the index changes
    inspected, excluded_count = drop_excluded(inspected, excluded, kept)
    classes = sorted({c.label for c in discovered.candidates})
    sorted_out = build_index(inspected, classes, params, previous.placements, sheets)
    present = {r["label"] for r in sorted_out.records}
    refuse_a_lost_set(inspected, present, params)  # before the index or any shard changes
    classes = [c for c in classes if c in present]  # a class whose files all failed is dropped
    for record in sorted_out.records:
        record["label_index"] = classes.index(record["label"])
    report = build_report(params.source_dir, classes, discovered, sorted_out, excluded_count)
    index_sha256 = write_index(
        index_path,
        {
            "version": INDEX_VERSION,
            "source_dir": params.source_dir,
            "classes": classes,
            "records": sorted_out.records,
            "verdict_key": verdict_key(params),
            "placement": placement_key(params),
            "verdicts": verdicts_of(inspected),
        },
    )
    write_signatures(index_path, index_sha256, inspected, started_ns)
    draw_flagged(source_dir, sorted_out)
    written = report.as_json()
    write_json(report_path, written)
    return {**written, **asdict(VerdictCounts.of(inspected))}


def draw_flagged(source_dir: Path, sorted_out: SortedFiles) -> None:
    """Draw the sheet of every flagged near-duplicate group the report names one for."""
    from tasks.ingest.group_sheets import write_group_sheet

    labels = {str(r["path"]): str(r["label"]) for r in sorted_out.records}
    hashes = {str(r["path"]): str(r["sha256"]) for r in sorted_out.records}
    for group in sorted_out.near_duplicates.flagged:
        if group.sheet is not None:
            write_group_sheet(source_dir, group.model_dump(), labels, hashes, Path(group.sheet))


def emptied_handoff(handoff: Path | None, target: Target | None) -> tuple[Path, Target] | None:
    """Empty the hand-off root (an earlier run's leftovers: never more than the bound) and
    name the folder this run keeps pixels in for ``target``; None when it keeps none."""
    if handoff is None:
        return None
    from tasks.images import preprocessing_version

    handoff_store.clear(handoff)
    if target is None:
        return None
    return handoff_store.folder_for(handoff, preprocessing_version()), target


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


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-class table (class, train, val, test, total) for artifacts and README."""
    rows = []
    for cls in report["classes"]:
        c = report["counts"][cls]
        rows.append({"class": cls, **c, "total": sum(c.values())})
    return rows
