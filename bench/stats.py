"""Pure helpers: medians, ratios, timed passes and the target checks the report prints."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence; raises with a clear message when empty."""
    if not values:
        raise ValueError("median of no values (did every pass fail?)")
    return float(statistics.median(values))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either side is missing or the divisor is 0."""
    if numerator is None or denominator is None:
        return None
    if not math.isfinite(numerator) or not math.isfinite(denominator) or denominator == 0:
        return None
    return numerator / denominator


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points (two or more, at
    least two different ``xs``): a cost per item and the fixed cost beside it."""
    if len(set(xs)) < 2 or len(xs) != len(ys):
        raise ValueError(f"a line needs two different x values, got {list(xs)}")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


def timed_passes(
    run: Callable[[], int | tuple[int, float]], *, passes: int, warmup: int = 1
) -> dict[str, Any]:
    """Call ``run`` ``warmup + passes`` times; it returns items processed, or (items, seconds).

    Returns ``{"per_s": median items/s over the timed passes, "passes": [...], "items": n}``.
    Warm-up passes are run and discarded (graph tracing, file cache, thread pools). A run
    that times itself (a subprocess reporting its own clock) returns ``(items, seconds)``.
    """
    return alternating_passes({"run": run}, passes=passes, warmup=warmup)["run"]


def alternating_passes(
    runs: Mapping[str, Callable[[], int | tuple[int, float]]], *, passes: int, warmup: int = 1
) -> dict[str, dict[str, Any]]:
    """:func:`timed_passes` of several runs, taken in turns: every run's warm-up first,
    then pass 1 of each, pass 2 of each, ... A slow spell of the machine then falls on all
    of them alike instead of on one figure, so ratios between them hold (two read figures
    timed a minute apart on a noisy VM can differ several-fold).
    """
    for run in runs.values():
        for _ in range(warmup):
            run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    items: dict[str, int] = {}
    for _ in range(max(1, passes)):
        for name, run in runs.items():
            # Writes of the runs before (a store read fills its cache) reach the disk now,
            # not inside this pass.
            os.sync()
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            items[name], elapsed = result if isinstance(result, tuple) else (result, elapsed)
            rates[name].append(items[name] / elapsed if elapsed > 0 else float("inf"))
    return {
        name: {
            "per_s": median(values),
            "passes": [round(r, 2) for r in values],
            "items": items[name],
        }
        for name, values in rates.items()
    }


def for_at_least(run: Callable[[], int], seconds: float) -> Callable[[], tuple[int, float]]:
    """``run`` repeated until ``seconds`` have gone by: (items, seconds) of all the calls.

    A read epoch of the bench's raw images is short enough that one hiccup of the machine
    halves a pass; a timed pass of a few seconds averages them out.
    """

    def repeated() -> tuple[int, float]:
        start = time.perf_counter()
        count = 0
        while True:
            count += run()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return count, elapsed

    return repeated


@dataclass(frozen=True)
class Target:
    """``measured op threshold``, e.g. read.raw / read.folder >= 4."""

    name: str
    numerator: str  # report key (or expression label) of the measured value
    denominator: str | None  # None: the measured value is compared directly
    op: Literal[">=", "<=", "<"]
    threshold: float

    def evaluate(self, figures: dict[str, Any]) -> dict[str, Any]:
        top = _number(figures.get(self.numerator))
        value = (
            top if self.denominator is None else ratio(top, _number(figures.get(self.denominator)))
        )
        passed = None if value is None else compare(value, self.op, self.threshold)
        label = (
            self.numerator if self.denominator is None else f"{self.numerator} / {self.denominator}"
        )
        return {
            "name": self.name,
            "measured": None if value is None else round(value, 4),
            "expression": f"{label} {self.op} {self.threshold:g}",
            "pass": passed,
        }


def compare(value: float, op: str, threshold: float) -> bool:
    if op == ">=":
        return value >= threshold
    if op == "<=":
        return value <= threshold
    if op == "<":
        return value < threshold
    raise ValueError(f"unknown comparison {op!r}")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def scaling_ratios(scaling: list[dict[str, Any]] | None) -> dict[str, float | None]:
    """s/image and peak RSS of the largest size over the smallest size in a scaling run."""
    points = sorted((p for p in scaling or [] if "s_per_image" in p), key=lambda p: p["images"])
    if len(points) < 2:
        return {"scaling.s_per_image_ratio": None, "scaling.peak_rss_ratio": None}
    small, large = points[0], points[-1]
    return {
        "scaling.s_per_image_ratio": ratio(large["s_per_image"], small["s_per_image"]),
        "scaling.peak_rss_ratio": ratio(large["peak_rss_mb"], small["peak_rss_mb"]),
    }


