"""What a shard run changed: the diff from the manifest it found to the one it wrote.

The shard stage writes it (``reports/shard_changes.json`` plus a Markdown summary) for every
run, against the manifest that was there before: images added and removed per class and split,
each class's share before and after, new classes, the image size and aspect distributions
recorded at ingest, and images that came back under another name. It says what one run did to
the shard folder; it gates nothing. The gate compares against the last accepted data version
instead (:mod:`tasks.validate.data_gate`, ``reports/data_diff.json``): a killed run or a rebuild
leaves
no manifest, or an unaccepted one, to compare against.

Pure functions of the two manifests and their record lists
(``tasks.contracts.manifest.stream_records``),
held as compact columns (:class:`Table`): no shard is read.
"""

from __future__ import annotations

import shutil
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tasks.contracts.manifest import SPLITS, ShardManifest
from tasks.runtime.atomic import write_json, write_text

QUANTILES = (0.1, 0.5, 0.9)
_SPLIT_CODES = {split: i for i, split in enumerate(SPLITS)}
BUCKETS = 256  # a spilled table's records go to one file per first byte of their content hash
SPILL_PREFIX = ".spill-"  # a spilled table's folder, inside the shard folder (removed after)
SPILL_CHUNK = 1 << 14  # records buffered in memory before they go to their bucket files
_ROW = np.dtype(
    [
        ("hash", "S32"),
        ("path", "<u8"),
        ("split", "u1"),
        ("label", "<u2"),
        ("width", "<u4"),
        ("height", "<u4"),
        ("position", "<u8"),
    ]
)


class Row(NamedTuple):
    """One record of a shard set, as the diff sees it (a tuple: cheaper to build than a
    frozen dataclass, and a diff builds one a record)."""

    sha256: str
    path: str
    split: str
    label: str
    width: int
    height: int


