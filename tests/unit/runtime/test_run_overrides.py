"""A run's overrides change the values they name in params.yaml, and nothing of its form."""

from __future__ import annotations

import difflib
from pathlib import Path

from tasks.runtime.params import shipped_params_text
from tasks.runtime.run_overrides import apply_overrides


def test_an_override_changes_only_the_lines_of_the_values_it_sets(tmp_path: Path) -> None:
    """`null` stays `null`, and a replaced list keeps its flow style and its comment."""
    path = tmp_path / "params.yaml"
    before = shipped_params_text()
    path.write_text(before)
    apply_overrides(path, {"shard": {"image_size": [48, 40]}, "train": {"epochs": 7}})
    changed = [
        line
        for line in difflib.unified_diff(before.splitlines(), path.read_text().splitlines(), n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    old_epochs = next(line for line in before.splitlines() if line.startswith("  epochs:"))
    assert changed == [
        "-  image_size: [64, 64]         # [height, width]",
        "+  image_size: [48, 40]         # [height, width]",
        f"-{old_epochs}",
        f"+{old_epochs.replace(old_epochs.split(':')[1].split('#')[0].strip(), '7', 1)}",
    ]
