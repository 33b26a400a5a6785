"""The data gate's comparison is a typed record that writes the same JSON (and summary) bytes
as the dict it replaced: goldens written by the dict-built diff, and a round trip of the
committed ``reports/data_diff.json``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.validate import data_gate

HERE = Path(__file__).parent
ROOT = HERE.parents[2]

ACCEPTANCE = data_gate.Acceptance(
    how="accepted",
    by="ana",
    at="2026-01-02T03:04:05+00:00",
    reason="more cats",
    previous_fingerprint=None,
)
ACCEPTED = data_gate.AcceptedVersion(
    fingerprint="ab" * 32,
    class_counts={"train": {"cat": 8, "dog": 6, "owl": 2}, "val": {"cat": 1, "dog": 1}},
    acceptance=ACCEPTANCE,
)
CURRENT = data_gate.DataVersion(
    fingerprint="cd" * 32,
    class_counts={"train": {"cat": 9, "dog": 5, "yak": 3}, "test": {"cat": 1}},
)


@pytest.mark.parametrize(
    ("name", "accepted", "current"),
    [("changed", ACCEPTED, CURRENT), ("first", None, CURRENT), ("same", ACCEPTED, ACCEPTED)],
)
def test_the_typed_data_diff_writes_the_bytes_the_dict_diff_wrote(
    tmp_path: Path,
    name: str,
    accepted: data_gate.AcceptedVersion | None,
    current: data_gate.DataVersion,
) -> None:
    diff = data_gate.compare(accepted, current, "photos")
    data_gate.write(diff, tmp_path / "data_diff.json")
    for suffix in (".json", ".md"):
        golden = HERE / f"golden_data_diff_{name}{suffix}"
        written = (tmp_path / "data_diff").with_suffix(suffix).read_text()
        assert written == golden.read_text()
