"""The data gate: these shards against the last accepted version of their dataset.

``data/accepted.json`` holds one accepted version per dataset (keyed by
:func:`tasks.runtime.dataset_identity.dataset_identity`: what ``params.yaml`` names as the source):
fingerprint, records per split and class, and who accepted it, when and why. The validate
stage records it when a shard set passes validation (the first validated set of a dataset the
record has no version of becomes its baseline), or one explicit step, :func:`accept`
(``shardflow accept-data``), does when a change the limits refuse is deliberate. Switching to
another dataset is never a change of data: it is gated against that dataset's own baseline,
or starts one. It is small and committed with ``dvc.lock``, so a killed run,
a rebuild (`make compact`, `dvc repro -f shard`) and a fresh clone all compare against the
same baseline: never against whatever manifest the shard folder happens to hold. The limits
(``validate.max_class_share_shift``, ``validate.max_record_drop``,
``validate.allow_new_classes``) apply to
:func:`compare`'s diff and stay as they are when a change is accepted.

Everything comes from the manifest, so the gate adds no pass over the data to validation:
record-level changes and image sizes are in the shard stage's ``reports/shard_changes.json``
(:mod:`tasks.contracts.shard_changes`), which reads every record list.
"""

from __future__ import annotations

import getpass
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.contracts.manifest import SPLITS, ShardManifest, load_manifest
from tasks.contracts.shard_changes import class_shares
from tasks.runtime.atomic import write_json, write_text
from tasks.runtime.params import ValidateParams
from tasks.runtime.refusals import Refused
from tasks.validate.checks import check

# 2: one accepted version per dataset; 1 (still read): a single version with no dataset
RECORD_FORMAT: Literal[2] = 2
ACCEPT_COMMAND = "shardflow accept-data"
MIN_FINGERPRINT_PREFIX = 8


class Acceptance(BaseModel):
    """Why a version became the baseline: validation passed it, or a person accepted it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    how: Literal["first build", "validation passed", "accepted"]
    # who and when (UTC, ISO 8601 to the second) for an explicit acceptance; None when
    # validation passed it, so the validate stage's output is a function of its inputs (a
    # clone that rebuilds it gets the same bytes, and `dvc status` stays clean); the commit
    # that holds the record says when
    by: str | None
    at: str | None
    reason: str
    previous_fingerprint: str | None


class DataVersion(BaseModel):
    """What the gate compares: a shard set's records per split and class."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fingerprint: str
    class_counts: dict[str, dict[str, int]]  # split -> class -> records (classes with any)

    def counts(self) -> dict[str, int]:
        """Records per class over every split."""
        total: dict[str, int] = {}
        for per_class in self.class_counts.values():
            for name, n in per_class.items():
                total[name] = total.get(name, 0) + n
        return {name: n for name, n in total.items() if n}


class AcceptedVersion(DataVersion):
    """A dataset's accepted version in ``data/accepted.json``."""

    acceptance: Acceptance


class AcceptedRecord(BaseModel):
    """``data/accepted.json``: the accepted version of each dataset, by its identity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[2]
    datasets: dict[str, AcceptedVersion]


class LegacyAcceptedVersion(AcceptedVersion):
    """A format-1 record: one version, no dataset named."""

    format: Literal[1]


class BeforeAfter(BaseModel):
    """A count in the accepted version and in these shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    before: int
    after: int


class ShareShift(BaseModel):
    """A class's share of the records before and after, and its shift (6 places)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    before: float
    after: float
    shift: float


class LargestShift(BaseModel):
    """The class whose share moved most, and by how much."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(alias="class")
    shift: float


class DataDiff(BaseModel):
    """``reports/data_diff.json``: these shards against their dataset's accepted version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str
    fingerprint: str
    accepted_fingerprint: str | None  # None: nothing accepted yet, nothing to compare
    accepted: Acceptance | None
    unchanged: bool
    records: BeforeAfter
    counts: dict[str, dict[str, BeforeAfter]]  # split -> class -> records
    new_classes: list[str]
    removed_classes: list[str]
    class_share: dict[str, ShareShift]
    largest_share_shift: LargestShift | None

    def as_json(self) -> dict[str, Any]:
        """The diff as ``reports/data_diff.json`` holds it."""
        return self.model_dump(mode="json", by_alias=True)


@dataclass(frozen=True)
class Gated:
    """What one validation's data gate found: the diff it wrote, the version of these
    shards, and the dataset's accepted version it compared them with (None: none yet)."""

    diff: DataDiff
    version: DataVersion
    accepted: AcceptedVersion | None


class AcceptedRecordError(Refused, ValueError):
    """``data/accepted.json`` cannot be read: the gate has no baseline it can trust."""

    fix = "git checkout -- data/accepted.json"


