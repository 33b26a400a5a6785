"""The test records a comparison counts: never one the champion or the challenger saw,
however the split moved since the champion was trained."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from tasks.evaluate.seen_records import SeenRecords, UnseenTest, unseen_test
from tasks.runtime.params import SplitFractions

IMAGES = [hashlib.sha256(f"image {n}".encode()).hexdigest() for n in range(2000)]
SPLITS = SplitFractions(train=0.8, val=0.1, test=0.1)
Placement = dict[str, str]  # content hash -> split


def assign_split(key: str, fractions: SplitFractions, seed: int) -> str:
    """A seeded split for ``key``: the placement rule does not matter here, only that the
    split moves when its inputs do (ingest's own rule: tests/unit/contracts)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    draw = int.from_bytes(digest[:8], "big") / 2**64
    if draw < fractions.train:
        return "train"
    return "val" if draw < fractions.train + fractions.val else "test"


def placed(
    hashes: list[str], seed: int = 42, fractions: SplitFractions = SPLITS, groups: int = 0
) -> Placement:
    """Each image's split as ingest places it; with ``groups``, images are joined into
    that many near-duplicate groups (by their hash's first byte), each placed whole by its
    first member: another grouping rule moves whole groups."""
    if not groups:
        return {h: assign_split(h, fractions, seed) for h in hashes}
    leader: dict[int, str] = {}
    for h in hashes:
        leader.setdefault(int(h[:2], 16) % groups, h)
    return {h: assign_split(leader[int(h[:2], 16) % groups], fractions, seed) for h in hashes}


def seen(placement: Placement) -> SeenRecords:
    """What a model trained on ``placement`` learned from."""
    train = frozenset(h for h, s in placement.items() if s == "train")
    val = frozenset(h for h, s in placement.items() if s == "val")
    return SeenRecords("f" * 64, train, val)


def in_test(placement: Placement) -> list[str]:
    """Today's test records' hashes, in order."""
    return [h for h, s in placement.items() if s == "test"]


MOVES: dict[str, Callable[[], Placement]] = {
    "ingest.seed": lambda: placed(IMAGES, seed=43),
    "ingest.splits": lambda: placed(
        IMAGES, fractions=SplitFractions(train=0.7, val=0.15, test=0.15)
    ),
    "near_duplicate_distance": lambda: placed(IMAGES, groups=40),
    "an append": lambda: placed(
        IMAGES + [hashlib.sha256(f"new {n}".encode()).hexdigest() for n in range(300)]
    ),
    "a forget": lambda: placed(IMAGES[150:]),
}


def checked(champion: Placement, current: Placement) -> UnseenTest:
    """The comparison's records after the split moved from ``champion`` to ``current``,
    checked record by record against what either model saw."""
    champion_seen, candidate_seen = seen(champion), seen(current)
    tested_now = in_test(current)
    unseen = unseen_test(tested_now, champion_seen, candidate_seen)
    kept = {h for h, keep in zip(tested_now, unseen.keep, strict=True) if keep}
    assert not kept & (champion_seen.hashes | candidate_seen.hashes)
    assert kept == set(tested_now) - champion_seen.hashes - candidate_seen.hashes
    assert unseen.left_out == unseen.champion_saw + unseen.candidate_saw + unseen.both_saw
    return unseen


@pytest.mark.parametrize("move", MOVES)
def test_no_comparison_counts_a_record_either_model_saw_however_the_split_moved(
    move: str,
) -> None:
    unseen = checked(placed(IMAGES), MOVES[move]())
    if move in ("an append", "a forget"):  # old images keep their split
        assert unseen.left_out == 0 and unseen.unseen > 0
    else:  # the move put records the champion learned from into today's test split
        assert unseen.champion_saw > 0 and unseen.unseen > 0
        assert f"{unseen.left_out} of {unseen.total} test records left out" in (
            unseen.in_words("3")
        )


def test_moves_one_after_another_never_count_a_record_seen_by_either_model() -> None:
    """A champion from two moves ago: a new seed, then a regrouping, then a forget."""
    before = placed(IMAGES)
    now = placed(IMAGES[100:], seed=7, groups=40)
    unseen = checked(before, now)
    assert unseen.champion_saw > 0 and unseen.unseen > 0


def test_seen_records_round_trip_as_the_artifact_holds_them() -> None:
    records = seen(placed(IMAGES[:50]))
    data = records.to_dict()
    assert data["train"] == sorted(data["train"])
    assert SeenRecords.from_dict(data) == records
