"""Near-duplicate photos: perceptual hashes, an indexed neighbour search, and split placement.

The same photo resized, re-encoded or lightly cropped has other bytes, so its content hash
differs and, placed on its own, it can land in train and in test at once. Ingest therefore
takes a 64-bit perceptual hash (``imagehash.phash``: a DCT of a 32x32 grey copy) of the image
it has already decoded to check the file. A hash within ``ingest.near_duplicate_distance``
bits of another only makes the pair a candidate: drawings on flat backgrounds, glyphs of
one letter in other fonts and scans of one digit share a coarse layout, and their hashes
lie as close as a re-encoded copy's. A candidate is near only when a second, independent
check confirms it is the same picture (:func:`same_picture`): its 16x16 grey copy (taken by
ingest from the same decode, :func:`thumbnail`) agrees with the other's at almost every
pixel. Groups are the connected components of confirmed pairs, and every image of a group
lands in one split (:func:`place`), chosen so that each class keeps its share of every
split.

Neighbours are found by multi-index hashing (Norouzi et al., "Fast Search in Hamming Space
with Multi-Index Hashing"): two 64-bit hashes within ``d`` bits differ in at most ``d // 4``
bits in one of their four 16-bit quarters, so only images sharing a quarter within that
radius are compared, never all pairs (:func:`near_pairs`). Grouping streams those pairs into
component labels a bounded block at a time (:func:`near_components`): a set of look-alike
images (product shots on white, scans) has a quadratic number of near pairs, and neither
placement nor validation ever holds them.

Plain Python and NumPy, no stage code: ingest places, validation re-checks and forget
finds a group, all with :func:`near_components` or :func:`is_near` (one relation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import imagehash
import numpy as np
from PIL import Image, ImageFilter

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
# The second check (python -m bench --only near_duplicates measures it on real images): a
# 16x16 grey copy (area averages of a copy blurred by half a thumbnail pixel, so resizing,
# re-encoding and a light crop barely move it); two pictures are the same when at most
# MAX_DIFFERING of its 256 pixels differ by more than PIXEL_TOLERANCE grey levels. A mean
# difference would not do: a glyph in another font differs in a few stroke pixels on a
# flat background, a re-encoded copy a little everywhere.
THUMB_SIDE = 16
THUMB_BYTES = THUMB_SIDE * THUMB_SIDE
THUMB_BLUR = 0.5  # Gaussian radius, in thumbnail pixels
PIXEL_TOLERANCE = 24
MAX_DIFFERING = 7
CONFIRM_BLOCK = 1 << 13  # candidate pairs whose thumbnails are compared at once
# A group this large a share of the images (or spanning classes) is reported with a sheet
FLAGGED_GROUP_SHARE = 0.01


def perceptual_hash(image: Image.Image) -> str:
    """The image's 64-bit DCT perceptual hash as 16 hex digits."""
    return str(imagehash.phash(image))


def hash_version() -> str:
    """What a stored hash depends on besides the decoded pixels: the hash and its library."""
    return f"{HASH_NAME};decoded_side>={HASH_SIDE};imagehash={imagehash.__version__}"


def thumbnail(image: Image.Image) -> str:
    """The image's :data:`THUMB_SIDE`-pixel square grey copy (area averages) as hex: what
    :func:`same_picture` compares. Taken at ingest from its decode: nothing else reads
    the image again."""
    fine = 4 * THUMB_SIDE  # blurred at 4x the thumbnail's side, then area-averaged down
    grey = image.convert("L").resize((fine, fine), Image.Resampling.BOX)
    grey = grey.filter(ImageFilter.GaussianBlur(THUMB_BLUR * 4))
    return grey.resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BOX).tobytes().hex()


def confirmation_version() -> str:
    """What the second check depends on: the thumbnail and the rule that compares two."""
    return (
        f"grey{THUMB_SIDE}box;blur={THUMB_BLUR};differ>{PIXEL_TOLERANCE};at_most={MAX_DIFFERING};"
        f"pillow={Image.__version__}"
    )


def thumb_values(hexes: Sequence[str]) -> np.ndarray:
    """Hex thumbnails as a ``(n, THUMB_BYTES)`` ``uint8`` array."""
    data = b"".join(bytes.fromhex(h) for h in hexes)
    return np.frombuffer(data, dtype=np.uint8).reshape(len(hexes), THUMB_BYTES)


