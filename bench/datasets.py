"""Ingest and shard the benchmark image folders the way the pipeline does.

Sharding goes through the shard flow (``flows/shard.py``) in a fresh interpreter, the path
`dvc repro` takes, never a bench-only writer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.ingest.stage import run_ingest, signatures_path
from tasks.runtime.layout import Layout
from tasks.runtime.params import ShardParams, SplitFractions, default_params

# Bench only: every image in train. params.yaml needs all three splits non-empty, so this
# one is built unchecked (model_construct) and never reaches a pipeline run.
ALL_TRAIN = SplitFractions.model_construct(train=1.0, val=0.0, test=0.0)


def ingest_folder(
    source_dir: Path,
    work_dir: Path,
    *,
    workers: int = 2,
    fresh: bool = False,
    splits: SplitFractions = ALL_TRAIN,
) -> Path:
    """Index every image of ``source_dir`` into ``splits``; cached while inputs match.

    All-train (the default) keeps every benchmark image in the split the reader times; a
    training run needs a val split too. ``fresh`` ingests from nothing (no cached index, no
    verdict or signature to reuse): a timed ingest.
    """
    changes = {"source_dir": str(source_dir), "splits": splits, "workers": workers}
    params = default_params().ingest.model_copy(update=changes)
    index_path = work_dir / "index.jsonl"
    recipe_path = work_dir / "index.recipe.json"
    marker = source_dir / ".bench-images.json"
    recipe = {
        "params": params.model_dump(mode="json"),
        "images": marker.read_text() if marker.exists() else None,
    }
    if fresh:
        for stale in (index_path, signatures_path(index_path), recipe_path):
            stale.unlink(missing_ok=True)
    if (
        index_path.exists()
        and recipe_path.exists()
        and json.loads(recipe_path.read_text()) == recipe
    ):
        return index_path
    work_dir.mkdir(parents=True, exist_ok=True)
    run_ingest(params, index_path, work_dir / "ingest_report.json")
    recipe_path.write_text(json.dumps(recipe))
    return index_path


def fresh_shards(params: ShardParams, index_path: Path, root: Path, *, workers: int) -> Path:
    """Shard from scratch through the shard flow under ``root``; returns the shard folder."""
    from bench.scaling import measure_shard_run

    measure_shard_run(params, index_path, root, workers=workers)
    return Layout(root).shards_dir
