"""Reverse lineage: from an image to its shard sets, runs and versions, and the champion."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient
from PIL import Image

from flows.cli.lineage import describe
from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import Erasure, ForgottenRecord, save_forgotten
from tasks.contracts.membership import archive_membership
from tasks.erasure.lineage import IndexView, TrackedRuns, UnknownImage, image_lineage, resolve
from tasks.erasure.retraction import runs_that_held
from tasks.evaluate.tracking import EVALUATES_TAG
from tasks.runtime.layout import Layout
from tasks.runtime.refusals import Refused
from tests.conftest import copy_blank_store
from tests.unit.shard.test_append import Project, add_images

DISTANCE = 10  # params.yaml's ingest.near_duplicate_distance


def layout_project(root: Path) -> tuple[Project, Layout]:
    """A test project whose index and shards lie where the layout of ``root`` has them."""
    project, layout = Project(root), Layout(root)
    project.index, project.shards = layout.index, layout.shards_dir
    return project, layout


def shard_set(project: Project, layout: Layout) -> str:
    manifest = project.update("rebuild")
    archive_membership(layout.shards_dir, layout.membership_archive, manifest.fingerprint)
    return str(manifest.fingerprint)


def train_run(client: MlflowClient, fingerprint: str, name: str) -> str:
    run = client.create_run("0", run_name=name, tags={"data.fingerprint": fingerprint})
    return str(run.info.run_id)


Sets = tuple[Layout, dict[str, str], dict[str, str]]


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory: pytest.TempPathFactory, blank_mlflow_store: Path) -> Sets:
    """Two shard sets (the second adds one image and a resized copy of another), a training
    run on each, an evaluation of the second, versions 1 and 2 (the champion); the store's
    URI is ``hashes["uri"]``. Tests that change it put it back."""
    tmp_path = tmp_path_factory.mktemp("lineage")
    mlflow_uri = copy_blank_store(blank_mlflow_store, tmp_path / "mlflow.db")
    project, layout = layout_project(tmp_path)
    first = shard_set(project, layout)
    (new,) = add_images(project.source, "red", 1, seed=11)
    original = project.source / "red" / "001.png"
    with Image.open(original) as image:
        image.resize((image.width * 2, image.height * 2), Image.Resampling.NEAREST).save(
            project.source / "red" / "001-large.png"
        )
    second = shard_set(project, layout)
    client = MlflowClient(mlflow_uri, mlflow_uri)
    runs = {"first": train_run(client, first, "first"), "second": train_run(client, second, "s")}
    runs["eval"] = str(
        client.create_run("0", run_name="eval-s", tags={EVALUATES_TAG: runs["second"]}).info.run_id
    )
    client.create_registered_model("m")
    for run_id in (runs["first"], runs["second"]):
        client.create_model_version("m", f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias("m", "champion", "2")
    hashes = {
        "new": file_sha256(project.source / new),
        "original": file_sha256(original),
        "large": file_sha256(project.source / "red" / "001-large.png"),
        "first": first,
        "second": second,
        "uri": mlflow_uri,
    }
    return layout, runs, hashes


def test_lineage_walks_from_an_image_to_its_sets_runs_versions_and_the_champion(
    two_sets: Sets,
) -> None:
    layout, runs, hashes = two_sets
    mlflow_uri = hashes["uri"]
    index = IndexView(layout.index)
    tracked = TrackedRuns.read(MlflowClient(mlflow_uri, mlflow_uri), "m")
    source = layout.root / "images"
    assert resolve("red/001.png", layout, source, index) == hashes["original"]
    assert resolve(hashes["new"].upper(), layout, source, index) == hashes["new"]

    old = image_lineage(hashes["original"], layout, index, tracked, distance=DISTANCE)
    assert old.shard_sets == sorted([hashes["first"], hashes["second"]])
    assert hashes["large"] in old.near_duplicates  # its resized copy, placed with it
    assert old.near_duplicate_paths[hashes["large"]] == "red/001-large.png"
    assert f"red/001-large.png ({hashes['large']})" in "\n".join(describe(old))
    (member,) = old.members  # where it is in the current set
    assert member.split == old.split
    expected = {"train": {"first", "second"}, "val": {"first", "second"}, "test": {"eval"}}
    assert {use.run_id for use in old.runs} == {runs[name] for name in expected[old.split]}

    new = image_lineage(hashes["new"], layout, index, tracked, distance=DISTANCE)
    assert new.shard_sets == [hashes["second"]]  # the first set never held it
    assert all(use.fingerprint == hashes["second"] for use in new.runs)
    assert {v for use in new.runs for v in use.versions} == {"2"}
    assert new.champion_saw_it and new.champion == "2"


def test_a_set_no_run_trained_on_means_the_champion_never_saw_the_image(
    two_sets: Sets,
) -> None:
    layout, _, hashes = two_sets
    mlflow_uri = hashes["uri"]
    client = MlflowClient(mlflow_uri, mlflow_uri)
    client.set_registered_model_alias("m", "champion", "1")  # trained on the first set
    try:
        tracked = TrackedRuns.read(client, "m")
    finally:
        client.set_registered_model_alias("m", "champion", "2")
    index = IndexView(layout.index)
    new = image_lineage(hashes["new"], layout, index, tracked, distance=DISTANCE)
    assert new.runs and not new.champion_saw_it and new.champion is None


def test_a_soft_deleted_run_is_counted_and_named_deleted(two_sets: Sets) -> None:
    """MLflow's deleted lifecycle hides a run from a plain search; the champion registered
    from it still serves, so lineage (and forget, which reads the same runs) counts it."""
    layout, runs, hashes = two_sets
    mlflow_uri = hashes["uri"]
    client = MlflowClient(mlflow_uri, mlflow_uri)
    for name in ("second", "eval"):  # the champion's training run and its evaluation
        client.delete_run(runs[name])
    try:
        tracked = TrackedRuns.read(client, "m")
    finally:
        for name in ("second", "eval"):
            client.restore_run(runs[name])
    index = IndexView(layout.index)
    new = image_lineage(hashes["new"], layout, index, tracked, distance=DISTANCE)
    assert new.champion_saw_it and new.champion == "2"
    assert new.runs and all(use.deleted and "2" in use.versions for use in new.runs)
    assert "deleted lifecycle" in "\n".join(describe(new))
    held, versions = runs_that_held(tracked, [hashes["second"]])
    assert runs["second"] in held and "2" in versions


def test_a_forgotten_image_shows_only_that_and_when(
    two_sets: Sets,
) -> None:
    layout, _, hashes = two_sets
    mlflow_uri = hashes["uri"]
    erasure = Erasure(
        sha256=[hashes["new"]],
        asked=[hashes["new"]],
        by="ana",
        at="2026-01-02T03:04:05Z",
        reason="erasure request",
        models="keep",
    )
    save_forgotten(layout.forgotten, ForgottenRecord(erasures=[erasure]))
    index = IndexView(layout.index)
    tracked = TrackedRuns.read(MlflowClient(mlflow_uri, mlflow_uri), "m")
    try:
        lineage = image_lineage(hashes["new"], layout, index, tracked, distance=DISTANCE)
    finally:
        layout.forgotten.unlink()
    assert lineage.to_json() == {"sha256": hashes["new"], "forgotten_at": "2026-01-02T03:04:05Z"}


def test_an_unknown_image_is_refused_naming_it(tmp_path: Path) -> None:
    project, layout = layout_project(tmp_path)
    project.ingest()
    index = IndexView(layout.index)
    with pytest.raises(UnknownImage, match=r"red/nope\.png") as refused:
        resolve("red/nope.png", layout, project.source, index)
    assert isinstance(refused.value, Refused) and refused.value.fix


def test_the_index_scan_finds_every_record_and_its_perceptual_hash(two_sets: Sets) -> None:
    """The scan reads the index's bytes, not its JSON: it must agree with the parse."""
    from tasks.contracts.index import iter_records

    layout, _, _ = two_sets
    records = [record for _, record in iter_records(layout.index)]
    with IndexView(layout.index) as index:
        assert len(index.phashes) == len(records) > 20
        for row, record in enumerate(records):
            assert index.sha256_at(row) == record["sha256"]
            assert int(index.phashes[row]) == int(record["phash"], 16)
            assert index.position(record["sha256"]) == row
            assert index.record("path", record["path"]) == record