def describe(manifest: ShardManifest) -> DataVersion:
    """The data version of a shard set, from its manifest (validation checks the manifest's
    class counts against the records themselves)."""
    counts = {
        split: {name: n for name, n in manifest.splits[split].class_counts.items() if n}
        for split in SPLITS
        if split in manifest.splits
    }
    return DataVersion(fingerprint=manifest.fingerprint, class_counts=counts)


def load_record(path: Path, dataset: str) -> AcceptedRecord:
    """Every dataset's accepted version recorded at ``path`` (none when the file is missing).

    A format-1 record names no dataset: it is read as ``dataset``'s, the one the run names,
    so a clone that upgrades keeps gating the data it gated (never a looser gate)."""
    path = Path(path)
    if not path.exists():
        return AcceptedRecord(format=RECORD_FORMAT, datasets={})
    try:
        raw = json.loads(path.read_text())
        if isinstance(raw, dict) and raw.get("format") == 1:
            legacy = LegacyAcceptedVersion.model_validate(raw)
            version = AcceptedVersion(**legacy.model_dump(exclude={"format"}))
            return AcceptedRecord(format=RECORD_FORMAT, datasets={dataset: version})
        return AcceptedRecord.model_validate(raw)
    except (OSError, ValidationError, ValueError) as exc:
        raise AcceptedRecordError(
            f"{path}: the accepted data version is unreadable ({exc}); restore it from git, "
            "or accept the current shards as the data baseline",
            fix=f"git checkout -- {path}   (or `{ACCEPT_COMMAND} --fingerprint FINGERPRINT "
            "--reason '...'`)",
        ) from exc


def load_accepted(path: Path, dataset: str) -> AcceptedVersion | None:
    """``dataset``'s accepted version recorded at ``path``; None when it has none yet."""
    return load_record(path, dataset).datasets.get(dataset)


def compare(accepted: AcceptedVersion | None, current: DataVersion, dataset: str) -> DataDiff:
    """The diff from ``dataset``'s accepted version to ``current``: records per split and
    class before and after (net counts: the baseline keeps no record lists), each class's
    share, new and removed classes. With nothing accepted yet there is nothing to compare."""
    before = accepted.counts() if accepted else {}
    after = current.counts()
    classes = list(after) + sorted(c for c in before if c not in after)
    shares, largest = class_shares(before, after, classes)
    old = accepted.class_counts if accepted else {}
    return DataDiff(
        dataset=dataset,
        fingerprint=current.fingerprint,
        accepted_fingerprint=accepted.fingerprint if accepted else None,
        accepted=accepted.acceptance if accepted else None,
        unchanged=accepted is not None and accepted.fingerprint == current.fingerprint,
        records=BeforeAfter(before=sum(before.values()), after=sum(after.values())),
        counts={
            split: {
                c: BeforeAfter(
                    before=old.get(split, {}).get(c, 0),
                    after=current.class_counts.get(split, {}).get(c, 0),
                )
                for c in classes
            }
            for split in SPLITS
        },
        new_classes=[c for c in after if c not in before] if accepted else [],
        removed_classes=[c for c in before if c not in after],
        class_share={name: ShareShift.model_validate(share) for name, share in shares.items()},
        largest_share_shift=LargestShift.model_validate(largest) if largest else None,
    )


def violations(diff: DataDiff, limits: ValidateParams) -> list[str]:
    """Why a change from the accepted version is too suspicious to train on, each reason
    naming the param it exceeds. Nothing accepted yet (a first build) never violates."""
    if diff.accepted_fingerprint is None or diff.unchanged:
        return []
    problems = []
    for name, share in diff.class_share.items():
        if abs(share.shift) > limits.max_class_share_shift:
            problems.append(
                f"class {name!r} share moved {share.before:.3f} -> {share.after:.3f} "
                f"({share.shift:+.3f}, limit validate.max_class_share_shift="
                f"{limits.max_class_share_shift:g})"
            )
    before, after = diff.records.before, diff.records.after
    # a shrink keeps every class's share: half the sources lost, or a failed sync
    if before and (before - after) / before > limits.max_record_drop:
        problems.append(
            f"records fell {before} -> {after} ({(after - before) / before:+.1%}, limit "
            f"validate.max_record_drop={limits.max_record_drop:g})"
        )
    if diff.new_classes and not limits.allow_new_classes:
        problems.append(f"new classes {diff.new_classes} (validate.allow_new_classes is false)")
    if diff.removed_classes:  # a lost source folder or a failed sync, until accepted
        problems.append(
            f"classes removed {diff.removed_classes}: the accepted version has records of "
            "them, these shards none"
        )
    return problems


def accept_command(fingerprint: str) -> str:
    """The command that accepts a refused change that is deliberate."""
    return f"{ACCEPT_COMMAND} --fingerprint {fingerprint[:12]} --reason '...'"


