"""What cuts a stage's latency, and the switch that turns each piece off to measure it.

``SHARDFLOW_LATENCY_OFF`` (comma-separated names of :data:`PIECES`) turns pieces off in this
process and every process it starts (a stage's children and workers, the stages
``dvc repro`` runs): ``python -m bench`` sets it to time each piece with and without
(docs/performance.md, "Orchestration tax, and what a stage process pays"). Unset, every
piece is on.
"""

from __future__ import annotations

import os

OFF_ENV = "SHARDFLOW_LATENCY_OFF"
PIECES = ("prestart", "fast_exit", "gc_pause", "worker_cost")


def enabled(piece: str) -> bool:
    """Whether ``piece`` (one of :data:`PIECES`) is on: not named in ``SHARDFLOW_LATENCY_OFF``."""
    if piece not in PIECES:
        raise ValueError(f"{piece!r} is not a latency piece; choose from {list(PIECES)}")
    return piece not in {name.strip() for name in os.environ.get(OFF_ENV, "").split(",")}