def rows(manifest: ShardManifest, entries: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[Row]:
    """The manifest's records from ``(shard file, record)`` pairs of its record lists
    (:func:`tasks.contracts.manifest.stream_records`)."""
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
    need of a shard set or an index: as parsed dicts or rows, a record takes several times
    those bytes."""

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
        """One record (a :class:`Row`'s fields)."""
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

    def buckets(self) -> Iterator[tuple[Table, np.ndarray]]:
        """The records of each :data:`BUCKETS` bucket (by the first byte of the content
        hash) with their positions in this table, in table order: what a
        :class:`SpilledTable` yields, so the diff's code is the same for both."""
        yield from _split_buckets(self._rows(), self.names, self._codes)

    def _rows(self) -> np.ndarray:
        rows = np.zeros(len(self), dtype=_ROW)
        rows["hash"], rows["path"] = self.hash_array(), self.path_digest_array()
        rows["split"], rows["label"] = self.splits, self.labels
        rows["width"], rows["height"] = self.widths, self.heights
        rows["position"] = np.arange(len(self), dtype=np.uint64)
        return rows

    @classmethod
    def _of_rows(cls, rows: np.ndarray, names: list[str], codes: dict[str, int]) -> Table:
        """A read-only table over ``rows`` (a :data:`_ROW` array) whose labels are codes
        into ``names`` (shared, not copied)."""
        table = cls()
        table.hashes = bytearray(rows["hash"].tobytes())
        table.path_digests = bytearray(rows["path"].tobytes())
        table.splits, table.labels = rows["split"], rows["label"]  # type: ignore[assignment]
        table.widths, table.heights = rows["width"], rows["height"]  # type: ignore[assignment]
        table.names, table._codes = names, codes
        return table

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


def _bucket_rows(rows: np.ndarray) -> Iterator[np.ndarray]:
    """``rows`` (a :data:`_ROW` array) cut into its :data:`BUCKETS` buckets, each in the
    order given."""
    bucket = rows["hash"].astype("S1").view(np.uint8)  # the hash's first byte
    rows = rows[np.argsort(bucket, kind="stable")]
    ends = np.searchsorted(np.sort(bucket), np.arange(1, BUCKETS + 1))
    start = 0
    for end in ends:
        yield rows[start:end]
        start = int(end)


def _split_buckets(
    rows: np.ndarray, names: list[str], codes: dict[str, int]
) -> Iterator[tuple[Table, np.ndarray]]:
    """``rows`` as one table a bucket, each with its positions."""
    for part in _bucket_rows(rows):
        yield Table._of_rows(part, names, codes), part["position"]


class SpilledTable:
    """A :class:`Table` kept on disk: its records go to one file per :data:`BUCKETS` bucket
    (the first byte of the content hash), 59 bytes a record, under a fresh folder in
    ``folder`` (the shard folder: nothing is written outside the repository). Two tables
    are compared a bucket at a time (:meth:`buckets`), so a diff holds one bucket's records
    at once, and the stage's memory does not grow with the data.
    :meth:`close` removes the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=folder))
        self.names: list[str] = []
        self._codes: dict[str, int] = {}
        self._flushed = 0
        self._buffer = self._empty_buffer()

    def _empty_buffer(self) -> Table:
        buffer = Table()
        buffer.names, buffer._codes = self.names, self._codes  # one set of label codes
        return buffer

    @classmethod
    def of(cls, folder: Path, records: Iterable[Row], expected: int | None = None) -> SpilledTable:
        """:meth:`Table.of`, spilled under ``folder`` (removed again when it raises)."""
        table = cls(folder)
        try:
            table.extend(records)
            if expected is not None and len(table) != expected:
                raise ValueError(f"record lists hold {len(table)} records, the manifest {expected}")
        except BaseException:
            table.close()
            raise
        return table

    def add(self, sha256: str, path: str, split: str, label: str, width: int, height: int) -> None:
        """One record (:meth:`Table.add`); its position is the count of those before it."""
        self._buffer.add(sha256, path, split, label, width, height)
        if len(self._buffer) >= SPILL_CHUNK:
            self._flush()

    def extend(self, records: Iterable[Row]) -> SpilledTable:
        add = self.add
        for row in records:
            add(*row)
        return self

    def __len__(self) -> int:
        return self._flushed + len(self._buffer)

    def _flush(self) -> None:
        if not len(self._buffer):
            return
        rows = self._buffer._rows()
        rows["position"] += np.uint64(self._flushed)
        for number, part in enumerate(_bucket_rows(rows)):
            if len(part):
                with open(self.folder / f"{number:03d}", "ab") as handle:
                    handle.write(part.tobytes())
        self._flushed += len(rows)
        self._buffer = self._empty_buffer()

    def buckets(self) -> Iterator[tuple[Table, np.ndarray]]:
        """Each bucket's records as a table, with their positions, in the order added."""
        self._flush()
        for number in range(BUCKETS):
            path = self.folder / f"{number:03d}"
            rows = np.fromfile(path, dtype=_ROW) if path.exists() else np.zeros(0, _ROW)
            yield Table._of_rows(rows, self.names, self._codes), rows["position"]

    def copy(self, folder: Path) -> SpilledTable:
        """A twin under a fresh folder in ``folder`` (its bucket files copied)."""
        self._flush()
        twin = SpilledTable(folder)
        for path in self.folder.iterdir():
            shutil.copyfile(path, twin.folder / path.name)
        twin.names.extend(self.names)
        twin._codes.update(self._codes)
        twin._flushed = self._flushed
        return twin

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


AnyTable = Table | SpilledTable


def remove_spills(folder: Path) -> None:
    """Remove spilled tables a killed run left in ``folder``."""
    for stale in Path(folder).glob(f"{SPILL_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def found_mask(values: AnyTable, reference: AnyTable) -> np.ndarray:
    """Whether each record of ``values`` (by position) has its content in ``reference``."""
    mask = np.zeros(len(values), dtype=bool)
    for (part, positions), (ref, _) in zip(values.buckets(), reference.buckets(), strict=True):
        found = _search(part.hash_array(), ref.hash_array())[0]
        mask[positions[found].astype(np.int64)] = True
    return mask


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
    before: AnyTable | None,
    manifest: ShardManifest,
    after: AnyTable,
    *,
    mode: str,
    duplicates: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The diff from ``previous`` (None: nothing before; ``before`` None: its record lists
    could not be read) to ``manifest``.

    ``duplicates``: images added again under another name whose content the shard set
    already holds (an append keeps the record it has and adds nothing), as
    ``{"path", "same_content_as"}``; a rebuild's records are the index's, so it has none.
    Compared a bucket of content hashes at a time: a :class:`SpilledTable` never sits in
    memory whole.
    """
    known = previous is not None and before is not None
    before = before if previous is not None and before is not None else Table()
    tally = ChangeTally()
    for (old, _), (new, _) in zip(before.buckets(), after.buckets(), strict=True):
        tally.add(old, new)
    classes_before = sorted(tally.count_before)
    classes = list(manifest.classes) + [c for c in classes_before if c not in manifest.classes]
    shares, largest = class_shares(tally.count_before, tally.count_after, classes)
    returned = list(duplicates or [])
    return {
        "mode": mode,
        "fingerprint": manifest.fingerprint,
        "previous_fingerprint": previous.fingerprint if previous else None,
        "previous_known": known,
        "generations": len(manifest.generations),
        "records": {"before": len(before), "after": len(after)},
        "added": _per_split_class(tally.added),
        "removed": _per_split_class(tally.removed),
        "added_total": tally.added_total,
        "removed_total": tally.removed_total,
        "moved_total": tally.moved_total,
        "new_classes": [c for c in manifest.classes if c not in classes_before] if known else [],
        "class_share": shares,
        "largest_share_shift": largest,
        "image_size": {
            "before": tally.sizes_before.quantiles(),
            "after": tally.sizes_after.quantiles(),
        },
        "duplicates": returned,
        "duplicate_count": len(returned),
    }


@dataclass
class ChangeTally:
    """What :func:`compute` adds up a bucket of content hashes at a time. A record is added
    or removed per class and split: an image moved to another class (or split) is removed
    from one and added to the other, and counted as moved."""

    added: Counter[tuple[str, str]] = field(default_factory=Counter)
    removed: Counter[tuple[str, str]] = field(default_factory=Counter)
    count_before: Counter[str] = field(default_factory=Counter)
    count_after: Counter[str] = field(default_factory=Counter)
    sizes_before: _SizeCounts = field(default_factory=lambda: _SizeCounts())
    sizes_after: _SizeCounts = field(default_factory=lambda: _SizeCounts())
    added_total: int = 0
    removed_total: int = 0
    moved_total: int = 0

    def add(self, old: Table, new: Table) -> None:
        """One bucket: the records before (``old``) and after (``new``)."""
        found, _, same = locate(new, old)
        gone = ~locate(old, new)[2]
        self.added += new.split_label_counts(~same)
        self.removed += old.split_label_counts(gone)
        self.added_total += int((~same).sum())
        self.removed_total += int(gone.sum())
        self.moved_total += int((found & ~same).sum())
        self.count_before += old.label_counts()
        self.count_after += new.label_counts()
        self.sizes_before.add(old)
        self.sizes_after.add(new)


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


def class_shares(
    before: Mapping[str, int], after: Mapping[str, int], classes: Iterable[str]
) -> tuple[dict[str, dict[str, float]], dict[str, Any] | None]:
    """Each class's share of the records before and after, and its shift (rounded to 6
    places), with the largest shift (``{"class", "shift"}``, ties to the later class name;
    None without classes). The data gate and the shard diff both report these."""
    share_before, share_after = _shares(before), _shares(after)
    shares = {
        c: {
            "before": round(share_before.get(c, 0.0), 6),
            "after": round(share_after.get(c, 0.0), 6),
            "shift": round(share_after.get(c, 0.0) - share_before.get(c, 0.0), 6),
        }
        for c in classes
    }
    largest = max(shares.items(), key=lambda kv: (abs(kv[1]["shift"]), kv[0]), default=None)
    return shares, ({"class": largest[0], "shift": largest[1]["shift"]} if largest else None)


def _shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items()} if total else {}


def _per_split_class(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {
        split: {label: n for (s, label), n in sorted(counts.items()) if s == split}
        for split in SPLITS
    }


class _SizeCounts:
    """How many records have each width, height and aspect (width / height), summed over
    buckets: p10/p50/p90 from the counts (as many entries as distinct sizes, not records)."""

    def __init__(self) -> None:
        self.columns: dict[str, Counter[float]] = {k: Counter() for k in ("width", "height")}
        self.columns["aspect"] = Counter()
        self.total = 0

    def add(self, table: Table) -> None:
        widths = np.asarray(table.widths).astype(np.int64)
        heights = np.asarray(table.heights).astype(np.int64)
        self.total += len(widths)
        for key, values in (
            ("width", widths.astype(np.float64)),
            ("height", heights.astype(np.float64)),
            ("aspect", widths / heights),  # float64 division, as Python's int / int
        ):
            found, counts = np.unique(values, return_counts=True)
            self.columns[key].update(dict(zip(found.tolist(), counts.tolist(), strict=True)))

    def quantiles(self) -> dict[str, list[float]]:
        """p10/p50/p90 of width, height and aspect at ingest (nearest rank over the sorted
        values: no interpolation, exact and portable)."""
        if not self.total:
            return {}
        return {
            key: [round(_counted_quantile(counts, self.total, q), 4) for q in QUANTILES]
            for key, counts in self.columns.items()
        }


def _counted_quantile(counts: Counter[float], total: int, q: float) -> float:
    """The value at nearest rank ``q`` of ``total`` values given as value -> count."""
    rank = min(total - 1, int(q * total))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen > rank:
            return float(value)
    raise ValueError(f"{total} values counted, {seen} found")


def _fmt(values: list[float] | None) -> str:
    return " / ".join(f"{v:g}" for v in values) if values else "-"
