"""The ingest report (``reports/ingest.json``): where every file found went, as typed records.

Every file found ends up in one bucket: accepted, quarantined (with a reason), a duplicate of
an accepted file, skipped (not an image of a class) or excluded (its content is on the
exclusion list, never named). The report is built here from what the stage sorted out and
serializes to the JSON the evaluate stage and the flow read: sorted keys, so a field's order
in these models never moves a byte.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tasks.contracts.content import SPLITS, display_name
from tasks.contracts.near_duplicates import Placement
from tasks.ingest.discovery import Discovered
from tasks.ingest.inspection import Inspected


class ReportEntry(BaseModel):
    """A record of the report: frozen, and no key it does not name."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class QuarantinedFile(ReportEntry):
    """A file kept out of the index, with why."""

    path: str
    label: str
    reason: str


class DuplicateFile(ReportEntry):
    """A file whose content another accepted file (``duplicate_of``) already brings."""

    path: str
    label: str
    duplicate_of: str


class SkippedEntry(ReportEntry):
    """An entry of the source that is no image of a class (hidden, outside the classes)."""

    path: str
    reason: str


class DroppedClass(ReportEntry):
    """A class the source names that has no accepted image, with why."""

    name: str = Field(alias="class")
    reason: str


class NearDuplicateGroup(ReportEntry):
    """Images within the near-duplicate distance of each other, all in one split."""

    split: str
    paths: list[str]
    labels: list[str]


class FlaggedGroup(NearDuplicateGroup):
    """A group that spans classes or holds more than 1% of the images: placed whole like
    every group, but shown to the user, who can tell copies from look-alikes at a glance."""

    why: str
    sheet: str | None  # its contact sheet (None when the run drew none)
    inspect: str  # what to do next


class NearDuplicates(ReportEntry):
    """The near-duplicate groups placement found, and the figures that flag trouble."""

    distance: int
    group_count: int
    images_in_groups: int
    # a chain of near-duplicates is one group: a huge one skews the split fractions
    largest_group: int
    label_conflict_count: int
    groups: list[NearDuplicateGroup]
    # near-duplicates with different labels: one of them is probably mislabelled
    label_conflicts: list[NearDuplicateGroup]
    # groups spanning classes or holding more than 1% of the images, with their sheets (in
    # the report only when there are some: a set without keeps its report's bytes)
    flagged: list[FlaggedGroup] = Field(default_factory=list)

    @classmethod
    def of(cls, placement: Placement, distance: int, sheets: Path | None = None) -> NearDuplicates:
        """The report's account of ``placement``; ``sheets``: the folder the flagged groups'
        sheets are drawn into (:func:`tasks.ingest.group_sheets.sheet_name`), if any."""
        groups = [NearDuplicateGroup.model_validate(g) for g in placement.groups]
        conflicts = [NearDuplicateGroup.model_validate(g) for g in placement.label_conflicts]
        sizes = [len(g.paths) for g in groups]
        images = len(placement.splits) + len(placement.unplaceable)
        return cls(
            distance=distance,
            group_count=len(groups),
            images_in_groups=sum(sizes),
            largest_group=max(sizes, default=0),
            label_conflict_count=len(conflicts),
            groups=groups,
            label_conflicts=conflicts,
            flagged=[
                flagged_group(group, k, images, sheets)
                for k, group in enumerate(placement.flagged, start=1)
            ],
        )


def flagged_group(group: dict[str, Any], k: int, images: int, sheets: Path | None) -> FlaggedGroup:
    """The ``k``-th flagged group's entry: why it is flagged, its sheet, what to do."""
    from tasks.ingest.group_sheets import sheet_name

    size, labels = len(group["paths"]), group["labels"]
    why = (
        f"spans {len(labels)} classes ({', '.join(labels)})"
        if len(labels) > 1
        else f"holds {size} of {images} images (more than 1%)"
    )
    sheet = str(sheets / sheet_name(k)) if sheets is not None else None
    look = f"open {sheet}" if sheet else "look at its images"
    inspect = (
        f"{look}: copies of one picture with two labels mean a label error (fix the label "
        "in the source); pictures that only look alike mean the relation is too loose "
        f"(lower ingest.near_duplicate_distance). `shardflow lineage {group['paths'][0]}` "
        "names the group's other images"
    )
    return FlaggedGroup(**group, why=why, sheet=sheet, inspect=inspect)


