"""What a hand-off entry costs the data side: the constants of
:func:`tasks.contracts.handoff.worth_handing_off`."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.stats import median


@contextmanager
def every_decode_kept() -> Iterator[None]:
    """Ingest keeps every decode for the shard stage inside, small images too (the cost of
    a hand-off entry is taken as nothing): the alternative the cost model is measured against."""
    from tasks.contracts import handoff

    saved = handoff.HANDOFF_ENTRY_S, handoff.HANDOFF_SECONDS_PER_BYTE
    handoff.HANDOFF_ENTRY_S = handoff.HANDOFF_SECONDS_PER_BYTE = 0.0
    try:
        yield
    finally:
        handoff.HANDOFF_ENTRY_S, handoff.HANDOFF_SECONDS_PER_BYTE = saved


def data_side_s(source: Path, root: Path, *, handoff: bool) -> float:
    """Seconds of ingest then the shard stage over ``source`` in a fresh ``root`` (one process,
    no workers: the entries' cost is not hidden by a second core), with or without the
    hand-off."""
    from tasks.contracts.handoff import Target
    from tasks.ingest.stage import run_ingest
    from tasks.runtime.params import default_params
    from tasks.shard.stage import shard_stage

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # 32 px records: the shard stage would decode these small JPEGs at ingest's 1/8 check
    # scale, so ingest keeps them (at 64 px most decode at 1/4, and none would be kept)
    shard = {"workers": 1, "image_size": [32, 32]}
    params = default_params(ingest={"source_dir": str(source), "workers": 1}, shard=shard)
    kept = root / "handoff" if handoff else None
    start = time.perf_counter()
    target = Target.of(params.shard)
    run_ingest(
        params.ingest, root / "index.json", root / "ingest.json", handoff=kept, target=target
    )
    shard_stage(params.shard, root / "index.json", root / "shards", handoff=kept)
    return time.perf_counter() - start


def measure_handoff_entry(work: Path, images: int = 1000, passes: int = 3) -> dict[str, Any]:
    """What a hand-off entry of a small image costs the data side (ingest + shard) where it
    saves next to no decode: per image, every decode kept less none kept, on ``images`` JPEGs
    of 200-400 px (the bench's own set), median of ``passes`` alternating pairs; beside the
    constant :func:`tasks.contracts.handoff.worth_handing_off` uses and the source megapixels from
    which, with that constant, an entry saves more than it costs."""
    from bench.images import generate_images
    from tasks.contracts.handoff import (
        HANDED_OFF_PIXEL_FRACTION,
        HANDOFF_ENTRY_S,
        SHARD_SECONDS_PER_PIXEL,
    )

    source = generate_images(work / f"images-{images}", images, workers=1)
    kept, none = [], []
    for _ in range(passes):
        with every_decode_kept():
            kept.append(data_side_s(source, work / "run", handoff=True))
        none.append(data_side_s(source, work / "run", handoff=False))
    shutil.rmtree(work / "run", ignore_errors=True)
    saved_per_pixel = SHARD_SECONDS_PER_PIXEL * (1 - HANDED_OFF_PIXEL_FRACTION)
    return {
        "entry_ms": round((median(kept) - median(none)) / images * 1e3, 3),
        "break_even_mp": round(HANDOFF_ENTRY_S / saved_per_pixel / 1e6, 3),
        "details": {
            "images": images,
            "every_decode_kept_s": [round(t, 3) for t in kept],
            "none_kept_s": [round(t, 3) for t in none],
            "constant_entry_ms": HANDOFF_ENTRY_S * 1e3,
        },
    }
