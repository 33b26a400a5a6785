"""`shardflow forget --models keep|delete` retrains nothing: it reruns what the removal made
stale short of training and names the stages left stale (and the command that reruns them);
`--models retrain` leaves none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from flows.forget.orchestration import rerun_stale
from tasks.runtime.layout import Layout


def copy_stage(src: str, dst: str) -> dict[str, object]:
    code = f"import shutil; shutil.copy('{src}', '{dst}')"
    return {"cmd": f'"{sys.executable}" -c "{code}"', "deps": [src], "outs": [dst]}


def test_keep_reruns_validation_only_and_names_the_stages_left_stale(tmp_path: Path) -> None:
    """A removal changes the data: validate reruns, train (its model) does not, and is named
    stale; a retrain reruns it."""
    stages = {"validate": copy_stage("data.txt", "report.txt")}
    stages["train"] = copy_stage("report.txt", "model.txt")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    (tmp_path / "data.txt").write_text("with the image")
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run([*dvc, "init", "-q", "--no-scm"], cwd=tmp_path, check=True)
    subprocess.run([*dvc, "repro", "-q"], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "data.txt").write_text("without it")

    assert rerun_stale(Layout(tmp_path), retrain=False) == ["train"]
    assert (tmp_path / "report.txt").read_text() == "without it"
    assert (tmp_path / "model.txt").read_text() == "with the image"  # not retrained
    assert rerun_stale(Layout(tmp_path), retrain=True) == []
    assert (tmp_path / "model.txt").read_text() == "without it"  # retrained
