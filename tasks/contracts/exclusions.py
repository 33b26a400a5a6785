"""The exclusion list: ``data/excluded.json`` (git-tracked), content hashes ingest never
admits again, whatever ``source_dir`` holds.

``shardflow forget`` adds the hashes it removes, so a rebuild never brings an image back
from a folder the project may not write (read-only, shared, mounted), nor from a clone
that still has the file. It holds hashes only: a file name can itself be personal. The
ingest stage depends on it in ``dvc.yaml``, so adding a hash reruns ingest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tasks.runtime.atomic import write_text
from tasks.runtime.refusals import Refused


class ExclusionListRefused(Refused):
    """An exclusion list that cannot be read."""


def load_excluded(path: Path) -> frozenset[str]:
    """The excluded content hashes; none when the file is absent."""
    path = Path(path)
    if not path.is_file():
        return frozenset()
    try:
        hashes = json.loads(path.read_text())["sha256"]
        if not all(isinstance(h, str) and len(h) == 64 for h in hashes):
            raise ValueError("not a list of sha256 hex digests")
    except (ValueError, KeyError, TypeError) as error:
        raise ExclusionListRefused(
            f"{path}: key 'sha256' must be a list of content hashes ({error})",
            fix=f"git checkout -- {path.name} (or fix the list by hand)",
        ) from None
    return frozenset(hashes)


def add_excluded(path: Path, hashes: Iterable[str]) -> bool:
    """Add ``hashes`` to the list (sorted, written atomically); whether it changed."""
    before = load_excluded(path)
    after = before | set(hashes)
    if after == before and Path(path).is_file():
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(Path(path), json.dumps({"sha256": sorted(after)}, indent=2) + "\n")
    return True
