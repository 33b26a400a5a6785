"""Near-duplicate photos: perceptual hashes, an indexed neighbour search, and split placement.

The same photo resized, re-encoded or lightly cropped has other bytes, so its content hash
(and its hash split) differs and it can land in train and in test at once. Ingest therefore
takes a 64-bit perceptual hash (``imagehash.phash``: a DCT of a 32x32 grey copy) of the image
it has already decoded to check the file, and groups images whose hashes lie within
``ingest.near_duplicate_distance`` bits of each other. Every image of a group lands in one
split (:func:`place`).

Neighbours are found by multi-index hashing (Norouzi et al., "Fast Search in Hamming Space
with Multi-Index Hashing"): two 64-bit hashes within ``d`` bits differ in at most ``d // 4``
bits in one of their four 16-bit quarters, so only images sharing a quarter within that
radius are compared, never all pairs (:func:`near_pairs`). Grouping streams those pairs into
component labels a bounded block at a time (:func:`near_components`): a set of look-alike
images (product shots on white, scans) has a quadratic number of near pairs, and neither
placement nor validation ever holds them.

Plain Python and NumPy, no stage code: ingest places, validation re-checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import imagehash
import numpy as np
from PIL import Image

HASH_NAME = "phash64"
HASH_SIDE = 32  # phash's grey copy is 32x32 (hash_size 8 x highfreq_factor 4)
QUARTERS = 4  # 16-bit substrings of the 64-bit hash (one lookup table of 65,536 buckets each)
QUARTER_BITS = 16
# Candidate pairs expanded at once while searching: bounds the search's memory when many
# hashes share a quarter (flat or near-identical images), whatever the data.
CANDIDATE_BLOCK = 1 << 21
# Buckets of SETTLED_BUCKET hashes or more are checked before each block, where the buckets
# they ask hold SETTLED_MEAN hashes on average (look-alike sets, not random hashes): once all
# of a bucket's hashes are in the asking hash's component, its pairs are not expanded.
SETTLED_BUCKET = 4
SETTLED_MEAN = 16


def perceptual_hash(image: Image.Image) -> str:
    """The image's 64-bit DCT perceptual hash as 16 hex digits."""
    return str(imagehash.phash(image))


def hash_version() -> str:
    """What a stored hash depends on besides the decoded pixels: the hash and its library."""
    return f"{HASH_NAME};decoded_side>={HASH_SIDE};imagehash={imagehash.__version__}"


def hash_values(hexes: Sequence[str]) -> np.ndarray:
    """Hex hashes as a ``uint64`` array."""
    return np.array([int(h, 16) for h in hexes], dtype=np.uint64)


def hamming(a: str, b: str) -> int:
    """Bits that differ between two hex hashes."""
    return (int(a, 16) ^ int(b, 16)).bit_count()


def _masks(radius: int) -> np.ndarray:
    """Every 16-bit value with at most ``radius`` bits set (the quarter-neighbourhood)."""
    masks = [
        sum(1 << bit for bit in bits)
        for r in range(min(radius, QUARTER_BITS) + 1)
        for bits in combinations(range(QUARTER_BITS), r)
    ]
    return np.array(masks, dtype=np.int64)


