"""A swap cut between its renames, finished by the validation stage's process (the fast
tests: tests/unit/contracts/test_shard_swap.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.contracts.manifest import load_manifest
from tasks.contracts.shard_swap import rebuild_folder, trash_folder
from tasks.shard import stage as stage_module
from tasks.shard.stage import shard_stage
from tests.shard_helpers import params
from tests.unit.contracts.test_shard_swap import Killed, killed_between_renames

pytestmark = pytest.mark.slow


@pytest.mark.usefixtures("tf_cross_check_in_process")  # its report, not the check's child
@pytest.mark.parametrize("new_set_complete", [True, False])
def test_validation_finishes_a_swap_cut_between_the_renames(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_set_complete: bool
) -> None:
    """Validation run on its own after the kill (`python -m flows.validate`) found no shard
    folder and only named the missing manifest: it now finishes the swap as the shard stage
    would (the new set when it is complete, else the old one back) and validates that."""
    from tasks.validate.stage import run_validate

    shards = tmp_path / "shards"
    old = shard_stage(params(), tiny_index, shards).manifest
    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "swap_in", killed_between_renames)
        with pytest.raises(Killed):
            shard_stage(params(target_shard_mb=16.0), tiny_index, shards)
    if new_set_complete:
        expected = load_manifest(rebuild_folder(shards)).fingerprint
        assert expected != old.fingerprint
    else:
        (rebuild_folder(shards) / "manifest.json").unlink()  # killed before its manifest
        expected = old.fingerprint
    assert not shards.exists()

    report = run_validate(shards, tmp_path / "validation.json", tmp_path / "validation.md")
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert report["fingerprint"] == expected == load_manifest(shards).fingerprint
    assert not trash_folder(shards).exists()
