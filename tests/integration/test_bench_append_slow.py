"""The append bench measured once at a tiny size through the real stages (its pure parts:
tests/unit/bench/test_bench_append.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_measure_append_at_tiny_size(prefect_harness: None, tmp_path: Path) -> None:
    from bench.append import measure_append
    from tasks.contracts.manifest import load_manifest
    from tasks.runtime.params import default_params

    params = default_params(
        ingest={"workers": 1},
        shard={"image_size": [16, 16], "target_shard_mb": 0.005, "workers": 1},
    )
    # ten images a class: the fewest from which class shares give val and test one each
    result = measure_append(
        params, tmp_path, images=50, fraction=0.1, min_size=16, max_size=32, workers=1, log=print
    )
    figures, details = result["figures"], result["details"]
    # Incremental ingest decoded only the 5 new images.
    assert (details["update"]["ingest_reused"], details["update"]["ingest_decoded"]) == (50, 5)
    assert details["full"]["ingest_decoded"] == 55
    # The append wrote the new generation and the small files, never the base's shards.
    grown = load_manifest(tmp_path / "append" / "grow" / "data" / "shards")
    new_shards = grown.generations[-1].shards
    new_bytes = sum(
        s.bytes for i in grown.splits.values() for s in i.shards if s.file in new_shards
    )
    assert new_bytes < figures["append.bytes_written"] < figures["append.rebuild_bytes_written"]
    # dvc push carried exactly the new shard files, plus small files and the folder listing.
    assert figures["append.push_new_shards"] == len(new_shards) == len(details["new_shards"])
    assert figures["append.push_old_shards"] == 0
    assert figures["append.push_only_new_shards"] is True
    assert "manifest.json" in details["push"]["other_files"]
    assert details["push"]["dvc_printed"] == figures["append.push_files"]