def near_pairs(hashes: np.ndarray, distance: int) -> np.ndarray:
    """Every pair ``(i, j)``, ``i < j``, of ``hashes`` (uint64) within ``distance`` bits.

    Multi-index hashing: per quarter, hashes are bucketed by that quarter's value (a
    counting sort), and each hash looks up only the buckets within ``distance // 4`` bits of
    its own quarter. Every candidate is then checked on all 64 bits. Returns an ``(n, 2)``
    int64 array sorted by ``(i, j)``. The answer itself can be quadratic (a set of look-alike
    images pairs with itself): grouping uses :func:`near_components`, which never holds it.
    """
    n = len(hashes)
    found = list(_pair_blocks(hashes, distance))
    if not found:
        return np.empty((0, 2), dtype=np.int64)
    codes = np.unique(np.concatenate(found))  # a pair is found once per matching quarter
    return np.stack([codes // n, codes % n], axis=1)


def _pair_blocks(
    hashes: np.ndarray, distance: int, label: np.ndarray | None = None
) -> Iterator[np.ndarray]:
    """The near pairs of ``hashes`` as ``min * n + max`` codes, a bounded block at a time (a
    pair comes once per quarter it matches in).

    With ``label`` (component labels the consumer updates in place between blocks), a
    large bucket whose hashes are all in the asking hash's component is not expanded: its
    pairs could join nothing (:func:`near_components`)."""
    n = len(hashes)
    if n < 2:
        return
    masks = _masks(distance // QUARTERS)
    everyone = np.arange(n)
    for quarter in range(QUARTERS):
        values = ((hashes >> np.uint64(quarter * QUARTER_BITS)) & np.uint64(0xFFFF)).astype(
            np.int64
        )
        order = np.argsort(values, kind="stable")
        buckets = Buckets(order, np.bincount(values, minlength=1 << QUARTER_BITS), hashes[order])
        for mask in masks:
            keys = values ^ mask
            # Buckets v and v ^ mask see each other: only the lower one asks (half the work);
            # within one bucket (mask 0) everyone asks and i < j keeps each pair once.
            queries = np.flatnonzero(values < keys) if mask else everyone
            yield from _expand(hashes, distance, queries, keys[queries], buckets, label)


def near_components(hashes: np.ndarray, distance: int) -> np.ndarray:
    """A component label per hash: hashes linked by a chain of pairs within ``distance`` bits
    share one: the connected components of :func:`near_pairs`.

    Memory stays bounded whatever the number of pairs: equal hashes are one node, and each
    block of pairs is merged into the labels as it is found, then dropped. Work stays close
    to linear for a set of look-alikes too: once a large bucket is one component with the
    hash asking, its pairs are not expanded (:func:`_pair_blocks`). Labels are the smallest
    position in each component.
    """
    values, inverse = np.unique(hashes, return_inverse=True)
    label = np.arange(len(values))
    n = len(values)
    for codes in _pair_blocks(values, distance, label):
        a, b = codes // n, codes % n
        apart = label[a] != label[b]
        if apart.any():
            _merge(label, a[apart], b[apart])
    # Back to positions: each component named by its first position.
    first = np.full(len(values), len(hashes), dtype=np.int64)
    np.minimum.at(first, label[inverse], np.arange(len(hashes)))
    return first[label[inverse]]


def _merge(label: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Link the nodes ``a[k]`` and ``b[k]`` in ``label``, in place: every node of a newly
    joined set then holds the set's smallest node.

    ``label`` is a flat union-find forest (each node holds its root, the smallest node of
    its set). Each round hooks every root that an edge still joins to a smaller root and
    flattens the trees; the smallest node of a set is never hooked, so it ends as the set's
    root. In place, on the node array itself: no renumbering of the edges' ends (a sort of
    every end would be most of the grouping of a look-alike set). No graph library: SciPy's
    ``csgraph`` imports cost more than most runs' whole grouping, and only the runs that
    find a near pair would pay them (docs/performance.md).
    """
    above = np.empty_like(label)
    while True:
        root_a, root_b = label[a], label[b]
        apart = root_a != root_b
        if not apart.any():
            return
        a, b, root_a, root_b = a[apart], b[apart], root_a[apart], root_b[apart]
        np.minimum.at(label, np.maximum(root_a, root_b), np.minimum(root_a, root_b))
        while True:  # flatten: every node points at its tree's root
            np.take(label, label, out=above)
            if np.array_equal(above, label):
                break
            label[:] = above


@dataclass(frozen=True)
class Buckets:
    """One quarter's index: bucket ``v`` holds ``order[starts[v]:starts[v] + counts[v]]``,
    whose hashes are ``hashes[starts[v]:...]`` (the hashes in bucket order, so a bucket's
    candidates are read in a row)."""

    order: np.ndarray
    counts: np.ndarray
    hashes: np.ndarray
    starts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "starts", np.cumsum(self.counts) - self.counts)


def _expand(
    hashes: np.ndarray,
    distance: int,
    queries: np.ndarray,
    keys: np.ndarray,
    buckets: Buckets,
    label: np.ndarray | None = None,
) -> Iterator[np.ndarray]:
    """The pairs (as ``min * n + max`` codes) between each hash ``queries[k]`` and the bucket
    ``keys[k]`` that lie within ``distance``, a bounded block of candidates at a time. Most
    buckets hold 0 or 1 hash: those skip the expansion. Each candidate costs a read of its
    hash in bucket order, an XOR and a bit count; only the pairs found are turned into
    positions. With ``label``, a query whose bucket (of :data:`SETTLED_BUCKET` hashes or
    more) is already one component with it is dropped before each block (:func:`_settled`),
    where such buckets are large on average (:data:`SETTLED_MEAN`)."""
    pairs = PairCheck(hashes, distance, buckets)
    per_query = buckets.counts[keys]
    single = np.flatnonzero(per_query == 1)
    at = buckets.starts[keys[single]]
    hit = pairs.near(at, hashes[queries[single]])
    yield pairs.codes(queries[single[hit]], at[hit])
    several = np.flatnonzero(per_query > 1)
    queue = _QueryQueue.of(queries[several], keys[several], per_query[several], label)
    yield from _expand_blocks(pairs, queue, label)


@dataclass(frozen=True)
class PairCheck:
    """How :func:`_expand` checks candidates: one read of a hash in bucket order, an XOR and
    a bit count each; only the pairs found are turned into positions."""

    hashes: np.ndarray
    distance: int
    buckets: Buckets

    def near(self, at: np.ndarray, asked: np.ndarray) -> np.ndarray:
        """Where the hash at bucket position ``at[k]`` lies within the distance of
        ``asked[k]``."""
        found = self.buckets.hashes[at]
        found ^= asked
        return np.flatnonzero(np.bitwise_count(found) <= self.distance)

    def codes(self, i: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Pair codes of the queries ``i`` found near the hashes at bucket positions ``at``."""
        j = self.buckets.order[at]
        low, high = np.minimum(i, j), np.maximum(i, j)
        keep = low < high
        return low[keep] * len(self.hashes) + high[keep]


@dataclass
class _QueryQueue:
    """The queries whose bucket holds several hashes, with their buckets and candidates:
    from ``from_large`` on, the large buckets, checked for being settled before each block."""

    queries: np.ndarray
    keys: np.ndarray
    per_query: np.ndarray
    from_large: int

    @classmethod
    def of(
        cls, queries: np.ndarray, keys: np.ndarray, per_query: np.ndarray, label: np.ndarray | None
    ) -> _QueryQueue:
        """Small buckets first, unchecked, then the large, where they are large on average
        (:data:`SETTLED_MEAN`); mostly small buckets (random hashes) are never checked:
        checking them would cost more than it saves."""
        if label is not None:
            large = per_query >= SETTLED_BUCKET
            if per_query[large].sum() >= SETTLED_MEAN * large.sum():
                small = ~large
                queries, keys, per_query = (
                    np.concatenate([v[small], v[large]]) for v in (queries, keys, per_query)
                )
                return cls(queries, keys, per_query, int(small.sum()))
        return cls(queries, keys, per_query, len(queries))

    def keep(self, rest: np.ndarray) -> None:
        """Keep only the queries at ``rest`` (all of them large: none checked yet)."""
        self.queries, self.keys = self.queries[rest], self.keys[rest]
        self.per_query, self.from_large = self.per_query[rest], 0


def _expand_blocks(
    pairs: PairCheck, queue: _QueryQueue, label: np.ndarray | None
) -> Iterator[np.ndarray]:
    """The pairs of ``queue``'s queries, a block of at most :data:`CANDIDATE_BLOCK`
    candidates (at least one query) at a time; large buckets that the blocks so far merged
    into the asking hash's component are dropped first (:func:`_settled`)."""
    hashes, starts = pairs.hashes, pairs.buckets.starts
    ends = np.cumsum(queue.per_query)
    first = 0
    stale = True  # labels may have changed since the last check: pairs were found since
    while first < len(queue.queries):
        if label is not None and first >= queue.from_large and stale:
            queries, keys = queue.queries[first:], queue.keys[first:]
            queue.keep(first + np.flatnonzero(~_settled(label, queries, keys, pairs.buckets)))
            ends, first, stale = np.cumsum(queue.per_query), 0, False
            if not len(queue.queries):
                break
        queries, keys, per_query = queue.queries, queue.keys, queue.per_query
        base = ends[first - 1] if first else 0
        last = max(first + 1, int(np.searchsorted(ends, base + CANDIDATE_BLOCK, side="right")))
        size = per_query[first:last]
        before = ends[first:last] - size - base  # each query's first candidate in the block
        # candidate t of query k sits at bucket position starts[keys[k]] + t - before[k]
        at = np.repeat(starts[keys[first:last]] - before, size)
        at += np.arange(len(at))
        hit = pairs.near(at, np.repeat(hashes[queries[first:last]], size))
        if len(hit) * 16 < len(at):  # few found (random hashes): find who asked
            asking = queries[first + np.searchsorted(before, hit, side="right") - 1]
        else:  # many (a look-alike set): spell the askers out
            asking = np.repeat(queries[first:last], size)[hit]
        block = pairs.codes(asking, at[hit])
        yield block
        stale = stale or len(block) > 0
        first = last


def _settled(
    label: np.ndarray, queries: np.ndarray, keys: np.ndarray, buckets: Buckets
) -> np.ndarray:
    """Whether each bucket ``keys[k]`` holds only hashes of the component of ``queries[k]``:
    then none of their pairs can join anything. One pass over the buckets asked."""
    asked, which = np.unique(keys, return_inverse=True)
    size = buckets.counts[asked]
    at = np.cumsum(size) - size
    members = buckets.order[
        np.repeat(buckets.starts[asked] - at, size) + np.arange(int(size.sum()))
    ]
    owners = label[members]
    lowest = np.minimum.reduceat(owners, at)
    one_component = lowest == np.maximum.reduceat(owners, at)
    return one_component[which] & (lowest[which] == label[queries])


@dataclass(frozen=True)
class Item:
    """One accepted image as placement sees it."""

    sha256: str
    path: str
    label: str
    phash: str


@dataclass
class Placement:
    """Where each image goes, and what the report says about its near-duplicates."""

    splits: dict[str, str]  # sha256 -> split
    groups: list[dict[str, Any]]  # every group of 2+ images: split, paths, labels
    label_conflicts: list[dict[str, Any]]  # groups whose images carry different labels
    unplaceable: dict[str, str]  # sha256 -> why it cannot be placed without a leak


def place(
    items: Sequence[Item],
    placed: dict[str, str],
    distance: int,
    hash_split: Callable[[str], str],
) -> Placement:
    """Give every image a split so that no near-duplicate pair spans two splits.

    Images in ``placed`` (sha256 -> split: already in shards) never move. A group (images
    linked by a chain of pairs within ``distance`` bits) with placed images takes their
    split; a group with none takes the hash split of its first image by content hash, so
    the same inputs give the same splits in any discovery order. Chains matter: a burst of
    photos can pair 1-2 and 2-3 while 1 and 3 are too far apart, and a nearest-neighbour
    rule alone would leave 1 and 3 in two splits.

    A new image joining placed images of two splits (a bridge between groups placed apart)
    takes the split of its nearest placed image; if that leaves it near an image in another
    split it is not placed (``unplaceable``, with the reason) rather than leaked.
    """
    ordered = sorted(items, key=lambda item: item.sha256)
    values = hash_values([item.phash for item in ordered])
    members: dict[int, list[int]] = {}
    for position, group in enumerate(near_components(values, distance).tolist()):
        members.setdefault(group, []).append(position)
    placer = Placer(ordered, values, placed, distance, hash_split)
    groups, conflicts = [], []
    for group in sorted(members.values(), key=lambda m: m[0]):
        placer.place_group(group)
        entry = placer.entry(group)
        if entry is not None:
            groups.append(entry)
            if len(entry["labels"]) > 1:
                conflicts.append(entry)
    groups.sort(key=lambda g: g["paths"][0])
    conflicts.sort(key=lambda g: g["paths"][0])
    return Placement(placer.splits, groups, conflicts, placer.unplaceable)


@dataclass
class Placer:
    """:func:`place`'s state: the images by content hash with their perceptual hashes, the
    splits given so far and the images that cannot be placed without a leak."""

    ordered: Sequence[Item]  # by sha256
    values: np.ndarray  # their perceptual hashes (uint64)
    placed: dict[str, str]  # sha256 -> split of images already in shards
    distance: int
    hash_split: Callable[[str], str]
    splits: dict[str, str] = field(default_factory=dict)
    unplaceable: dict[str, str] = field(default_factory=dict)

    def place_group(self, group: list[int]) -> None:
        """Give every image of a group (positions in :attr:`ordered`) its split."""
        ordered, placed = self.ordered, self.placed
        kept = [p for p in group if ordered[p].sha256 in placed]
        kept_splits = {placed[ordered[p].sha256] for p in kept}
        self.splits.update({ordered[p].sha256: placed[ordered[p].sha256] for p in kept})
        for p in group:
            sha = ordered[p].sha256
            if sha in placed:
                continue
            elif len(kept_splits) == 1:
                self.splits[sha] = next(iter(kept_splits))
            elif not kept_splits:
                self.splits[sha] = self.hash_split(ordered[group[0]].sha256)
            else:
                self.place_bridge(p, kept)

    def place_bridge(self, p: int, kept: list[int]) -> None:
        """An image joining placed images of two splits: its nearest placed image's split,
        or unplaceable when that still leaves it near an image in another split."""
        ordered, values = self.ordered, self.values
        nearest = min(kept, key=lambda q: (int(np.bitwise_count(values[p] ^ values[q])), q))
        split = self.placed[ordered[nearest].sha256]
        across = [
            ordered[q]
            for q in self.neighbours(p)
            if self.splits.get(ordered[q].sha256, split) != split
        ]
        if not across:
            self.splits[ordered[p].sha256] = split
            return
        self.unplaceable[ordered[p].sha256] = (
            f"near-duplicate of images already in two splits: "
            f"{', '.join(f'{o.path} ({self.splits[o.sha256]})' for o in across[:3])} "
            f"and {ordered[nearest].path} ({split}); placing it would leak. To "
            "keep it, place every image afresh: delete the ingest index and "
            "rebuild (shard.mode: rebuild)"
        )

    def neighbours(self, p: int) -> list[int]:
        """Positions within the distance of ``p``: only a bridge asks, a scan of one hash."""
        near = np.bitwise_count(self.values ^ self.values[p]) <= self.distance
        near[p] = False
        return np.flatnonzero(near).tolist()

    def entry(self, group: list[int]) -> dict[str, Any] | None:
        """The report's entry for a group of two or more placed images (split, paths,
        labels); None for a smaller one."""
        shown = [p for p in group if self.ordered[p].sha256 in self.splits]
        if len(shown) < 2:
            return None
        return {
            "split": "/".join(sorted({self.splits[self.ordered[p].sha256] for p in shown})),
            "paths": sorted(self.ordered[p].path for p in shown),
            "labels": sorted({self.ordered[p].label for p in shown}),
        }


def straddling_pairs(
    hashes: Sequence[str], splits: Sequence[str], distance: int
) -> list[tuple[int, int]]:
    """Positions ``(i, j)``, in order, of near-duplicate pairs whose splits differ.

    Such a pair lies inside one group: only groups holding two splits are searched pair by
    pair, so a set of look-alike images placed in one split costs no all-pairs answer.
    """
    values = hash_values(hashes)
    group_of = near_components(values, distance)
    split_codes = np.unique(np.asarray(splits, dtype=object), return_inverse=True)[1]
    lowest = np.full(len(values), len(splits), dtype=np.int64)
    highest = np.full(len(values), -1, dtype=np.int64)
    np.minimum.at(lowest, group_of, split_codes)
    np.maximum.at(highest, group_of, split_codes)
    mixed = np.flatnonzero(lowest[group_of] != highest[group_of])
    pairs = near_pairs(values[mixed], distance)
    found = [(int(mixed[i]), int(mixed[j])) for i, j in pairs.tolist()]
    return sorted((i, j) for i, j in found if splits[i] != splits[j])