class IngestReport(ReportEntry):
    """``reports/ingest.json``: the classes, the split counts, and every file not accepted."""

    source_dir: str
    classes: list[str]
    classes_dropped: list[DroppedClass]
    files_found: int
    accepted: int
    quarantined_count: int
    duplicate_count: int
    skipped_count: int
    # files whose content is on the exclusion list (data/excluded.json): never named
    excluded_count: int
    counts: dict[str, dict[str, int]]  # class -> split -> accepted images
    split_counts: dict[str, int]
    formats: dict[str, int]
    quarantined: list[QuarantinedFile]
    duplicates: list[DuplicateFile]
    skipped: list[SkippedEntry]
    # groups of near-duplicate images, each kept in one split
    near_duplicates: NearDuplicates

    def as_json(self) -> dict[str, Any]:
        """The report as ``reports/ingest.json`` holds it (``near_duplicates.flagged`` only
        when a group is flagged)."""
        written = self.model_dump(mode="json", by_alias=True)
        if not written["near_duplicates"]["flagged"]:
            del written["near_duplicates"]["flagged"]
        return written

    def unaccounted(self) -> int:
        """Files found that no bucket holds: always 0 unless ingest has a bug."""
        buckets = (
            self.accepted,
            self.quarantined_count,
            self.duplicate_count,
            self.skipped_count,
            self.excluded_count,
        )
        return self.files_found - sum(buckets)


@dataclass(frozen=True)
class VerdictCounts:
    """How this run reached its verdicts: what the flow logs, never in the report file,
    which evaluate depends on (a rerun that changed no verdict changes no byte)."""

    reused_count: int  # incremental ingest: verdicts reused from the previous index
    decoded_count: int  # files decoded now
    stat_trusted_count: int  # of the reused: hash taken on an unchanged stat, file not read

    @classmethod
    def of(cls, inspected: list[Inspected]) -> VerdictCounts:
        return cls(
            reused_count=sum(1 for i in inspected if i.reused),
            decoded_count=sum(1 for i in inspected if i.sha256 is not None and not i.reused),
            stat_trusted_count=sum(1 for i in inspected if i.trusted),
        )


@dataclass(frozen=True)
class SortedFiles:
    """Inspected files sorted into the index's records (JSON rows, split placed) and the
    report's quarantined files, duplicates and near-duplicate groups."""

    records: list[dict[str, Any]]
    quarantined: list[QuarantinedFile]
    duplicates: list[DuplicateFile]
    near_duplicates: NearDuplicates


def classes_dropped(discovered: Discovered, present: Iterable[str]) -> list[DroppedClass]:
    """The classes the source names that have no accepted image, each with why: the model
    will not know them, which the report must say rather than leave to be noticed."""
    files = Counter(candidate.label for candidate in discovered.candidates)
    dropped = []
    for label in sorted(set(discovered.labels) - set(present)):
        if files[label]:
            reason = f"none of its {files[label]} files accepted (quarantined or duplicates)"
        else:
            reason = "no files in its folder"
        dropped.append(
            DroppedClass.model_validate({"class": display_name(label), "reason": reason})
        )
    return dropped


def build_report(
    source_dir: str,
    classes: list[str],
    discovered: Discovered,
    sorted_out: SortedFiles,
    excluded_count: int,
) -> IngestReport:
    """The report of an ingest whose accepted ``classes`` and records are final; refuses
    (as a bug, never a data problem) a report that loses a file."""
    records = sorted_out.records
    counts = {c: {s: 0 for s in SPLITS} for c in classes}
    for record in records:
        counts[record["label"]][record["split"]] += 1
    report = IngestReport(
        source_dir=source_dir,
        classes=classes,
        classes_dropped=classes_dropped(discovered, classes),
        files_found=len(discovered.candidates) + len(discovered.skipped),
        accepted=len(records),
        quarantined_count=len(sorted_out.quarantined),
        duplicate_count=len(sorted_out.duplicates),
        skipped_count=len(discovered.skipped),
        excluded_count=excluded_count,
        counts=counts,
        split_counts={s: sum(counts[c][s] for c in classes) for s in SPLITS},
        formats=dict(sorted(Counter(str(r["format"]) for r in records).items())),
        quarantined=sorted_out.quarantined,
        duplicates=sorted_out.duplicates,
        skipped=[SkippedEntry.model_validate(s) for s in discovered.skipped],
        near_duplicates=sorted_out.near_duplicates,
    )
    if report.unaccounted():  # a bug, never a data problem
        raise AssertionError(
            f"ingest lost files: {report.files_found - report.unaccounted()} accounted of "
            f"{report.files_found} found"
        )
    return report