def accept_hint(fingerprint: str) -> str:
    """What a user runs when a refused change is deliberate."""
    return (
        f"if the change is deliberate, accept these shards as the baseline: "
        f"`{accept_command(fingerprint)}` (recorded in data/accepted.json; the limits in "
        "params.yaml stay as they are), then rerun"
    )


def record(
    path: Path,
    version: DataVersion,
    *,
    dataset: str,
    how: Literal["first build", "validation passed", "accepted"],
    reason: str,
    by: str | None = None,
    previous: AcceptedVersion | None = None,
    others: AcceptedRecord | None = None,
) -> AcceptedVersion:
    """Write ``version`` as ``dataset``'s accepted one, with why; an explicit acceptance also
    with who (``by``, default the login name) and when. Other datasets' versions (read from
    ``path``, or ``others`` when given) are kept as they are."""
    explicit = how == "accepted"
    acceptance = Acceptance(
        how=how,
        by=(by or current_user()) if explicit else None,
        at=datetime.now(UTC).isoformat(timespec="seconds") if explicit else None,
        reason=reason,
        previous_fingerprint=previous.fingerprint if previous else None,
    )
    accepted = AcceptedVersion(**version.model_dump(), acceptance=acceptance)
    kept = (others if others is not None else load_record(path, dataset)).datasets
    whole = AcceptedRecord(format=RECORD_FORMAT, datasets={**kept, dataset: accepted})
    write_json(Path(path), whole.model_dump())
    return accepted


def first_version_reason(dataset: str) -> str:
    """Why a dataset's first validated shard set became its baseline."""
    return f"the first validated shard set of dataset {dataset!r}: no version of it accepted before"


def record_passed(path: Path, gated: Gated, dataset: str) -> AcceptedVersion | None:
    """After validation passed: the version ``gated`` compared becomes ``dataset``'s baseline
    unless it already is (an unchanged set leaves the record, and its bytes, as they are)."""
    version, previous, diff = gated.version, gated.accepted, gated.diff
    if previous is not None and previous.fingerprint == version.fingerprint:
        return None
    if previous is None:
        reason = first_version_reason(dataset)
        return record(path, version, dataset=dataset, how="first build", reason=reason)
    largest = diff.largest_share_shift
    shift, name = (largest.shift, largest.name) if largest else (0.0, None)
    reason = (
        f"within validate's limits: {diff.records.after - diff.records.before:+d} "
        f"records net, largest share shift {shift:+.3f} ({name})"
    )
    return record(
        path, version, dataset=dataset, how="validation passed", reason=reason, previous=previous
    )


class AcceptRefused(Refused, ValueError):
    """``shardflow accept-data`` cannot accept what it was asked to."""

    fix = "run the `shardflow accept-data ...` command the validation refusal printed"


def accept(
    shards_dir: Path,
    path: Path,
    *,
    dataset: str,
    fingerprint: str,
    reason: str,
    by: str | None = None,
) -> AcceptedVersion:
    """The one explicit step that accepts a change the limits refuse: the shard set in
    ``shards_dir`` becomes ``dataset``'s baseline, recorded with who, when and why.

    ``fingerprint`` names the set being accepted (a prefix of 8 characters or more, as the
    validation error prints it): a set that changed since is refused, not accepted unseen.
    """
    shards_dir, path = Path(shards_dir), Path(path)
    if not reason.strip():
        raise AcceptRefused(
            "accepting a data change needs a reason",
            fix=f"{accept_command(fingerprint)} with a --reason that says why",
        )
    if len(fingerprint) < MIN_FINGERPRINT_PREFIX:
        raise AcceptRefused(
            f"--fingerprint {fingerprint!r}: give at least {MIN_FINGERPRINT_PREFIX} characters "
            "of the fingerprint the validation error names",
            fix="copy the `shardflow accept-data ...` command the validation refusal printed",
        )
    try:
        manifest = load_manifest(shards_dir)
    except FileNotFoundError as exc:
        raise AcceptRefused(
            f"{shards_dir}: no shard set to accept ({exc}): validation names the change and "
            "its fingerprint",
            fix="shardflow run",
        ) from exc
    if not manifest.fingerprint.startswith(fingerprint):
        raise AcceptRefused(
            f"{shards_dir} holds shards {manifest.fingerprint[:12]}, not {fingerprint}: the "
            "shards changed since",
            fix="shardflow run, then accept what validation names",
        )
    try:
        whole = load_record(path, dataset)
    except AcceptedRecordError:  # accepting is also how an unreadable record is replaced
        whole = AcceptedRecord(format=RECORD_FORMAT, datasets={})
    return record(
        path,
        describe(manifest),
        dataset=dataset,
        how="accepted",
        reason=reason.strip(),
        by=by,
        previous=whole.datasets.get(dataset),
        others=whole,
    )


