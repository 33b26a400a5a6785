"""What a shard run changed: the diff from the manifest it found to the one it wrote.

The shard stage writes it (``reports/shard_changes.json`` plus a Markdown summary) for every
run, against the manifest that was there before: images added and removed per class and split,
each class's share before and after, new classes, the image size and aspect distributions
recorded at ingest, and images that came back under another name. It says what one run did to
the shard folder; it gates nothing. The gate compares against the last accepted data version
instead (:mod:`tasks.data_gate`, ``reports/data_diff.json``): a killed run or a rebuild leaves
no manifest, or an unaccepted one, to compare against.

Pure functions of the two manifests and their record lists (``tasks.manifest.stream_records``),
held as compact columns (:class:`Table`): no shard is read.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from hashlib import blake2b
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tasks.atomic import write_json, write_text
from tasks.manifest import SPLITS, ShardManifest

QUANTILES = (0.1, 0.5, 0.9)
_SPLIT_CODES = {split: i for i, split in enumerate(SPLITS)}


class Row(NamedTuple):
    """One record of a shard set, as the diff sees it (a tuple: 100k of them take 0.06 s to
    build, as frozen dataclasses 0.11 s)."""

    sha256: str
    path: str
    split: str
    label: str
    width: int
    height: int


def rows(manifest: ShardManifest, entries: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[Row]:
    """The manifest's records from ``(shard file, record)`` pairs of its record lists
    (:func:`tasks.manifest.stream_records`)."""
    split_of = {
        shard.file: split for split, info in manifest.splits.items() for shard in info.shards
    }
    for file, entry in entries:
        split = split_of.get(file)
        if split is None:
            raise ValueError(f"record list names shard {file!r}, which the manifest does not hold")
        yield Row(
            entry["sha256"],
            entry["path"],
            split,
            manifest.classes[int(entry["label_index"])],
            int(entry["width"]),
            int(entry["height"]),
        )


class Table:
    """Records as columns: the content hash (32 bytes), split, class, width, height and a
    digest of the path (8 bytes: two paths that differ show; their names are read back
    before anything reports them), 43 bytes a record. What the diff and an append's checks
    need of a shard set or an index: a million records as parsed dicts held about 450 MB,
    as rows about 90 MB more; as a table, 43 MB."""

    def __init__(self) -> None:
        self.hashes = bytearray()
        self.path_digests = bytearray()
        self.splits = array("B")
        self.labels = array("H")
        self.widths = array("I")
        self.heights = array("I")
        self.names: list[str] = []  # class names, in order of first appearance
        self._codes: dict[str, int] = {}

    @classmethod
    def of(cls, records: Iterable[Row], expected: int | None = None) -> Table:
        """A table of ``records``; with ``expected``, a count that differs raises ValueError."""
        table = cls().extend(records)
        if expected is not None and len(table) != expected:
            raise ValueError(f"record lists hold {len(table)} records, the manifest {expected}")
        return table

    def add(self, sha256: str, path: str, split: str, label: str, width: int, height: int) -> None:
        """One record (a :class:`Row`'s fields; 1.5 us, a million in 1.5 s)."""
        if len(sha256) != 64:
            raise ValueError(f"{path}: content hash {sha256!r} is not a sha256")
        self.hashes += bytes.fromhex(sha256)
        self.path_digests += blake2b(
            path.encode("utf-8", "surrogateescape"), digest_size=8
        ).digest()
        self.splits.append(_SPLIT_CODES[split])
        code = self._codes.get(label)
        if code is None:
            code = self._codes[label] = len(self.names)
            self.names.append(label)
        self.labels.append(code)
        self.widths.append(width)
        self.heights.append(height)

    def copy(self) -> Table:
        twin = Table()
        twin.hashes, twin.path_digests = bytearray(self.hashes), bytearray(self.path_digests)
        twin.splits, twin.labels = array("B", self.splits), array("H", self.labels)
        twin.widths, twin.heights = array("I", self.widths), array("I", self.heights)
        twin.names, twin._codes = list(self.names), dict(self._codes)
        return twin

    def extend(self, records: Iterable[Row]) -> Table:
        """Add ``records``; returns this table."""
        add = self.add
        for row in records:
            add(*row)
        return self

    def __len__(self) -> int:
        return len(self.splits)

    def hash_array(self) -> np.ndarray:
        return np.frombuffer(self.hashes, dtype="S32")

    def path_digest_array(self) -> np.ndarray:
        return np.frombuffer(self.path_digests, dtype=np.uint64)

    def split_codes(self) -> np.ndarray:
        """Each record's split as its index in :data:`SPLITS`."""
        return np.asarray(self.splits)

    def label_codes(self, names: list[str] | None = None) -> np.ndarray:
        """Each record's class as an index into ``names`` (default: this table's own;
        -1 for a class ``names`` lacks)."""
        codes = np.asarray(self.labels).astype(np.int64)
        if names is None:
            return codes
        where = {name: i for i, name in enumerate(names)}
        return np.array([where.get(n, -1) for n in self.names], dtype=np.int64)[codes]

    def label_counts(self) -> Counter[str]:
        """Records per class name (classes with none left out)."""
        counts = np.bincount(np.asarray(self.labels), minlength=len(self.names))
        return Counter({name: int(n) for name, n in zip(self.names, counts, strict=True) if n})

    def split_label_counts(self, mask: np.ndarray) -> Counter[tuple[str, str]]:
        """Records per (split, class name) of the rows in ``mask``."""
        codes = np.asarray(self.splits).astype(np.int64) * len(self.names)
        codes += np.asarray(self.labels)
        counts = np.bincount(codes[mask], minlength=len(SPLITS) * len(self.names))
        return Counter(
            {
                (SPLITS[i // len(self.names)], self.names[i % len(self.names)]): int(n)
                for i, n in enumerate(counts)
                if n
            }
        )


def locate(values: Table, reference: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each record of ``values``: whether ``reference`` holds its content, where (an
    index into ``reference``, meaningful where found), and whether it sits there in the same
    class and split."""
    found, at = _search(values.hash_array(), reference.hash_array())
    if not len(reference):
        return found, at, found
    same = (
        found
        & (values.label_codes(reference.names) == reference.label_codes()[at])
        & (values.split_codes() == reference.split_codes()[at])
    )
    return found, at, same


def missing_from(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Mask of the ``values`` not in ``reference`` (no set of a million hashes)."""
    return ~_search(values, reference)[0]


def _search(values: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether each of ``values`` is in ``reference``, and at which index of it: one sorted
    order of ``reference``, then a binary search per value."""
    at = np.zeros(len(values), dtype=np.int64)
    if not len(reference):
        return np.zeros(len(values), dtype=bool), at
    order = np.argsort(reference, kind="stable")
    at = order[np.minimum(np.searchsorted(reference[order], values), len(order) - 1)]
    return np.asarray(reference[at] == values), at


def compute(
    previous: ShardManifest | None,
    before: Table | None,
    manifest: ShardManifest,
    after: Table,
    *,
    mode: str,
    duplicates: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The diff from ``previous`` (None: nothing before; ``before`` None: its record lists
    could not be read) to ``manifest``.

    ``duplicates``: images added again under another name whose content the shard set
    already holds (an append keeps the record it has and adds nothing), as
    ``{"path", "same_content_as"}``; a rebuild's records are the index's, so it has none.
    """
    known = previous is not None and before is not None
    before = before if previous is not None and before is not None else Table()
    # a record is added or removed per class and split: an image moved to another class (or
    # split) is removed from one and added to the other, and counted as moved
    found, _, same = locate(after, before)
    added, moved = ~same, found & ~same
    removed = ~locate(before, after)[2]
    count_before, count_after = before.label_counts(), after.label_counts()
    classes_before = sorted(count_before)
    classes = list(manifest.classes) + [c for c in classes_before if c not in manifest.classes]
    share_before, share_after = _shares(count_before), _shares(count_after)
    shares = {
        c: {
            "before": round(share_before.get(c, 0.0), 6),
            "after": round(share_after.get(c, 0.0), 6),
            "shift": round(share_after.get(c, 0.0) - share_before.get(c, 0.0), 6),
        }
        for c in classes
    }
    largest = max(shares.items(), key=lambda kv: (abs(kv[1]["shift"]), kv[0]), default=None)
    returned = list(duplicates or [])
    return {
        "mode": mode,
        "fingerprint": manifest.fingerprint,
        "previous_fingerprint": previous.fingerprint if previous else None,
        "previous_known": known,
        "generations": len(manifest.generations),
        "records": {"before": len(before), "after": len(after)},
        "added": _per_split_class(after.split_label_counts(added)),
        "removed": _per_split_class(before.split_label_counts(removed)),
        "added_total": int(added.sum()),
        "removed_total": int(removed.sum()),
        "moved_total": int(moved.sum()),
        "new_classes": [c for c in manifest.classes if c not in classes_before] if known else [],
        "class_share": shares,
        "largest_share_shift": (
            {"class": largest[0], "shift": largest[1]["shift"]} if largest else None
        ),
        "image_size": {"before": _sizes(before), "after": _sizes(after)},
        "duplicates": returned,
        "duplicate_count": len(returned),
    }


def write(diff: dict[str, Any], path: Path) -> None:
    """``path`` (JSON) and its ``.md`` sibling (the summary a Prefect artifact shows)."""
    write_json(path, diff)
    write_text(path.with_suffix(".md"), summary_markdown(diff))


def summary_markdown(diff: dict[str, Any]) -> str:
    """Counts per split and class, share shifts, new classes, sizes, duplicates."""
    before = (diff["previous_fingerprint"] or "none")[:12]
    lines = [
        f"# Data diff ({diff['mode']}): `{before}` -> `{diff['fingerprint'][:12]}`",
        "",
        f"- records: {diff['records']['before']} -> {diff['records']['after']} "
        f"(+{diff['added_total']}, -{diff['removed_total']}); generations: {diff['generations']}",
        f"- moved to another class or split (in both counts): {diff['moved_total']}",
        f"- new classes: {', '.join(diff['new_classes']) or 'none'}",
        f"- images back under another name (duplicates): {diff['duplicate_count']}",
        "",
        "| class | "
        + " | ".join(f"+{s} / -{s}" for s in SPLITS)
        + " | share before | after | shift |",
        "|---|" + "---|" * (len(SPLITS) + 3),
    ]
    for name, share in diff["class_share"].items():
        cells = [
            f"+{diff['added'].get(s, {}).get(name, 0)} / -{diff['removed'].get(s, {}).get(name, 0)}"
            for s in SPLITS
        ]
        lines.append(
            f"| {name} | {' | '.join(cells)} | {share['before']:.3f} | {share['after']:.3f} "
            f"| {share['shift']:+.3f} |"
        )
    lines += ["", "| image size | before | after |", "|---|---|---|"]
    for key in ("width", "height", "aspect"):
        old, new = diff["image_size"]["before"].get(key), diff["image_size"]["after"].get(key)
        lines.append(f"| {key} p10/p50/p90 | {_fmt(old)} | {_fmt(new)} |")
    return "\n".join(lines) + "\n"


def _shares(counts: Counter[str]) -> dict[str, float]:
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items()} if total else {}


def _per_split_class(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {
        split: {label: n for (s, label), n in sorted(counts.items()) if s == split}
        for split in SPLITS
    }


def _sizes(table: Table) -> dict[str, list[float]]:
    """p10/p50/p90 of width, height and aspect (width / height) at ingest."""
    if not len(table):
        return {}
    widths = np.asarray(table.widths).astype(np.int64)
    heights = np.asarray(table.heights).astype(np.int64)
    columns = {
        "width": np.sort(widths.astype(np.float64)),
        "height": np.sort(heights.astype(np.float64)),
        "aspect": np.sort(widths / heights),  # float64 division, as Python's int / int
    }
    return {k: [round(_quantile(v, q), 4) for q in QUANTILES] for k, v in columns.items()}


def _quantile(values: np.ndarray, q: float) -> float:
    """Nearest-rank quantile of sorted values (no interpolation: exact and portable)."""
    return float(values[min(len(values) - 1, int(q * len(values)))])


def _fmt(values: list[float] | None) -> str:
    return " / ".join(f"{v:g}" for v in values) if values else "-"
