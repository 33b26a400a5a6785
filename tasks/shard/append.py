"""Append checks: what a new generation may build on (``shard.mode: append``).

An append only adds records, written exactly like the base's; anything else (a record removed,
changed or moved, other params or preprocessing) raises :class:`RebuildNeeded` naming the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import numpy as np

from tasks.contracts import shard_changes as data_diff
from tasks.contracts.index import iter_records
from tasks.contracts.manifest import (
    MANIFEST_NAME,
    SPLITS,
    ShardManifest,
    load_manifest,
    stream_records,
)
from tasks.images import preprocessing_version
from tasks.runtime.params import ShardParams
from tasks.runtime.refusals import Refused
from tasks.shard.spec import schema_from_params

REBUILD_HINT = "set shard.mode: rebuild in params.yaml (or run `make compact`)"


class RebuildNeeded(Refused, ValueError):
    """``shard.mode: append`` cannot express this change; ``shard.mode: rebuild`` can."""

    fix = REBUILD_HINT


# The set dvc.lock records is in this clone's DVC cache when the clone built it (the folder
# was deleted, or a fresh clone never checked it out) and in the remote once pushed.
RESTORE_HINT = (
    "restore the set dvc.lock records with `dvc checkout data/shards` (from this clone's DVC "
    "cache) or `dvc pull data/shards` (from the remote; a fresh clone has only its hash)"
)


def load_base(shards_dir: Path) -> ShardManifest:
    """The manifest an append builds on; missing, the stage stops and names the fix."""
    if not (shards_dir / MANIFEST_NAME).exists():
        raise FileNotFoundError(
            f"{shards_dir / MANIFEST_NAME}: shard.mode is append but the base shard set is "
            f"not here; {RESTORE_HINT}, or set shard.mode: rebuild to build the whole set again"
        )
    base = load_manifest(shards_dir)
    for info in base.splits.values():
        for shard in info.shards:
            path = shards_dir / shard.file
            if not path.is_file() or path.stat().st_size != shard.bytes:
                raise FileNotFoundError(
                    f"{path}: a base shard is missing or incomplete; {RESTORE_HINT}, or set "
                    "shard.mode: rebuild"
                )
    return base


def check_compatible(base: ShardManifest, params: ShardParams, shards_dir: Path) -> None:
    """An append must write records exactly like the base's: same schema and preprocessing."""
    now = {
        "schema": schema_from_params(params).to_dict(),
        "compression": params.compression,
        "resize": params.resize,
        # decoded at reduced size or not: one manifest flag tells serving which, for all
        "draft_decode": params.draft_decode,
        "preprocessing_version": preprocessing_version(),
    }
    then = {
        "schema": dict(base.schema_),
        "compression": base.compression,
        "resize": base.resize,
        "draft_decode": base.draft_decode,
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


def base_table(shards_dir: Path, base: ShardManifest) -> data_diff.SpilledTable:
    """Every record of the base shard set, from its record lists (sha256 checked), spilled
    under ``shards_dir``."""
    records = data_diff.rows(base, stream_records(shards_dir, base))
    return data_diff.SpilledTable.of(shards_dir, records, expected=base.total_records)


def check_nothing_removed(
    current: data_diff.AnyTable,
    base: ShardManifest,
    before: data_diff.AnyTable,
    shards_dir: Path,
    index_path: Path,
) -> list[dict[str, str]]:
    """Refuse when a base record (``before``) is gone from the index (``current``, every
    index record in index order) or has moved to another class or split; return the base
    records whose content the index now holds under another path (the diff's duplicates:
    the append keeps the record it has, and the diff names both paths).

    Append never removes or rewrites a record: an image deleted or edited since the base
    (its old content is gone), quarantined now, or moved, needs a rebuild. Compared as
    columns, a bucket of content hashes at a time (a binary search per base record); paths
    are read back only for the records a message or the duplicates name.
    """
    problems = 0
    shown: list[tuple[int, str | None]] = []  # (base position, where it went; None: gone)
    renamed: list[tuple[int, int]] = []  # (base position, index position)
    for (old, old_at), (now, now_at) in zip(before.buckets(), current.buckets(), strict=True):
        found, match, same = data_diff.locate(old, now)
        bad = np.flatnonzero(~same)
        problems += len(bad)
        for i in bad[:SHOWN]:
            j = int(match[i])
            to = f"{now.names[now.labels[j]]}/{SPLITS[now.splits[j]]}" if found[i] else None
            was = f"{old.names[old.labels[i]]}/{SPLITS[old.splits[i]]}"
            shown.append((int(old_at[i]), f"{was} to {to}" if to else None))
        shown = sorted(shown)[:SHOWN]
        if problems or not len(now):
            continue
        moved = np.flatnonzero(now.path_digest_array()[match] != old.path_digest_array())
        renamed += [(int(old_at[i]), int(now_at[match[i]])) for i in moved]
    if problems:
        refuse_removed(problems, shown, base, shards_dir)
    return renamed_records(sorted(renamed), base, shards_dir, index_path)


def refuse_removed(
    problems: int, shown: list[tuple[int, str | None]], base: ShardManifest, shards_dir: Path
) -> NoReturn:
    """Refuse the append, naming the base records ``shown`` (base position, where it went;
    None: gone) by path: their paths are read back from the base's record lists."""
    paths = _paths_at(
        (entry["path"] for _, entry in stream_records(shards_dir, base)), (i for i, _ in shown)
    )
    reasons = [
        f"{paths[i]} moved from {to}"
        if to
        else f"{paths[i]} removed, changed or quarantined (see the ingest report)"
        for i, to in shown
    ]
    raise RebuildNeeded(
        f"{shards_dir}: {problems} record(s) of the base shard set no longer match "
        f"the sources ({'; '.join(reasons)}); append only adds records: "
        f"{REBUILD_HINT}"
    )


def renamed_records(
    renamed: list[tuple[int, int]], base: ShardManifest, shards_dir: Path, index_path: Path
) -> list[dict[str, str]]:
    """The base records (base position, index position, in order) whose content the index
    holds under another path, each as the diff's duplicate entry (both paths)."""
    if not renamed:
        return []
    old_paths = _paths_at(
        (entry["path"] for _, entry in stream_records(shards_dir, base)), (i for i, _ in renamed)
    )
    new_paths = _paths_at((r["path"] for _, r in iter_records(index_path)), (j for _, j in renamed))
    return [
        {"path": new_paths[j], "same_content_as": old_paths[i]}
        for i, j in renamed
        if new_paths[j] != old_paths[i]
    ]


SHOWN = 5  # base records a refusal names


def _paths_at(paths: Iterable[str], positions: Iterable[int]) -> dict[int, str]:
    """The paths at these positions of a stream of paths (read to its end)."""
    wanted = {int(p) for p in positions}
    return {i: path for i, path in enumerate(paths) if i in wanted}