def current_user() -> str:
    """Who runs this: the login name (what a run's log and the record name)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (a bare container)
        return "unknown"


def write(diff: DataDiff, path: Path) -> None:
    """``path`` (JSON) and its ``.md`` sibling (the summary a Prefect artifact shows)."""
    write_json(Path(path), diff.as_json())
    write_text(Path(path).with_suffix(".md"), summary_markdown(diff))


def summary_markdown(diff: DataDiff) -> str:
    """The baseline and how it was accepted, records per split and class, shares."""
    accepted = diff.accepted
    base = (diff.accepted_fingerprint or "none")[:12]
    lines = [f"# Data diff: accepted `{base}` -> `{diff.fingerprint[:12]}`", ""]
    lines.append(f"- dataset: `{diff.dataset}` (`ingest.source_dir`, `ingest.labels_csv`)")
    if accepted:
        who = f" by {accepted.by} at {accepted.at}" if accepted.by else ""
        lines.append(f"- baseline: {accepted.how}{who}: {accepted.reason}")
    else:
        lines.append(
            "- baseline: none accepted for this dataset yet: these shards become its baseline "
            "once they pass validation"
        )
    lines += [
        f"- records: {diff.records.before} -> {diff.records.after}",
        f"- new classes: {', '.join(diff.new_classes) or 'none'}; "
        f"removed classes: {', '.join(diff.removed_classes) or 'none'}",
        "",
        "| class | " + " | ".join(SPLITS) + " | share before | after | shift |",
        "|---|" + "---|" * (len(SPLITS) + 3),
    ]
    for name, share in diff.class_share.items():
        cells = [f"{diff.counts[s][name].before} -> {diff.counts[s][name].after}" for s in SPLITS]
        lines.append(
            f"| {name} | {' | '.join(cells)} | {share.before:.3f} | {share.after:.3f} "
            f"| {share.shift:+.3f} |"
        )
    lines += ["", "Changes image by image, and image sizes: `reports/shard_changes.md`."]
    return "\n".join(lines) + "\n"


# -- the validate stage's check -----------------------------------------------------------


def check_data_diff(diff: DataDiff, limits: ValidateParams) -> dict[str, Any]:
    """The change from the last accepted data version (:func:`compare`) stays within the
    params' limits; a refused change names the one step that accepts it.

    A pass reads the same whatever the baseline was: a passing validation makes its set the
    accepted version, and train and evaluate depend on this report, so a pass worded after
    the baseline ("N -> M records since ...", then "the accepted version" when the same
    shards were validated again) would retrain on them. What changed since the baseline is in
    ``reports/data_diff.{json,md}``, written by the same run.
    """
    problems = violations(diff, limits)
    ok = "within the data gate's limits (reports/data_diff.md: the change from the baseline)"
    bad = (
        f"{'; '.join(problems)}: against the accepted data version "
        f"{str(diff.accepted_fingerprint)[:12]} (see reports/data_diff.md); "
        + accept_hint(diff.fingerprint)
    )
    details: dict[str, Any] = {"diff": "reports/data_diff.json"}
    if problems:
        details |= {
            "accepted_fingerprint": diff.accepted_fingerprint,
            "records_before": diff.records.before,
            "records_after": diff.records.after,
        }
    return check("data_diff", problems, ok, bad, **details)


def gate_diff(manifest: ShardManifest, accepted_path: Path, diff_path: Path, dataset: str) -> Gated:
    """These shards against ``dataset``'s accepted version at ``accepted_path``, written to
    ``diff_path`` (JSON and Markdown), with the version and the accepted one."""
    accepted = load_accepted(accepted_path, dataset)
    version = describe(manifest)
    diff = compare(accepted, version, dataset)
    write(diff, diff_path)
    return Gated(diff=diff, version=version, accepted=accepted)


@dataclass(frozen=True)
class GateSetup:
    """Where the data gate reads its baseline and writes its diff, its limits, and the
    dataset (:func:`tasks.runtime.dataset_identity.dataset_identity`) it gates."""

    accepted_path: Path
    diff_path: Path
    limits: ValidateParams
    dataset: str


def check_gate(manifest: ShardManifest, gate: GateSetup) -> tuple[dict[str, Any], Gated | None]:
    """The ``data_diff`` check of these shards, and what the gate found (None when the
    accepted record is unreadable: the check fails and names how to restore it)."""
    try:
        gated = gate_diff(manifest, gate.accepted_path, gate.diff_path, gate.dataset)
    except AcceptedRecordError as exc:
        message = f"{exc}: {exc.fix}"
        return check("data_diff", [message], "", message), None
    return check_data_diff(gated.diff, gate.limits), gated