def same_picture(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether thumbnails ``a[k]`` and ``b[k]`` (rows of :func:`thumb_values`) show the same
    picture: at most :data:`MAX_DIFFERING` pixels apart by more than :data:`PIXEL_TOLERANCE`."""
    apart = np.maximum(a, b) - np.minimum(a, b)  # uint8 without wrap-around
    return np.count_nonzero(apart > PIXEL_TOLERANCE, axis=1) <= MAX_DIFFERING


def is_near(
    hashes_a: np.ndarray,
    thumbs_a: np.ndarray,
    hashes_b: np.ndarray,
    thumbs_b: np.ndarray,
    distance: int,
) -> np.ndarray:
    """The near-duplicate relation, pair by pair: perceptual hashes within ``distance`` bits
    (the candidate) and thumbnails of the same picture (the confirmation). Grouping,
    placement, validation and forget all use it."""
    close = np.bitwise_count(hashes_a ^ hashes_b) <= distance
    return close & same_picture(thumbs_a, thumbs_b)


@dataclass(frozen=True)
class Thumbs:
    """Thumbnails by position, decoded from hex only for the candidate pairs that ask: a
    run's candidates are few beside its images, and the hex is already in memory."""

    hexes: Sequence[str]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return thumb_values([self.hexes[int(p)] for p in positions])


def _confirmed(thumbs: Thumbs, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where the candidate pairs ``(a[k], b[k])`` are confirmed, a bounded block at a time."""
    keep = np.zeros(len(a), dtype=bool)
    for start in range(0, len(a), CONFIRM_BLOCK):
        end = start + CONFIRM_BLOCK
        ends = np.concatenate([a[start:end], b[start:end]])
        nodes, at = np.unique(ends, return_inverse=True)
        rows = thumbs(nodes)
        half = len(ends) // 2
        keep[start:end] = same_picture(rows[at[:half]], rows[at[half:]])
    return keep


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


def near_components(
    hashes: np.ndarray, distance: int, thumbs: Sequence[str] | None = None
) -> np.ndarray:
    """A component label per hash: hashes linked by a chain of near pairs share one.

    With ``thumbs`` (each image's :func:`thumbnail`), a pair is near only when its hashes
    are within ``distance`` bits and :func:`same_picture` confirms it (:func:`is_near`);
    without, every candidate pair counts (the connected components of :func:`near_pairs`).

    Memory stays bounded whatever the number of pairs: equal hashes (with equal thumbnails)
    are one node, and each block of pairs is merged into the labels as it is found, then
    dropped. Work stays close to linear for a set of look-alikes too: once a large bucket
    is one component with the hash asking, its pairs are not expanded (:func:`_pair_blocks`),
    and pairs already in one component are never confirmed. Labels are the smallest
    position in each component.
    """
    values, inverse, firsts = _nodes(hashes, thumbs)
    check = Thumbs([thumbs[p] for p in firsts.tolist()]) if thumbs is not None else None
    label = np.arange(len(values))
    n = len(values)
    for codes in _pair_blocks(values, distance, label):
        a, b = codes // n, codes % n
        apart = label[a] != label[b]
        a, b = a[apart], b[apart]
        # a slice at a time, each merged before the next is confirmed: in a look-alike set
        # the first slices join most of it, and the pairs they join are never compared
        for start in range(0, len(a), CONFIRM_BLOCK):
            first, second = a[start : start + CONFIRM_BLOCK], b[start : start + CONFIRM_BLOCK]
            apart = label[first] != label[second]
            first, second = first[apart], second[apart]
            if check is not None and len(first):
                confirmed = _confirmed(check, first, second)
                first, second = first[confirmed], second[confirmed]
            if len(first):
                _merge(label, first, second)
    # Back to positions: each component named by its first position.
    first = np.full(len(values), len(hashes), dtype=np.int64)
    np.minimum.at(first, label[inverse], np.arange(len(hashes)))
    return first[label[inverse]]


def _nodes(
    hashes: np.ndarray, thumbs: Sequence[str] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct images as nodes: (their hashes, each position's node, each node's first
    position). Equal hashes are one node, with ``thumbs`` only where the thumbnails are
    equal too (a flat image and another flat image of other shapes can share a hash)."""
    values, firsts, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    if thumbs is None:
        return values, inverse, firsts
    counts = np.bincount(inverse, minlength=len(values))
    shared = np.flatnonzero(counts[inverse] > 1)  # positions whose hash another one has
    variant = np.zeros(len(hashes), dtype=np.int64)
    seen: dict[tuple[int, str], int] = {}
    for p in shared.tolist():
        key = (int(inverse[p]), thumbs[p])
        variant[p] = seen.setdefault(key, len(seen))
    order = np.lexsort((variant, hashes))
    ordered, kinds = hashes[order], variant[order]
    new = np.ones(len(hashes), dtype=bool)
    new[1:] = (ordered[1:] != ordered[:-1]) | (kinds[1:] != kinds[:-1])
    node_sorted = np.cumsum(new) - 1
    node = np.empty(len(hashes), dtype=np.int64)
    node[order] = node_sorted
    firsts = np.full(int(node_sorted[-1]) + 1 if len(hashes) else 0, len(hashes), dtype=np.int64)
    np.minimum.at(firsts, node, np.arange(len(hashes)))
    return hashes[firsts], node, firsts


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
    thumb: str  # :func:`thumbnail` of its decode, the second check's input


@dataclass
class Placement:
    """Where each image goes, and what the report says about its near-duplicates."""

    splits: dict[str, str]  # sha256 -> split
    groups: list[dict[str, Any]]  # every group of 2+ images: split, paths, labels
    label_conflicts: list[dict[str, Any]]  # groups whose images carry different labels
    unplaceable: dict[str, str]  # sha256 -> why it cannot be placed without a leak
    # groups that span classes or hold more than FLAGGED_GROUP_SHARE of the images: the
    # likeliest sign of a relation gone wrong, shown to the user rather than trusted
    flagged: list[dict[str, Any]] = field(default_factory=list)


def draw(seed: int, sha256: str) -> bytes:
    """An image's seeded place in the placement order: random, but the same every run."""
    return hashlib.sha256(f"{seed}:{sha256}".encode()).digest()


def place(
    items: Sequence[Item],
    placed: dict[str, str],
    distance: int,
    shares: Mapping[str, float],
    seed: int,
) -> Placement:
    """Give every image a split so that no near-duplicate pair spans two splits and each
    class keeps its ``shares`` (split -> fraction) of every split.

    Images in ``placed`` (sha256 -> split: already in shards) never move; a group (images
    linked by a chain of confirmed pairs, :func:`near_components`) with placed images
    takes their split. The other groups are placed whole, the largest first, then in a
    seeded random order (:func:`draw`), each in the split its classes lag most behind
    their shares in (:class:`Quotas`): a class of 100 images lands within an image of its
    shares unless its groups are large. Only content hashes decide, so the same inputs
    give the same splits in any discovery order.

    A new image joining placed images of two splits (a bridge between groups placed apart)
    takes the split of its nearest placed image; if that leaves it near an image in another
    split it is not placed (``unplaceable``, with the reason) rather than leaked.
    """
    ordered = sorted(items, key=lambda item: item.sha256)
    values = hash_values([item.phash for item in ordered])
    thumbs = Thumbs([item.thumb for item in ordered])
    members: dict[int, list[int]] = {}
    for position, group in enumerate(near_components(values, distance, thumbs.hexes).tolist()):
        members.setdefault(group, []).append(position)
    quotas = Quotas.of(ordered, placed, shares)
    placer = Placer(ordered, values, thumbs, placed, distance, quotas)
    kept = [m for m in members.values() if any(ordered[p].sha256 in placed for p in m)]
    fresh = [m for m in members.values() if not any(ordered[p].sha256 in placed for p in m)]
    fresh.sort(key=lambda m: (-len(m), draw(seed, ordered[m[0]].sha256)))
    for group in sorted(kept, key=lambda m: m[0]) + fresh:
        placer.place_group(group)
    groups = [e for e in (placer.entry(m) for m in members.values()) if e is not None]
    groups.sort(key=lambda g: g["paths"][0])
    conflicts = [g for g in groups if len(g["labels"]) > 1]
    large = FLAGGED_GROUP_SHARE * len(ordered)
    flagged = [g for g in groups if len(g["labels"]) > 1 or len(g["paths"]) > large]
    return Placement(placer.splits, groups, conflicts, placer.unplaceable, flagged)


@dataclass
class Quotas:
    """Each class's images (``totals``) and how many of them each split holds so far
    (``counts``), against the ``shares`` every class should keep."""

    shares: Mapping[str, float]
    totals: dict[str, int]
    counts: dict[str, dict[str, int]]

    @classmethod
    def of(
        cls, items: Sequence[Item], placed: dict[str, str], shares: Mapping[str, float]
    ) -> Quotas:
        """The quotas of ``items``, counting those ``placed`` already."""
        totals: dict[str, int] = {}
        counts: dict[str, dict[str, int]] = {}
        for item in items:
            totals[item.label] = totals.get(item.label, 0) + 1
            counts.setdefault(item.label, dict.fromkeys(shares, 0))
            if item.sha256 in placed and placed[item.sha256] in shares:
                counts[item.label][placed[item.sha256]] += 1
        return cls(shares, totals, counts)

    def best(self, labels: Mapping[str, int]) -> str:
        """The split a group of ``labels`` (class -> images) fills least: the smallest sum,
        over its classes, of each split's count after it as a part of that split's quota.
        Ties go to the split named first; a split of no share (the bench's all-train
        indexes) is never chosen."""
        order = [split for split, share in self.shares.items() if share > 0]

        def fill(split: str) -> tuple[float, int]:
            after = sum(
                k * (self.counts[c][split] + k) / (self.shares[split] * self.totals[c])
                for c, k in labels.items()
            )
            return after, order.index(split)

        return min(order, key=fill)

    def add(self, labels: Mapping[str, int], split: str) -> None:
        for c, k in labels.items():
            self.counts[c][split] += k


@dataclass
class Placer:
    """:func:`place`'s state: the images by content hash with their perceptual hashes and
    thumbnails, the quotas, the splits given so far and the images that cannot be placed
    without a leak."""

    ordered: Sequence[Item]  # by sha256
    values: np.ndarray  # their perceptual hashes (uint64)
    thumbs: Thumbs  # their thumbnails
    placed: dict[str, str]  # sha256 -> split of images already in shards
    distance: int
    quotas: Quotas
    splits: dict[str, str] = field(default_factory=dict)
    unplaceable: dict[str, str] = field(default_factory=dict)

    def place_group(self, group: list[int]) -> None:
        """Give every image of a group (positions in :attr:`ordered`) its split."""
        ordered, placed = self.ordered, self.placed
        kept = [p for p in group if ordered[p].sha256 in placed]
        kept_splits = {placed[ordered[p].sha256] for p in kept}
        self.splits.update({ordered[p].sha256: placed[ordered[p].sha256] for p in kept})
        fresh = [p for p in group if ordered[p].sha256 not in placed]
        if not kept_splits:
            labels: dict[str, int] = {}
            for p in fresh:
                labels[ordered[p].label] = labels.get(ordered[p].label, 0) + 1
            split = self.quotas.best(labels)
            self.quotas.add(labels, split)
            self.splits.update({ordered[p].sha256: split for p in fresh})
            return
        for p in fresh:
            if len(kept_splits) == 1:
                self.splits[ordered[p].sha256] = next(iter(kept_splits))
            else:
                self.place_bridge(p, kept)
            given = self.splits.get(ordered[p].sha256)
            if given is not None:
                self.quotas.add({ordered[p].label: 1}, given)

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
        """Positions near ``p`` (:func:`is_near`): only a bridge asks, a scan of one hash."""
        close = np.flatnonzero(np.bitwise_count(self.values ^ self.values[p]) <= self.distance)
        close = close[close != p]
        if not len(close):
            return []
        own = np.repeat(self.thumbs(np.array([p])), len(close), axis=0)
        near = is_near(
            self.values[close],
            self.thumbs(close),
            self.values[[p] * len(close)],
            own,
            self.distance,
        )
        return close[near].tolist()

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
    hashes: Sequence[str], splits: Sequence[str], distance: int, thumbs: Sequence[str]
) -> list[tuple[int, int]]:
    """Positions ``(i, j)``, in order, of near-duplicate pairs (:func:`is_near`) whose
    splits differ.

    Such a pair lies inside one group: only groups holding two splits are searched pair by
    pair, so a set of look-alike images placed in one split costs no all-pairs answer.
    """
    values = hash_values(hashes)
    group_of = near_components(values, distance, thumbs)
    split_codes = np.unique(np.asarray(splits, dtype=object), return_inverse=True)[1]
    lowest = np.full(len(values), len(splits), dtype=np.int64)
    highest = np.full(len(values), -1, dtype=np.int64)
    np.minimum.at(lowest, group_of, split_codes)
    np.maximum.at(highest, group_of, split_codes)
    mixed = np.flatnonzero(lowest[group_of] != highest[group_of])
    pairs = near_pairs(values[mixed], distance)
    found = [
        (int(mixed[i]), int(mixed[j]))
        for i, j in pairs.tolist()
        if splits[mixed[i]] != splits[mixed[j]]
    ]
    if not found:
        return []
    first, second = np.array(found).T
    check = Thumbs(thumbs)
    near = _confirmed(check, first, second)
    return sorted((i, j) for (i, j), ok in zip(found, near.tolist(), strict=True) if ok)


def group_of(
    start: int, hashes: np.ndarray, thumbs: Callable[[np.ndarray], np.ndarray], distance: int
) -> list[int]:
    """Every position linked to ``start`` by a chain of near pairs (:func:`is_near`),
    ``start`` left out: one image's group, for forget and lineage. A walk outwards from it
    (a scan of every hash a step): one image's group is small beside the set."""
    members, frontier = {start}, [start]
    while frontier:
        found: set[int] = set()
        for p in frontier:
            close = np.flatnonzero(np.bitwise_count(hashes ^ hashes[p]) <= distance)
            close = np.array([q for q in close.tolist() if q not in members and q not in found])
            if not len(close):
                continue
            own = np.repeat(thumbs(np.array([p])), len(close), axis=0)
            near = is_near(hashes[close], thumbs(close), hashes[[p] * len(close)], own, distance)
            found.update(close[near].tolist())
        members.update(found)
        frontier = sorted(found)
    return sorted(members - {start})
