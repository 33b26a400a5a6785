"""When spawned worker processes pay: one cost model for every stage that spawns them.

Work estimated at ``W`` seconds of one core takes about ``W`` in the stage's own process, and
``start + W / n`` on ``n`` workers that first spawn, import and warm up in ``start`` seconds;
the workers pay from ``W >= start * n / (n - 1)`` (:func:`break_even_s`). ``start`` is
:data:`WORKER_START_S`, measured by the bench (section ``worker_start``, which records it
and the break-even as ``workers.start_s`` and ``workers.break_even_s``). Each stage estimates
``W`` from what it knows before decoding anything: ingest from file sizes
(:func:`check_seconds`), shard from its records' pixels (:func:`shard_seconds`). The same
figures decide whether ingest keeps a decode for the shard stage (:func:`worth_handing_off`).
Dependency-free: ingest and shard both import it without importing each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# Seconds for a pool of spawned workers to start, import their stage's modules and warm up
# (the slower of the ingest and shard pools, 2 workers), as `python -m bench --only
# worker_start` measures it on the idle 2-core reference VM (the latest figure and its
# break-even are in docs/performance.md; it is longer while other processes hold the cores,
# when the work itself slows alike).
WORKER_START_S = 0.4
# Unit costs of the work itself, one core, from the bench's stage figures:
CHECK_SECONDS_PER_BYTE = 11e-3 / 2**20  # ingest checks a JPEG: ~11 ms a MB (1/8-scale decode)
# ... and ~0.35 ms a file whatever its size (stat, open, read, hash, header, perceptual hash):
# 10,000 JPEGs of 64-128 px (38 MB) took one process 4.3 s, two workers 3.4 s.
CHECK_SECONDS_PER_FILE = 0.35e-3
SHARD_SECONDS_PER_RECORD = 1e-3  # shard: per record (read, hash, encode, frame)
SHARD_SECONDS_PER_PIXEL = 2.5e-9  # shard: per source pixel decoded (a 12 MP photo: ~31 ms)
# A record whose decode ingest handed off (tasks.contracts.handoff) is made by ingest, which resizes
# its 1/8-scale decode (1/64 of the pixels: a 12 MP photo ~1 ms); the shard stage decodes
# and resizes none of it, and only encodes and frames the kept pixels.
HANDED_OFF_PIXEL_FRACTION = 1 / 64
# A hand-off entry is a file of its own: ingest checksums, writes and renames it; the shard
# stage reads, checks and removes it. What that cost the data side (ingest + shard) for an
# image whose entry saved no decode: 0.3-1.4 ms (entries the shard stage did not use, before
# they held the record's pixels). The bench's worker_start section now measures it net of
# the small decodes the entries save (``handoff.entry_ms``: every decode of 1,000 images of
# 200-400 px kept for 32 px records, against none): 0.03 ms, so the 1 ms held is on the safe
# side. Plus its pixels, ~3.5 ms a MB (a 224 px record, 0.14 MB: 0.5 ms).
HANDOFF_ENTRY_S = 1.0e-3
HANDOFF_SECONDS_PER_BYTE = 3.5e-3 / 2**20


def break_even_s(workers: int) -> float:
    """Estimated work (seconds of one core) from which ``workers`` spawned workers pay."""
    if workers < 2:
        return math.inf  # one worker only adds its start-up to the same serial work
    return WORKER_START_S * workers / (workers - 1)


def worth_workers(seconds: Iterable[float], workers: int) -> bool:
    """Whether work estimated as the sum of ``seconds`` reaches :func:`break_even_s`.

    Summing stops there, so a first run over a million files estimates only its first few
    thousand.
    """
    need = break_even_s(workers)
    total = 0.0
    for estimate in seconds:
        total += estimate
        if total >= need:
            return True
    return False


def check_seconds(file_bytes: int) -> float:
    """Ingest's estimate for checking one file of ``file_bytes``."""
    return CHECK_SECONDS_PER_FILE + CHECK_SECONDS_PER_BYTE * file_bytes


def shard_seconds(width: int, height: int, *, handed_off: bool = False) -> float:
    """Shard's estimate for writing the record of one ``width`` x ``height`` source image
    (``handed_off``: from the pixels ingest kept, with no decode or resize)."""
    pixels = 0 if handed_off else width * height
    return SHARD_SECONDS_PER_RECORD + SHARD_SECONDS_PER_PIXEL * pixels


def worth_handing_off(pixels: int, entry_bytes: int) -> bool:
    """Whether ingest keeping its decode of an image of ``pixels`` source pixels, in an entry
    of ``entry_bytes``, costs less than the decode it saves the shard stage
    (:mod:`tasks.contracts.handoff`).

    The data side's saving is :func:`shard_seconds`' decode less the resize ingest does
    instead; the entry's cost is a file written, read back and removed. Photos (a few MP)
    save 5-30 ms an entry and are kept; small images (under ~0.4 MP) save less than their
    entry costs and are decoded again: on 3,000 images of 200-400 px, keeping them all took
    ingest + shard from 4.1 s to 6.8 s.
    """
    saved = SHARD_SECONDS_PER_PIXEL * pixels * (1 - HANDED_OFF_PIXEL_FRACTION)
    return saved > HANDOFF_ENTRY_S + HANDOFF_SECONDS_PER_BYTE * entry_bytes
