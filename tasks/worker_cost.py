"""When spawned worker processes pay: one cost model for every stage that spawns them.

Work estimated at ``W`` seconds of one core takes about ``W`` in the stage's own process, and
``start + W / n`` on ``n`` workers that first spawn, import and warm up in ``start`` seconds;
the workers pay from ``W >= start * n / (n - 1)`` (:func:`break_even_s`). ``start`` is
:data:`WORKER_START_S`, measured by the bench (section ``worker_start``, which records it
and the break-even as ``workers.start_s`` and ``workers.break_even_s``). Each stage estimates
``W`` from what it knows before decoding anything: ingest from file sizes
(:func:`check_seconds`), shard from its records' pixels (:func:`shard_seconds`).
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
SHARD_SECONDS_PER_RECORD = 1e-3  # shard: per record (read, hash, encode, frame)
SHARD_SECONDS_PER_PIXEL = 2.5e-9  # shard: per source pixel decoded (a 12 MP photo: ~31 ms)
# A record whose decode ingest handed off (tasks.handoff) is resized from ingest's 1/8-scale
# decode, 1/64 of the pixels, and decodes none: a 12 MP photo ~1.5 ms (measured 1.3 ms).
HANDED_OFF_PIXEL_FRACTION = 1 / 64


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
    return CHECK_SECONDS_PER_BYTE * file_bytes


def shard_seconds(width: int, height: int, *, handed_off: bool = False) -> float:
    """Shard's estimate for writing the record of one ``width`` x ``height`` source image
    (``handed_off``: from ingest's kept decode instead of a decode)."""
    pixels = width * height * (HANDED_OFF_PIXEL_FRACTION if handed_off else 1.0)
    return SHARD_SECONDS_PER_RECORD + SHARD_SECONDS_PER_PIXEL * pixels
