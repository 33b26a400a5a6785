"""Labels are data: editing one row of ``ingest.labels_csv`` reruns ingest and what follows."""

from __future__ import annotations

import json

import pytest

from tasks.contracts.index import load_index
from tests.e2e.conftest import Project

pytestmark = pytest.mark.slow


def test_editing_a_label_makes_ingest_and_later_stages_stale(project: Project) -> None:
    source = project.root / "data" / "demo"
    rows = ["path,label"] + [
        f"{path.relative_to(source).as_posix()},{path.parent.name}"
        for path in sorted(source.glob("*/*"))
    ]
    csv_path = source / "labels.csv"
    csv_path.write_text("\n".join(rows) + "\n")
    project.set_params(ingest={"labels_csv": "data/demo/labels.csv"})
    project.dvc("repro", "ingest")
    assert json.loads(project.dvc("status", "--json", "ingest").stdout or "{}") == {}

    index_path = project.root / "data" / "ingest" / "index.json"
    report = json.loads((project.root / "reports" / "ingest.json").read_text())
    copied = {d["duplicate_of"] for d in report["duplicates"]}  # relabelling would conflict
    first_image, old_label = next(
        (r["path"], r["label"])
        for r in load_index(index_path)["records"]
        if r["path"] not in copied
    )
    new_label = "circle" if old_label != "circle" else "square"
    position = rows.index(f"{first_image},{old_label}")
    rows[position] = f"{first_image},{new_label}"
    csv_path.write_text("\n".join(rows) + "\n")
    # The source stage lists the folder the CSV lies in: the new listing makes ingest stale.
    project.dvc("repro", "--single-item", "source")
    stale = json.loads(project.dvc("status", "--json", "ingest").stdout)
    changed = [entry for entry in stale["ingest"] if "changed deps" in entry]
    assert changed and "data/ingest/source_listing.json" in changed[0]["changed deps"]
    project.dvc("repro", "ingest")
    labels = {record["path"]: record["label"] for record in load_index(index_path)["records"]}
    assert labels[first_image] == new_label
