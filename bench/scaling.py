"""Shard-stage scaling: seconds per image and peak RSS at growing dataset sizes.

Each size is sharded in a fresh subprocess (``python -m bench.scaling``) while the parent
samples the RSS of that process and all its children (the spawned shard workers) with psutil.
The sizes are nested subsets of one generated set, so 1k images are the first 1k of 50k.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.measured import child_rusage, run_measured
from tasks.params import ShardParams

_INDEX_RE = re.compile(r"_(\d+)\.jpg$")


def subset_index(index_path: Path, n: int, out_path: Path) -> int:
    """Write an index holding only images 0..n-1 of a bench image set; returns its size."""
    index = json.loads(index_path.read_text())
    records = [r for r in index["records"] if int(_INDEX_RE.search(r["path"]).group(1)) < n]  # type: ignore[union-attr]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({**index, "records": records}))
    return len(records)


def measure_shard_run(
    params: ShardParams, index_path: Path, shards_dir: Path, *, workers: int
) -> dict[str, Any]:
    """One shard stage in a fresh subprocess: ``shard_s`` (in-process timer), wall, peak RSS."""
    args = [str(index_path), str(shards_dir), params.model_dump_json(), str(workers)]
    return run_measured("bench.scaling", args, shards_dir.with_name(shards_dir.name + ".log"))


def scaling_run(
    params: ShardParams,
    full_index: Path,
    work_dir: Path,
    sizes: list[int],
    *,
    workers: int,
    log: Any = print,
) -> list[dict[str, Any]]:
    """s/image and peak RSS of the shard stage at each size in ``sizes``."""
    points = []
    for n in sizes:
        index_path = work_dir / f"index-{n}.json"
        count = subset_index(full_index, n, index_path)
        result = measure_shard_run(params, index_path, work_dir / f"shards-{n}", workers=workers)
        point = {"images": count, "s_per_image": result["shard_s"] / count, **result}
        log(
            f"  {count} images: {point['s_per_image'] * 1000:.3f} ms/image, "
            f"peak RSS {point['peak_rss_mb']:.0f} MB"
        )
        points.append(point)
    return points


def _child(index_path: str, shards_dir: str, params_json: str, workers: str) -> None:
    import shutil

    from tasks.shard import run_shard

    params = ShardParams.model_validate_json(params_json)
    shutil.rmtree(shards_dir, ignore_errors=True)
    start = time.perf_counter()
    run_shard(params, Path(index_path), Path(shards_dir), workers=int(workers))
    elapsed = time.perf_counter() - start
    print(json.dumps({"shard_s": elapsed, **child_rusage()}))


if __name__ == "__main__":
    _child(*sys.argv[1:5])
