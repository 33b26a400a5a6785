"""`dvc repro` from a fresh repo runs every stage, reruns exactly what changed, and pushes."""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.conftest import Project

pytestmark = pytest.mark.slow


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w-]+)'", output))


def test_dvc_repro_end_to_end(project: Project) -> None:
    first = project.dvc("repro")
    assert ran_stages(first.stdout) == {"ingest", "shard", "validate", "train", "evaluate"}

    ingest = json.loads((project.root / "reports/ingest.json").read_text())
    assert (
        ingest["accepted"] + ingest["quarantined_count"] + ingest["duplicate_count"]
        == (ingest["files_found"])
    )
    reasons = " ".join(q["reason"] for q in ingest["quarantined"])
    for reason in ("empty file", "not an image", "truncated", "absurd dimensions", "conflicting"):
        assert reason in reasons
    validation = json.loads((project.root / "reports/validation.json").read_text())
    manifest = json.loads((project.root / "data/shards/manifest.json").read_text())
    assert validation["passed"] and validation["fingerprint"] == manifest["fingerprint"]
    evaluation = json.loads((project.root / "metrics/eval.json").read_text())
    assert 0.0 <= evaluation["accuracy"] <= 1.0
    assert (project.root / "models/model.keras").stat().st_size > 0

    # Nothing changed: no stage runs and DVC reports the pipeline up to date.
    second = project.dvc("repro")
    assert ran_stages(second.stdout) == set()
    assert "up to date" in project.dvc("status").stdout

    # A training param reruns train and evaluate only: the shards are not rebuilt.
    project.set_params(train={"learning_rate": 0.005})
    third = project.dvc("repro")
    assert ran_stages(third.stdout) == {"train", "evaluate"}

    # A shard param reshards, revalidates and retrains, but does not re-ingest.
    project.set_params(shard={"encoding": "png"})
    fourth = project.dvc("repro")
    assert ran_stages(fourth.stdout) == {"shard", "validate", "train", "evaluate"}

    # Shards travel through the local DVC remote.
    project.dvc("push")
    shards = project.root / "data/shards"
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    project.run("rm", "-rf", str(shards), str(project.root / ".dvc/cache"))
    project.dvc("pull")
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before
