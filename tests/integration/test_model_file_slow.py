"""The trained model's file saved by two processes: the same weights, the same bytes (the
fast tests: tests/unit/train/test_model_file.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import pytest

from tasks.train.model_file import METADATA_ENTRY
from tests.unit.train.test_model_file import SAVE_IN_A_PROCESS

pytestmark = pytest.mark.slow


def test_the_same_weights_save_to_the_same_bytes(tmp_path: Path) -> None:
    """Two processes save equal weights, as two deterministic trainings do: Keras's own files
    differ (the clock, memory addresses, entry times); ours do not."""
    repo = Path(__file__).resolve().parents[2]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        subprocess.run(
            [sys.executable, "-c", SAVE_IN_A_PROCESS, str(tmp_path / name)],
            cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo)},
            check=True,
            timeout=300,
        )
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "plain.keras").read_bytes() != (b / "plain.keras").read_bytes()
    assert (a / "model.keras").read_bytes() == (b / "model.keras").read_bytes()
    assert sorted(p.name for p in a.iterdir()) == ["model.keras", "plain.keras"]  # no temp left
    with zipfile.ZipFile(a / "model.keras") as archive:
        metadata = json.loads(archive.read(METADATA_ENTRY))
        assert metadata == {"keras_version": keras.__version__}
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
