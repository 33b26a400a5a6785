"""The training order: every epoch a seeded permutation of the whole split, by position."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tasks.contracts.record_order import (
    EpochOrder,
    SplitLocations,
    batch_record_ids,
    epoch_steps,
    slices_record_ids,
)
from tasks.tfrecord import CorruptRecord, frame_record, read_framed_at


@pytest.mark.parametrize("size", [1, 2, 3, 5, 17, 64, 100, 1000, 4097])
@pytest.mark.parametrize("seed", [0, 1, -3, 2**63 + 5])
def test_every_epoch_order_is_a_permutation_of_the_split(size: int, seed: int) -> None:
    ids = EpochOrder(size, seed).record_ids(np.arange(size))
    assert sorted(ids.tolist()) == list(range(size))


def test_the_order_depends_on_the_seed_alone() -> None:
    first = EpochOrder(1000, 7).record_ids(np.arange(1000))
    assert EpochOrder(1000, 7).record_ids(np.arange(1000)).tolist() == first.tolist()
    assert EpochOrder(1000, 8).record_ids(np.arange(1000)).tolist() != first.tolist()
    # a position maps to its record on its own: a read resumed at any position agrees
    assert EpochOrder(1000, 7).record_ids([500, 3]).tolist() == [first[500], first[3]]


def test_any_record_can_come_first() -> None:
    """Over many seeds the record at position 0 spreads over the whole split (a local
    shuffle keeps it among its file's first neighbours): a chi-square bound on 10 bins."""
    size, seeds = 1000, 4000
    firsts = np.array([EpochOrder(size, seed).record_ids([0])[0] for seed in range(seeds)])
    counts = np.bincount(firsts * 10 // size, minlength=10)
    expected = seeds / 10
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 27.9  # p = 0.001 for 9 degrees of freedom


def test_neighbours_are_not_kept_together() -> None:
    """Consecutive positions land far apart: a split read in blocks would keep them close."""
    ids = EpochOrder(10_000, 3).record_ids(np.arange(10_000))
    gaps = np.abs(np.diff(ids))
    assert np.median(gaps) > 1000  # ~2,900 for a uniform permutation


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_replica_slices_make_up_the_global_batch_for_any_number_of_replicas(replicas: int) -> None:
    order = EpochOrder(333, 11)
    for step in range(epoch_steps(333, 32)):
        whole = batch_record_ids(order, step, 32)
        parts = [batch_record_ids(order, step, 32, r, replicas) for r in range(replicas)]
        assert np.concatenate(parts).tolist() == whole.tolist()


def test_slices_located_together_are_the_slices_located_one_by_one() -> None:
    """The reader locates a few replica slices per call: any mix of steps and replicas in
    one call gives each row what that slice alone gives, and a step past the epoch in the
    mix is refused."""
    order = EpochOrder(333, 5)
    steps, replica_ids = [3, 3, 4, 9, 0], [0, 3, 1, 2, 3]
    rows = slices_record_ids(order, steps, 32, replica_ids, 4)
    assert rows.shape == (5, 8)
    for row, step, replica in zip(rows, steps, replica_ids, strict=True):
        assert row.tolist() == batch_record_ids(order, step, 32, replica, 4).tolist()
    with pytest.raises(IndexError, match="past the 10 steps"):
        slices_record_ids(order, [2, 10], 32, [0, 0], 1)


def test_an_epoch_reads_whole_batches_and_never_a_record_twice() -> None:
    order = EpochOrder(333, 2)
    assert epoch_steps(333, 32) == 10
    read = np.concatenate([batch_record_ids(order, step, 32) for step in range(10)])
    assert len(set(read.tolist())) == 320
    with pytest.raises(IndexError, match="past the 10 steps"):
        batch_record_ids(order, 10, 32)


def test_a_batch_that_does_not_split_over_the_replicas_is_refused_naming_the_param() -> None:
    with pytest.raises(ValueError, match=r"train.batch_size=30 .* 4 equal replica"):
        batch_record_ids(EpochOrder(100, 0), 0, 30, 0, 4)


def test_locations_follow_the_offset_index_in_manifest_order() -> None:
    locations = SplitLocations.from_offsets(["a", "b"], [([0, 10, 25], 40), ([0, 7], 20)])
    assert len(locations) == 5
    files, offsets, sizes = locations.of(np.array([4, 0, 2]))
    assert files.tolist() == [1, 0, 0]
    assert offsets.tolist() == [7, 0, 25]
    assert sizes.tolist() == [13, 10, 15]


def test_a_framed_record_is_read_at_its_offset_and_a_damaged_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    first, second = frame_record(b"one"), frame_record(b"record two")
    path.write_bytes(first + second)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_framed_at(fd, len(first), len(second), "x") == b"record two"
        with pytest.raises(CorruptRecord, match=r"shard at byte 0: the record says 3 bytes"):
            read_framed_at(fd, 0, len(first) + 1, f"{path} at byte 0")
        with pytest.raises(CorruptRecord, match="ends inside the record"):
            read_framed_at(fd, len(first), len(second) + 4, "x")
    finally:
        os.close(fd)
    damaged = bytearray(first + second)
    damaged[len(first) + 14] ^= 0xFF
    path.write_bytes(bytes(damaged))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptRecord, match="data's CRC does not match"):
            read_framed_at(fd, len(first), len(second), "x")
    finally:
        os.close(fd)


def test_walking_an_epoch_holds_no_memory_that_grows_with_it() -> None:
    """The order keeps its round keys once: reading 2,000 batches of a million-record epoch
    leaves no more allocated than reading 20 (each batch's keys were once kept alive)."""
    import tracemalloc

    import tasks.contracts.record_order as module

    order = EpochOrder(1_000_000, 0)
    # only what the order's own code allocated: other threads of the process allocate too
    own_code = [tracemalloc.Filter(True, module.__file__)]

    def held_after(steps: int) -> int:
        tracemalloc.start()
        for step in range(steps):
            batch_record_ids(order, step, 64)
        held = tracemalloc.take_snapshot().filter_traces(own_code)
        tracemalloc.stop()
        return sum(stat.size for stat in held.statistics("filename"))

    held_after(1)  # the first call computes the keys
    assert held_after(2000) <= held_after(20) + 4096
