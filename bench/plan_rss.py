"""Peak RSS of shard planning at 10k and 1M records: the plan must not grow with the data.

``python -m bench.plan_rss N DIR`` (a fresh interpreter, measured by :mod:`bench.measured`)
writes a synthetic ingest index of N records (fake content hashes and paths, no images)
and runs the shard stage's planning on it: the streamed index scan, the cut into shards
(raw encoding, so no image is read to estimate sizes) and the plan hash, which reads
every shard's records back once. Figures: ``plan_rss.records_10k_mb`` and
``plan_rss.records_1m_mb``; the target is their ratio.

``python -m bench.plan_rss stage INDEX DIR [MODE]`` runs the whole shard stage
(:func:`tasks.shard.stage.shard_stage`) on the same index; :func:`measure_plan_rss` runs it three
times: a first build into an empty folder, a rebuild over it (whose data diff compares
against every record of the first), then an append of 1% more records (an index of
``N + N // 100`` records, the first ``N`` the same) as a new generation. Only the pixels
are left out: each record is one placeholder byte in real TFRecord framing, so
the manifest, the record lists, the offsets index and the data diff run as in production.
Figures ``plan_rss.stage_rebuild_{10k,1m}_mb`` (the larger of the two rebuilds),
``plan_rss.stage_append_{10k,1m}_mb`` (the append) and ``plan_rss.stage_{10k,1m}_mb`` (the
largest of the three runs); the targets are the 1M / 10k ratios (the stage spills its data
diff's tables to disk, so none grows with the data).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.measured import child_rusage, run_measured
from tasks.contracts.index import write_index

if TYPE_CHECKING:
    from tasks.contracts.manifest import ShardFile

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
    work: Path, *, sizes: dict[str, int] = SIZES, stage_up_to: int = 10**6, log: Any = print
) -> dict[str, Any]:
    """Peak RSS (MB, sampled over the child's life) of planning for each size, then of the
    whole stage for sizes up to ``stage_up_to`` (1M: about 2 minutes), each in a fresh
    interpreter."""
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
        if n > stage_up_to:
            continue
        stage_key = key.replace("records_", "stage_")
        stage_dir = work / f"stage-{n}"
        shutil.rmtree(stage_dir, ignore_errors=True)
        grown = work / f"plan-index-{n}-plus-{n // 100}.jsonl"
        if not grown.exists():
            run_measured(
                "bench.plan_rss", ["make", str(n + n // 100), str(grown)], grown.with_suffix(".log")
            )
        runs = [
            run_measured(
                "bench.plan_rss",
                ["stage", str(index), str(stage_dir), mode],
                work / f"stage-rss-{n}-{name}.log",
            )
            for name, index, mode in (
                ("first", index_path, "rebuild"),
                ("over", index_path, "rebuild"),
                ("append", grown, "append"),
            )
        ]
        shutil.rmtree(stage_dir, ignore_errors=True)
        figures[stage_key] = max(r["peak_rss_mb"] for r in runs)
        figures[stage_key.replace("stage_", "stage_rebuild_")] = max(
            r["peak_rss_mb"] for r in runs[:2]
        )
        figures[stage_key.replace("stage_", "stage_append_")] = runs[2]["peak_rss_mb"]
        figures[f"{stage_key}_details"] = runs
        log(
            f"   the whole shard stage on {n} records: peak RSS "
            f"{runs[0]['peak_rss_mb']:.1f} MB (first build), "
            f"{runs[1]['peak_rss_mb']:.1f} MB (rebuild over it), "
            f"{runs[2]['peak_rss_mb']:.1f} MB (appending {n // 100})"
        )
    return figures


def _child(index_path: str) -> None:
    from tasks.runtime.params import default_params
    from tasks.shard.planning import plan_hash, plan_shards

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


def _stage_child(index_path: str, root: str, mode: str = "rebuild") -> None:
    from tasks.runtime.layout import Layout
    from tasks.runtime.params import default_params
    from tasks.shard.spec import ShardSpec
    from tasks.shard.stage import shard_stage
    from tasks.shard.writing import describe_shard
    from tasks.tfrecord import TFRecordWriter

    def placeholders(specs: Iterable[ShardSpec], shards_dir: Path) -> Iterator[ShardFile]:
        """Each shard as real TFRecord framing around one-byte records: no pixels."""
        for spec in specs:
            path = Path(shards_dir) / spec.file
            path.parent.mkdir(parents=True, exist_ok=True)
            with TFRecordWriter(path) as writer:
                for _ in spec.records:
                    writer.write(b"x")
            yield describe_shard(spec.file, len(spec.records), Path(shards_dir))

    params = default_params(shard={"encoding": "raw", "workers": 1, "mode": mode}).shard
    layout = Layout(root)
    start = time.perf_counter()
    run = shard_stage(
        params,
        Path(index_path),
        layout.shards_dir,
        write_many=placeholders,
        diff_path=layout.shard_changes,
    )
    assert run.diff is not None
    print(
        json.dumps(
            {
                "records": run.manifest.total_records,
                "previous_records": run.diff["records"]["before"],
                "added": run.diff["added_total"],
                "written": run.written,
                "stage_s": round(time.perf_counter() - start, 3),
                **child_rusage(),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "stage":
        _stage_child(sys.argv[2], sys.argv[3], *sys.argv[4:5])
    elif sys.argv[1] == "make":
        synthetic_index(Path(sys.argv[3]), int(sys.argv[2]))
        print(json.dumps({"records": int(sys.argv[2])}))
    else:
        _child(sys.argv[1])