def test_a_group_holds_the_copies_and_not_a_look_alike_whose_hash_is_as_near(
    tmp_path: Path,
) -> None:
    """Forget's and lineage's group is ingest's relation: a flag of another colour with the
    same layout (its hash as near as the copy's) is not taken with the flag."""
    from tasks.contracts.index import write_index

    def record(name: str, phash: int, shade: int) -> dict[str, object]:
        return {
            "path": f"flags/{name}.png",
            "label": "flags",
            "label_index": 0,
            "sha256": name[0] * 64,
            "split": "train",
            "format": "PNG",
            "width": 64,
            "height": 64,
            "phash": f"{phash:016x}",
            "thumb": bytes([shade] * 256).hex(),
        }

    layout = 0x0F0F_0F0F_0F0F_0F0F
    records = [
        record("a_flag", layout, 40),
        record("b_copy", layout ^ 0b111, 44),  # re-encoded: 3 bits and 4 grey levels off
        record("c_other_colours", layout ^ 0b1, 200),  # as near by hash, another picture
        record("d_copy_of_copy", layout ^ 0b111 ^ (0b11 << 20), 46),
    ]
    index_path = tmp_path / "index.json"
    write_index(index_path, {"source_dir": "src", "classes": ["flags"], "records": records})

    with IndexView(index_path) as index:
        assert index.group("a" * 64, DISTANCE) == ["b" * 64, "d" * 64]
        assert index.group("c" * 64, DISTANCE) == []
