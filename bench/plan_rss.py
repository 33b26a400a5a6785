"""Peak RSS of shard planning at 10k and 1M records: the plan must not grow with the data.

``python -m bench.plan_rss N DIR`` (a fresh interpreter, measured by :mod:`bench.measured`)
writes a synthetic ingest index of N records (fake content hashes and paths, no images)
and runs the shard stage's planning on it: the streamed index scan, the cut into shards
(raw encoding, so no image is read to estimate sizes) and the plan hash, which reads
every shard's records back once. Figures: ``plan_rss.records_10k_mb`` and
``plan_rss.records_1m_mb``; the target is their ratio.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.measured import child_rusage, run_measured
from tasks.index import write_index

SIZES = {"records_10k_mb": 10_000, "records_1m_mb": 1_000_000}
CLASSES = ("cat", "dog", "fox")


def synthetic_index(path: Path, n: int) -> Path:
    """An ingest index of ``n`` records with fake, distinct sha256 and paths; fast at 1M."""
    splits = ("train",) * 8 + ("val", "test")
    records = []
    for i in range(n):
        label = i % len(CLASSES)
        records.append(
            {
                "path": f"{CLASSES[label]}/img_{i:08d}.jpg",
                "label": CLASSES[label],
                "label_index": label,
                "sha256": hashlib.sha256(i.to_bytes(8, "big")).hexdigest(),
                "split": splits[i % len(splits)],
                "format": "JPEG",
                "width": 640,
                "height": 480,
            }
        )
    index = {"source_dir": "/nonexistent", "classes": list(CLASSES), "records": records}
    write_index(path, {**index, "verdict_key": "synthetic", "verdicts": {}})
    return path


def measure_plan_rss(
    work: Path, *, sizes: dict[str, int] = SIZES, log: Any = print
) -> dict[str, Any]:
    """Peak RSS (MB, sampled over the child's life) of planning for each size, each in a
    fresh interpreter."""
    figures: dict[str, Any] = {}
    for key, n in sizes.items():
        index_path = work / f"plan-index-{n}.jsonl"
        if not index_path.exists():  # made in a child: its memory never reaches this one
            run_measured(
                "bench.plan_rss", ["make", str(n), str(index_path)], index_path.with_suffix(".log")
            )
        result = run_measured("bench.plan_rss", [str(index_path)], work / f"plan-rss-{n}.log")
        figures[key] = result["peak_rss_mb"]
        figures[f"{key}_details"] = result
        log(f"   planning {n} records: peak RSS {result['peak_rss_mb']:.1f} MB")
    return figures


def _child(index_path: str) -> None:
    from tasks.params import default_params
    from tasks.shard import plan_hash, plan_shards

    params = default_params(shard={"encoding": "raw", "workers": 1}).shard
    start = time.perf_counter()
    plan = plan_shards(params, Path(index_path))
    digest = plan_hash(plan)
    elapsed = time.perf_counter() - start
    records = sum(slot.num_records for slot in plan.slots)
    print(
        json.dumps(
            {
                "records": records,
                "shards": len(plan),
                "plan_s": round(elapsed, 3),
                "plan_hash": digest,
                **child_rusage(),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "make":
        synthetic_index(Path(sys.argv[3]), int(sys.argv[2]))
        print(json.dumps({"records": int(sys.argv[2])}))
    else:
        _child(sys.argv[1])
