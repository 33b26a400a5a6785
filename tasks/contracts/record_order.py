"""The order training reads a split in: every epoch a seeded permutation of the whole split.

An epoch of ``n`` records at global batch ``G`` is positions ``[0, (n // G) * G)`` of a
pseudo-random permutation of the record ids ``0 .. n - 1`` (manifest order: the split's shards
in the manifest's order, each shard's records in file order). The permutation is a Feistel
network over the smallest even power of two at least ``n``, walked until it lands inside
``[0, n)`` (cycle walking): any record can land at any position, and the order of an epoch
costs no memory that grows with ``n``: position ``p`` maps to its record id on its own, so a
read can start at any step of any epoch (an exact resume) and every worker computes the same
global batch. The keys come from one integer seed (the run's seed mixed with the epoch, see
``tasks.train.loop.epoch_seed``), hashed with BLAKE2b: the same seed gives the same order on
every machine, TensorFlow version and process. Global batch ``g`` holds positions
``[g * G, (g + 1) * G)``; replica ``r`` of ``R`` takes the ``r``-th of its ``R`` equal slices,
so the sequence of global batches is the same for any number of workers.

:class:`SplitLocations` turns record ids into where each record's framed bytes lie (shard
file, offset, size), from the offset index the shard stage writes (``offsets.json``).

No TensorFlow here: the order is a pure function, tested and measured on its own.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROUNDS = 6  # Feistel rounds: 3 make a pseudo-random permutation, more mix small domains better


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 ``values`` (wrapping arithmetic)."""
    z = values
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class EpochOrder:
    """A seeded permutation of ``[0, size)``: :meth:`record_ids` maps positions to record ids.

    Holds ``size``, the half-width of its domain and ``ROUNDS`` round keys, whatever ``size``.
    """

    size: int
    seed: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"an epoch order needs at least one record, got size={self.size}")

    @property
    def half_bits(self) -> int:
        """Bits of each Feistel half: the domain ``4 ** half_bits`` is at least ``size``."""
        return max(1, ((self.size - 1).bit_length() + 1) // 2)

    @functools.cached_property
    def keys(self) -> tuple[np.uint64, ...]:
        """One 64-bit key per round, from the seed alone (computed once per order)."""
        seed = int(self.seed) & 0xFFFFFFFFFFFFFFFF
        digest = hashlib.blake2b(
            seed.to_bytes(8, "little"), digest_size=8 * ROUNDS, person=b"shardflow-order"
        ).digest()
        words = np.frombuffer(digest, dtype="<u8")
        return tuple(np.uint64(word) for word in words)

    def record_ids(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The record id at each of ``positions`` (int64 in ``[0, size)``), as int64."""
        values = np.asarray(positions, dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() >= self.size):
            raise IndexError(
                f"positions must lie in [0, {self.size}), got {values.min()}..{values.max()}"
            )
        out = values.astype(np.uint64)
        keys = self.keys
        pending = np.arange(out.size)
        # Cycle walking: a value the network sends outside [0, size) goes through it again;
        # the network is a permutation of its domain, so each walk ends inside.
        while pending.size:
            out[pending] = self._permute(out[pending], keys)
            pending = pending[out[pending] >= np.uint64(self.size)]
        return out.astype(np.int64)

    def _permute(self, values: np.ndarray, keys: tuple[np.uint64, ...]) -> np.ndarray:
        bits = np.uint64(self.half_bits)
        half = (np.uint64(1) << bits) - np.uint64(1)
        left, right = values >> bits, values & half
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & half)
        return (left << bits) | right


def epoch_steps(num_records: int, global_batch: int) -> int:
    """Global batches of one epoch: every batch full, the last ``n % G`` positions unread."""
    return num_records // global_batch


def batch_record_ids(
    order: EpochOrder, step: int, global_batch: int, replica: int = 0, replicas: int = 1
) -> np.ndarray:
    """Record ids of ``replica``'s slice (of ``replicas`` equal ones) of global batch ``step``."""
    return slices_record_ids(order, [step], global_batch, [replica], replicas)[0]


def slices_record_ids(
    order: EpochOrder,
    steps: Sequence[int] | np.ndarray,
    global_batch: int,
    replica_ids: Sequence[int] | np.ndarray,
    replicas: int,
) -> np.ndarray:
    """int64 [k, global_batch / replicas]: row ``i`` holds the record ids of replica
    ``replica_ids[i]``'s slice of global batch ``steps[i]`` (:func:`batch_record_ids` for
    ``k`` slices in one call: a reader locates a few batches at a time)."""
    if global_batch % replicas:
        raise ValueError(
            f"train.batch_size={global_batch} does not split into {replicas} equal replica "
            "batches; make it a multiple of the replicas"
        )
    step_array = np.asarray(steps, dtype=np.int64)
    last = epoch_steps(order.size, global_batch)
    if step_array.size and (step_array.min() < 0 or step_array.max() >= last):
        raise IndexError(f"step {step_array.max()} is past the {last} steps of an epoch")
    per_replica = global_batch // replicas
    starts = step_array * global_batch + np.asarray(replica_ids, dtype=np.int64) * per_replica
    positions = starts[:, None] + np.arange(per_replica, dtype=np.int64)
    return order.record_ids(positions.ravel()).reshape(positions.shape)


@dataclass(frozen=True)
class SplitLocations:
    """Where each record of a split lies: ``file_ids[i]`` into ``files``, the framed record
    (header, data, footer) at ``offsets[i]`` spanning ``sizes[i]`` bytes; ids in manifest
    order."""

    files: tuple[str, ...]
    file_ids: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n]
    sizes: np.ndarray  # int64 [n]

    @classmethod
    def from_offsets(
        cls, files: Sequence[str | Path], shards: Sequence[tuple[Sequence[int], int]]
    ) -> SplitLocations:
        """From each file's record offsets and the byte its last record ends at."""
        ids, offsets, sizes = [], [], []
        for number, (starts, end) in enumerate(shards):
            starts_array = np.asarray(starts, dtype=np.int64)
            ids.append(np.full(starts_array.size, number, dtype=np.int32))
            offsets.append(starts_array)
            sizes.append(np.diff(np.append(starts_array, np.int64(end))))
        return cls(
            tuple(str(f) for f in files),
            np.concatenate(ids) if ids else np.zeros(0, np.int32),
            np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
            np.concatenate(sizes) if sizes else np.zeros(0, np.int64),
        )

    def __len__(self) -> int:
        return int(self.file_ids.size)

    def of(self, record_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(file_ids, offsets, sizes)`` of ``record_ids``."""
        return self.file_ids[record_ids], self.offsets[record_ids], self.sizes[record_ids]