def targets_for(default_encoding: str) -> list[Target]:
    """The acceptance targets, all ratios within the same run."""
    default = f"read.{default_encoding}"
    return [
        Target("read default encoding vs folder", default, "read.folder", ">=", 4.0),
        Target("read default encoding vs seed recipe", default, "read.seed", ">=", 10.0),
        Target("read raw vs bare records", "read.raw", "read.bytes_ceiling", ">=", 0.85),
        Target("read raw vs seed recipe", "read.raw", "read.seed", ">=", 10.0),
        Target("read jpeg vs the buffered reader", "read.jpeg", "read.jpeg_buffered", ">=", 1.0),
        Target("first batch of an epoch, share of it", "read.first_batch_share", None, "<=", 0.05),
        Target(
            "epoch order memory, 1M vs 10k records",
            "order.memory_1m_kb",
            "order.memory_10k_kb",
            "<=",
            1.2,
        ),
        Target("read from S3 vs bare object reads", "read.s3", "read.s3_bytes_ceiling", ">=", 0.8),
        Target("read jpeg vs folder", "read.jpeg", "read.folder", ">=", 1.5),
        Target("read jpeg vs in-memory ceiling", "read.jpeg", "read.ceiling", ">=", 0.85),
        Target("write 1 worker vs seed recipe", "write.workers_1", "write.seed", ">=", 5.0),
        Target("write 2 workers vs 1 worker", "write.workers_2", "write.workers_1", ">=", 1.7),
        Target("training is not input-bound", "input_bound_ratio", None, "<=", 1.05),
        Target("orchestration tax", "orchestration_tax", None, "<=", 0.15),
        Target("dvc repro no-op seconds", "dvc_noop_s", None, "<", 3.0),
        # which runs and models saw an image, at 1M images and 100 training runs
        Target("lineage of one image, seconds", "lineage.lookup_s", None, "<", 5.0),
        # what "likely label error" means on real scans (bench/label_review.py)
        Target("label review precision (good model)", "label_review.precision", None, ">=", 0.7),
        Target("label review recall (good model)", "label_review.recall", None, ">=", 0.6),
        Target(
            "label review: correct labels called errors (weak models)",
            "label_review.weak_false_share",
            None,
            "<=",
            0.02,
        ),
        Target("scaling s/image largest vs smallest", "scaling.s_per_image_ratio", None, "<=", 1.2),
        Target("scaling peak RSS largest vs smallest", "scaling.peak_rss_ratio", None, "<=", 1.3),
        Target(
            "planning peak RSS, 1M vs 10k records",
            "plan_rss.records_1m_mb",
            "plan_rss.records_10k_mb",
            "<=",
            1.2,
        ),
        # near-duplicate placement: the confirmed, class-share rule vs the hash-only one
        Target(
            "near-duplicate placement peak RSS vs hash-only, 50k",
            "near_duplicates.place_rss_ratio_50k",
            None,
            "<=",
            1.3,
        ),
        Target(
            "near-duplicate placement peak RSS vs hash-only, 1M",
            "near_duplicates.place_rss_ratio_1m",
            None,
            "<=",
            1.3,
        ),
        Target("planted copies found near", "near_duplicates.copies_confirmed", None, ">=", 0.95),
        Target(
            "distinct hash candidates found near",
            "near_duplicates.distinct_confirmed",
            None,
            "<=",
            0.05,
        ),
        Target(
            "whole shard stage peak RSS, rebuild 1M vs 10k records",
            "plan_rss.stage_rebuild_1m_mb",
            "plan_rss.stage_rebuild_10k_mb",
            "<=",
            1.3,
        ),
        Target(
            "whole shard stage peak RSS, adding 1% to 1M vs to 10k records",
            "plan_rss.stage_append_1m_mb",
            "plan_rss.stage_append_10k_mb",
            "<=",
            1.3,
        ),
        Target(
            "12 MP photos: shard, 1 worker vs seed recipe",
            "write_photos.workers_1",
            "write_photos.seed",
            ">=",
            2.0,
        ),
        Target(
            "12 MP photos: shard, all workers vs all-core ceiling",
            "write_photos.workers_all",
            "write_photos.ceiling",
            ">=",
            0.8,
        ),
        Target(  # one decode per new photo
            "12 MP photos: data side per photo (flows, 1 worker) vs one 1/8 decode",
            "write_photos.data_side_per_photo_ms",
            "write_photos.decode_floor_ms",
            "<=",
            1.25,
        ),
        Target(
            "12 MP photos: ingest check + shard decode vs one full decode",
            "ingest_photos.decode_ratio",
            None,
            "<=",
            1.3,
        ),
        # Appending 1% new images: the update costs what the update is.
        Target(
            "append: shard bytes written vs the set",
            "append.bytes_written_fraction",
            None,
            "<=",
            0.03,
        ),
        Target(
            "append: ingest+shard+validate vs full run",
            "append.data_side_fraction",
            None,
            "<=",
            0.2,
        ),
        # Old shards sent again + new shards not sent: 0 when the push is the new shards.
        Target(
            "append: dvc push shards not new (count)",
            "append.push_shard_mismatch",
            None,
            "<=",
            0.0,
        ),
    ]


def evaluate_targets(figures: dict[str, Any], default_encoding: str) -> list[dict[str, Any]]:
    merged = {**figures, **scaling_ratios(figures.get("scaling"))}
    return [target.evaluate(merged) for target in targets_for(default_encoding)]
