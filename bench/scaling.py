"""Shard-stage scaling: seconds per image and peak RSS at growing dataset sizes.

Each size is sharded in a fresh subprocess (``python -m bench.scaling``) while the parent
samples the RSS of that process and all its children (the shard workers) with psutil. The
stage runs as production runs it: the Prefect flow of ``flows/shard.py`` through its task
runner (:func:`flow_shard`, also what the write and photos benches time). The sizes are
nested subsets of one generated set, so 1k images are the first 1k of 50k.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.measured import child_rusage, run_measured
from tasks.contracts.index import load_index, write_index
from tasks.runtime.layout import Layout
from tasks.runtime.params import ShardParams

_INDEX_RE = re.compile(r"_(\d+)\.jpg$")


def subset_index(index_path: Path, n: int, out_path: Path) -> int:
    """Write an index holding only images 0..n-1 of a bench image set; returns its size."""
    index = load_index(index_path)
    records = [r for r in index["records"] if int(_INDEX_RE.search(r["path"]).group(1)) < n]  # type: ignore[union-attr]
    write_index(out_path, {**index, "records": records})
    return len(records)


def flow_shard(params: ShardParams, index_path: Path, root: Path) -> dict[str, Any]:
    """The shard stage as `dvc repro` runs it (``flows.shard.run``), from scratch, in ``root``:
    a rebuild's workers start first, then the imports, then the run, as in the stage process.

    Copies the index into ``Layout(root)`` and removes old shards first (the stage resumes
    a finished plan, so a timed run must start empty); returns the flow's result plus
    ``shard_s``, the time of the run alone.
    """
    import shutil

    from tasks.shard.workers import prestart_workers

    prestart_workers(params)  # before the Prefect import, as `python -m flows.shard` does
    from flows.shard import run
    from flows.support.environment import configure_environment
    from flows.support.run_story import stage_settings

    configure_environment()
    layout = Layout(root)
    shutil.rmtree(layout.shards_dir, ignore_errors=True)
    layout.index.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(index_path, layout.index)
    start = time.perf_counter()
    with stage_settings():  # as a stage process runs its flows
        result = run(params, layout)
    return {**result, "shard_s": time.perf_counter() - start}


def measure_shard_run(
    params: ShardParams, index_path: Path, root: Path, *, workers: int
) -> dict[str, Any]:
    """One shard stage (:func:`flow_shard`) in a fresh subprocess: ``shard_s``, wall, peak RSS.

    The shards land in ``Layout(root).shards_dir``.
    """
    args = [str(index_path), str(root), params.model_dump_json(), str(workers)]
    return run_measured("bench.scaling", args, root.with_name(root.name + ".log"))


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
        index_path = work_dir / f"index-{n}.jsonl"
        count = subset_index(full_index, n, index_path)
        result = measure_shard_run(params, index_path, work_dir / f"shards-{n}", workers=workers)
        point = {"images": count, "s_per_image": result["shard_s"] / count, **result}
        log(
            f"  {count} images: {point['s_per_image'] * 1000:.3f} ms/image, "
            f"peak RSS {point['peak_rss_mb']:.0f} MB"
        )
        points.append(point)
    return points


def _child(index_path: str, root: str, params_json: str, workers: str) -> None:
    params = ShardParams.model_validate_json(params_json).model_copy(
        update={"workers": int(workers)}
    )
    result = flow_shard(params, Path(index_path), Path(root))
    print(json.dumps({"shard_s": result["shard_s"], "shards": result["shards"], **child_rusage()}))


if __name__ == "__main__":
    _child(*sys.argv[1:5])
