"""The committed data diff read back through its type in a process of its own (the fast
tests: tests/unit/validate/test_data_diff_bytes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.runtime.atomic import write_json
from tasks.validate import data_gate
from tests.unit.validate.test_data_diff_bytes import ROOT

pytestmark = pytest.mark.slow


def test_the_committed_data_diff_round_trips_through_the_type(tmp_path: Path) -> None:
    committed = ROOT / "reports" / "data_diff.json"
    diff = data_gate.DataDiff.model_validate_json(committed.read_text())
    write_json(tmp_path / "data_diff.json", diff.as_json())
    assert (tmp_path / "data_diff.json").read_bytes() == committed.read_bytes()
