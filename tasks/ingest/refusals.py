"""What ingest refuses before it writes anything: a source that changed while it read it,
and an ingest that would keep no image, or none of a class because of an ``ingest`` limit.
Refusing here leaves the index, the shards and DVC's record as they were."""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from pathlib import Path

from tasks.ingest.inspection import Inspected, Signature, signature
from tasks.runtime.params import IngestParams
from tasks.runtime.refusals import Refused


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
