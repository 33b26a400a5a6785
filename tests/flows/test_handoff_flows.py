"""The decode hand-off through the stage flows, as `dvc repro` runs them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tasks.images import preprocessing_version
from tasks.runtime.layout import Layout
from tests.conftest import tiny_params, write_image_folder

pytestmark = pytest.mark.slow


def shard_bytes(shards_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(shards_dir.iterdir())
        if p.is_file()
    }


def test_the_ingest_flow_hands_decodes_to_the_shard_flow_which_leaves_none(
    prefect_harness: None, tmp_path: Path, every_decode_handed_off: None
) -> None:
    """The ingest flow keeps the shard params' pixels of its decodes under the project's
    ``.shardflow/handoff``; the shard flow, on two spawned workers, uses them up and leaves
    nothing there, and writes the shards the inline stage writes with no hand-off."""
    from flows.ingest import ingest_flow
    from flows.shard import shard_flow
    from tasks.shard.stage import shard_stage

    root = tmp_path / "project"
    source = write_image_folder(root / "images")
    params = tiny_params(source, workers=2)
    (root / "params.yaml").write_text(json.dumps(params.model_dump(mode="json")))
    layout = Layout(root)

    ingest_flow(params_path="params.yaml", root=str(root))
    kept = list((layout.handoff / preprocessing_version()).glob("*.px"))
    # of the 36 images decoded now, those the shard stage decodes at ingest's check scale
    assert 0 < len(kept) < 36
    shard_flow(params_path="params.yaml", root=str(root))
    assert not layout.handoff.exists()

    shard_stage(params.shard, layout.index, tmp_path / "inline")
    assert shard_bytes(layout.shards_dir) == shard_bytes(tmp_path / "inline")
