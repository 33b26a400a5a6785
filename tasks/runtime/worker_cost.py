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
# (the slower of the ingest and shard pools), as `python -m bench --only worker_start`
# measures it on an idle machine: while other processes hold the cores it is longer, but the
# work itself slows alike, so the break-even holds.
WORKER_START_S = 0.4
# Unit costs of the work itself on one core, from the bench's stage figures (the measurements
# behind each are in docs/performance.md, "When workers pay"):
CHECK_SECONDS_PER_BYTE = 11e-3 / 2**20  # ingest checks a JPEG at 1/8 scale: the bytes decoded
# ... plus a fixed cost per file whatever its size (stat, open, read, hash, header, perceptual
# hash), which is what sends many small files to the workers when their bytes alone would not.
CHECK_SECONDS_PER_FILE = 0.35e-3
SHARD_SECONDS_PER_RECORD = 1e-3  # shard: per record (read, hash, encode, frame)
SHARD_SECONDS_PER_PIXEL = 2.5e-9  # shard: per source pixel decoded and resized
# A record whose decode ingest handed off (tasks.contracts.handoff) is made by ingest, which
# resizes its 1/8-scale decode (1/64 of the pixels); the shard stage decodes and resizes none
# of it, and only encodes and frames the kept pixels.
HANDED_OFF_PIXEL_FRACTION = 1 / 64
# A hand-off entry is a file of its own: ingest checksums, writes and renames it; the shard
# stage reads, checks and removes it. The bench's `handoff.entry_ms` measures that cost net of
# the decodes the entries save; the figure held here sits above it, so a small image is
# decoded twice rather than handed off at a loss. Plus its pixels, written and read back.
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
    from tasks.runtime.latency import enabled

    if not enabled("worker_cost"):
        return workers >= 2  # no cost model: workers whenever more than one is asked for
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
    instead; the entry's cost is a file written, read back and removed. Photos (a few MP) save
    more than their entry costs and are kept; small images save less and are decoded again
    (the break-even size is the bench's ``handoff.break_even_mp``).
    """
    saved = SHARD_SECONDS_PER_PIXEL * pixels * (1 - HANDED_OFF_PIXEL_FRACTION)
    return saved > HANDOFF_ENTRY_S + HANDOFF_SECONDS_PER_BYTE * entry_bytes
