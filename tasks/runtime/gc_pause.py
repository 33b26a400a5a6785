"""Garbage-collector control for the stages that build large acyclic data."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a stage builds large acyclic data.

    Index records, verdicts and record lists are dicts, lists and strings: reference
    counting frees them and they form no cycle, yet the cyclic collector walks the whole
    growing heap each time allocations pass its thresholds, a cost that grows with the heap
    (docs/performance.md has the saving). The collector runs again on exit (any cycle made
    meanwhile is collected then); inside an outer pause this is a no-op. Also a decorator.
    """
    from tasks.runtime.latency import enabled

    if not gc.isenabled() or not enabled("gc_pause"):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
