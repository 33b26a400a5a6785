"""Near-duplicates: copies of a photo share a split, placements never move, order never matters."""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from bench.near_duplicates import look_alike_hashes as look_alikes
from bench.near_duplicates import sample_photo
from tasks.contracts.index import load_index
from tasks.contracts.near_duplicates import (
    Item,
    hamming,
    near_components,
    near_pairs,
    place,
    straddling_pairs,
)
from tasks.ingest.stage import run_ingest
from tasks.runtime.params import default_params

EVEN = {"train": 0.34, "val": 0.33, "test": 0.33}
DISTANCE = default_params().ingest.near_duplicate_distance
GREY = "80" * 256  # one thumbnail for every item: every hash candidate is confirmed


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def photo(name: str, width: int = 192) -> Image.Image:
    image = sample_photo(name)
    return image.resize((width, round(image.height * width / image.width)))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ingest(source: Path, root: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Run ingest with three even splits; the report and each accepted path's split."""
    params = default_params(ingest={"source_dir": str(source), "workers": 1, "splits": EVEN})
    report = run_ingest(params.ingest, root / "index.json", root / "ingest.json")
    records = load_index(root / "index.json")["records"]
    return report, {r["path"]: r["split"] for r in records}


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def with_others(source: Path) -> None:
    """Different photos beside the copies: none of them may join a group."""
    for name in ("coffee", "rocket", "camera", "moon"):
        write(source / "other" / f"{name}.jpg", jpeg(photo(name)))


def test_resized_and_reencoded_copies_of_a_photo_end_in_the_same_split(tmp_path: Path) -> None:
    image = photo("astronaut", 256)
    copies = {
        "a/original.jpg": jpeg(image, 95),
        "a/resized.jpg": jpeg(image.resize((128, 128))),
        "a/reencoded.jpg": jpeg(image, 40),
        "a/as_png.png": png(image),
        "a/cropped.jpg": jpeg(image.crop((5, 5, 251, 251))),
    }
    for path, data in copies.items():
        write(tmp_path / "src" / path, data)
    with_others(tmp_path / "src")

    report, splits = ingest(tmp_path / "src", tmp_path)

    assert len({splits[path] for path in copies}) == 1
    groups = report["near_duplicates"]["groups"]
    assert [g["paths"] for g in groups] == [sorted(copies)]
    assert report["near_duplicates"]["label_conflicts"] == []


def test_an_existing_placement_never_moves_when_a_near_duplicate_arrives(tmp_path: Path) -> None:
    image = photo("chelsea")
    original = jpeg(image, 95)
    write(tmp_path / "src" / "a" / "original.jpg", original)
    with_others(tmp_path / "src")
    _, before = ingest(tmp_path / "src", tmp_path)
    placed = before["a/original.jpg"]
    # A copy that sorts first by content hash, in another class: placed afresh, its
    # class's quota would decide the group's split.
    copy = next(
        data for quality in range(40, 95) if sha(data := jpeg(image, quality)) < sha(original)
    )
    write(tmp_path / "src" / "b" / "copy.jpg", copy)

    report, after = ingest(tmp_path / "src", tmp_path)

    assert after["a/original.jpg"] == placed  # never moves
    assert after["b/copy.jpg"] == placed  # joins it
    assert report["decoded_count"] == 1  # the others' hashes were reused, not decoded again
    assert all(r["phash"] for r in load_index(tmp_path / "index.json")["records"])


def test_near_duplicates_in_two_classes_are_a_label_conflict_kept_in_one_split(
    tmp_path: Path,
) -> None:
    image = photo("clock")
    copies = {"cup/clock.jpg": jpeg(image, 95)}
    copies["plate/clock_small.jpg"] = jpeg(image.resize((128, 85)))
    for path, data in copies.items():
        write(tmp_path / "src" / path, data)
    with_others(tmp_path / "src")

    report, splits = ingest(tmp_path / "src", tmp_path)

    assert splits["cup/clock.jpg"] == splits["plate/clock_small.jpg"]
    (conflict,) = report["near_duplicates"]["label_conflicts"]
    assert conflict["paths"] == sorted(copies) and conflict["labels"] == ["cup", "plate"]
    assert report["near_duplicates"]["label_conflict_count"] == 1


def flipped(value: int, bits: range) -> int:
    for bit in bits:
        value ^= 1 << bit
    return value


def test_same_inputs_give_the_same_splits_in_any_order_and_chains_stay_together() -> None:
    """A burst: 1~2 and 2~3 within the distance, 1 and 3 too far apart; and a pair elsewhere."""
    first = 0x0123_4567_89AB_CDEF
    second = flipped(first, range(0, 6))
    third = flipped(second, range(20, 26))
    lone = flipped(first, range(32, 64))
    hashes = {"a": first, "b": second, "c": third, "d": lone}
    assert hamming(f"{first:016x}", f"{third:016x}") > DISTANCE >= 6
    items = [Item(k * 64, f"x/{k}.jpg", "x", f"{v:016x}", GREY) for k, v in hashes.items()]

    results = []
    for order in range(6):
        shuffled = random.Random(order).sample(items, len(items))
        results.append(place(shuffled, {}, DISTANCE, EVEN, seed=3).splits)

    assert all(r == results[0] for r in results)
    # the chain goes first (the largest group) to the split with the most room, the lone one
    # to the split its class lags most behind in
    assert results[0] == {"a" * 64: "train", "b" * 64: "train", "c" * 64: "train", "d" * 64: "val"}


@pytest.mark.parametrize("bridge_sha", ["0" * 64, "c" * 64])  # before or after the placed
def test_an_image_bridging_two_placed_splits_is_not_placed_and_says_why(bridge_sha: str) -> None:
    left = 0x0F0F_0F0F_0F0F_0F0F
    right = flipped(left, range(0, 16))
    bridge = flipped(left, range(0, 8))  # 8 bits from each
    items = [
        Item("a" * 64, "x/left.jpg", "x", f"{left:016x}", GREY),
        Item("b" * 64, "x/right.jpg", "x", f"{right:016x}", GREY),
        Item(bridge_sha, "x/bridge.jpg", "x", f"{bridge:016x}", GREY),
    ]
    placement = place(items, {"a" * 64: "train", "b" * 64: "test"}, 10, EVEN, seed=3)

    assert placement.splits == {"a" * 64: "train", "b" * 64: "test"}
    reason = placement.unplaceable[bridge_sha]
    assert "x/left.jpg (train)" in reason and "x/right.jpg (test)" in reason


def planted(seed: int, n: int = 600) -> np.ndarray:
    """Random hashes with planted neighbours at 0-20 bits and a crowded bucket."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    for _ in range(n // 4):
        i, j = rng.integers(0, len(hashes), 2)
        bits = rng.choice(64, int(rng.integers(0, 21)), replace=False)
        hashes[j] = hashes[i] ^ np.uint64(sum(1 << int(b) for b in bits))
    hashes[:40] = hashes[0]
    return hashes


def all_pairs_within(hashes: np.ndarray, distance: int) -> np.ndarray:
    """The all-pairs scan the indexed search must agree with: a boolean matrix."""
    return np.bitwise_count(hashes[:, None] ^ hashes[None, :]) <= distance


@pytest.mark.parametrize("distance", [0, 3, 10, 17])
def test_indexed_search_finds_exactly_the_pairs_an_all_pairs_scan_finds(distance: int) -> None:
    hashes = planted(distance)

    found = near_pairs(hashes, distance)

    expected = np.argwhere(np.triu(all_pairs_within(hashes, distance), 1))
    assert np.array_equal(found, expected)


@pytest.mark.parametrize("distance", [0, 3, 10, 17])
def test_groups_are_the_connected_components_of_every_near_pair(distance: int) -> None:
    """The streamed grouping is exactly the graph's components, named by first position."""
    from scipy.sparse.csgraph import connected_components

    hashes = planted(100 + distance)
    _, expected = connected_components(all_pairs_within(hashes, distance), directed=False)

    groups = near_components(hashes, distance)

    first = {label: int(np.flatnonzero(expected == label)[0]) for label in set(expected.tolist())}
    assert groups.tolist() == [first[label] for label in expected.tolist()]


def test_straddling_pairs_are_every_near_pair_across_splits() -> None:
    hashes = planted(7)
    rng = np.random.default_rng(7)
    splits = rng.choice(["train", "val", "test"], len(hashes)).tolist()
    hexes = [f"{int(h):016x}" for h in hashes]
    expected = [
        (int(i), int(j))
        for i, j in np.argwhere(np.triu(all_pairs_within(hashes, DISTANCE), 1))
        if splits[i] != splits[j]
    ]
    assert expected  # the check has something to find
    assert straddling_pairs(hexes, splits, DISTANCE, [GREY] * len(hexes)) == expected


class CountedUfunc:
    """A NumPy ufunc that counts the elements of its first argument on each call."""

    def __init__(self, ufunc: Any) -> None:
        self.ufunc, self.elements = ufunc, 0

    def __call__(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        self.elements += np.size(first)
        return self.ufunc(first, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # .at, .reduceat: not counted
        return getattr(self.ufunc, name)


def test_grouping_random_hashes_turns_only_the_pairs_found_into_positions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Most photos have no near-duplicate: of the hundreds of candidates each hash is
    compared with, only the few within the distance (itself among them) become positions
    and pair codes. Working out both ends of every candidate made 1,000,000 random hashes
    take about 90 s to group."""
    hashes = np.random.default_rng(3).integers(0, 2**63, 20_000, dtype=np.int64).astype(np.uint64)
    ends = CountedUfunc(np.maximum)
    monkeypatch.setattr(np, "maximum", ends)
    compared = CountedUfunc(np.bitwise_count)
    monkeypatch.setattr(np, "bitwise_count", compared)

    labels = near_components(hashes, DISTANCE)

    assert compared.elements > 40 * len(hashes)  # every hash meets many candidates
    # each hash finds itself once per quarter; the pairs found between hashes are few
    assert ends.elements <= 4 * len(hashes) + 8 * (len(hashes) - len(set(labels.tolist())))


def test_look_alike_sets_sharing_buckets_group_exactly_as_every_pair_would() -> None:
    """Sets of look-alikes that share three quarters but lie far apart stay apart, a chain
    joins two of them, and strays stay alone: the same components as the all-pairs graph,
    with the large buckets settling as they join."""
    from scipy.sparse.csgraph import connected_components

    base = 0x0123_4567_89AB_CDEF
    one = look_alikes(900, seed=1, base=base)
    other = one ^ np.uint64(0xFFFF_FFFF << 16)  # two quarters inverted: 32 bits off
    chained = look_alikes(900, seed=2, base=base ^ 0xFF << 40)  # 8 bits off: some pairs near
    strays = np.random.default_rng(3).integers(0, 2**63, 300).astype(np.uint64)
    hashes = np.concatenate([one, other, chained, strays])
    _, expected = connected_components(all_pairs_within(hashes, DISTANCE), directed=False)

    groups = near_components(hashes, DISTANCE)

    first = {label: int(np.flatnonzero(expected == label)[0]) for label in set(expected.tolist())}
    assert groups.tolist() == [first[label] for label in expected.tolist()]
    assert groups[0] != groups[900]  # the inverted quarter keeps the second set apart


def skewed_grouped_set(seed: int) -> tuple[list[Item], list[list[str]]]:
    """2,000 / 400 / 100 / 30 images of four classes, in groups of copies (one hash and
    thumbnail each) of 1 to 8 images, a group of 30 in the largest class and one spanning
    two classes; the items and each group's content hashes."""
    rng = np.random.default_rng(seed)
    items: list[Item] = []
    groups: list[list[str]] = []

    def group(members: list[tuple[str, int]]) -> None:
        phash = f"{int(rng.integers(0, 2**63)):016x}"
        thumb = rng.integers(0, 256, 256, dtype=np.uint8).tobytes().hex()
        shas = [hashlib.sha256(f"{label}/{k}".encode()).hexdigest() for label, k in members]
        items.extend(
            Item(sha, f"{label}/{k}.png", label, phash, thumb)
            for sha, (label, k) in zip(shas, members, strict=True)
        )
        groups.append(shas)

    group([("big", k) for k in range(30)])
    group([("mid", 0), ("mid", 1), ("small", 0), ("small", 1)])
    for label, count, start in (
        ("big", 2000, 30),
        ("mid", 400, 2),
        ("small", 100, 2),
        ("rare", 30, 0),
    ):
        k = start
        while k < count:
            size = min(count - k, int(rng.choice([1, 1, 1, 1, 2, 3, 8])))
            group([(label, k + i) for i in range(size)])
            k += size
    return items, groups


def test_groups_are_placed_whole_and_every_class_keeps_its_shares() -> None:
    """Each class of 100 images or more lands within 2 points of the shares in every split,
    whatever the order the images come in; the class-spanning and the large group are
    flagged."""
    items, groups = skewed_grouped_set(11)
    shares = {"train": 0.8, "val": 0.1, "test": 0.1}

    placement = place(items, {}, DISTANCE, shares, seed=1337)

    assert all(len({placement.splits[sha] for sha in group}) == 1 for group in groups)
    for label in ("big", "mid", "small"):
        mine = [placement.splits[i.sha256] for i in items if i.label == label]
        for name, share in shares.items():
            assert abs(mine.count(name) / len(mine) - share) <= 0.02, (label, name)
    shuffled = random.Random(2).sample(items, len(items))
    assert place(shuffled, {}, DISTANCE, shares, seed=1337).splits == placement.splits
    flagged = sorted(len(g["paths"]) for g in placement.flagged)
    assert flagged == [4, 30]  # spans two classes; holds more than 1% of the images


def test_a_split_of_no_share_is_given_nothing() -> None:
    """The bench indexes every image into train (val and test of no share): placement
    divided by the share and stopped the bench's preparation with a ZeroDivisionError."""
    items, _groups = skewed_grouped_set(11)

    placement = place(items, {}, DISTANCE, {"train": 1.0, "val": 0.0, "test": 0.0}, seed=1337)

    assert set(placement.splits.values()) == {"train"}
    assert len(placement.splits) == len(items)


def test_a_pair_the_hash_finds_is_near_only_when_the_thumbnails_agree() -> None:
    """Two images of one layout (one hash) but other pictures are two groups; validation
    finds no leak between them, and a real copy across splits is still found."""
    layout = "0123456789abcdef"
    dark, light = "10" * 256, "f0" * 256
    items = [
        Item("a" * 64, "flags/one.png", "flags", layout, dark),
        Item("b" * 64, "flags/other.png", "flags", layout, light),
    ]

    placement = place(items, {}, DISTANCE, EVEN, seed=3)

    assert placement.groups == []
    hexes, thumbs = [layout] * 3, [dark, light, dark]
    assert straddling_pairs(hexes, ["train", "test", "val"], DISTANCE, thumbs) == [(0, 2)]
