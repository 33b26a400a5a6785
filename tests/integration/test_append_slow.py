"""Appended shard sets read, validated and trained on: the reader and validation's worker
processes, a training run (the fast tests: tests/unit/shard/test_append.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tasks.contracts.index import load_index
from tasks.contracts.manifest import load_manifest
from tasks.contracts.tf_reader import read_split
from tasks.runtime.params import default_params
from tasks.schema import HASH_KEY
from tasks.shard.append import RebuildNeeded
from tasks.validate.stage import run_validate
from tests.unit.shard.test_append import (
    Project,
    add_images,
    digests,
    grow,
    records_by_file,
    tmp_report,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def grown(tmp_path: Path) -> tuple[Project, dict[str, str], list[str]]:
    """A rebuilt base, then 5 new red images appended (tests/unit/shard/test_append.py)."""
    return grow(tmp_path)


def test_read_split_and_validation_cover_every_generation(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    project, _, _ = grown
    manifest = load_manifest(project.shards)
    index = load_index(project.index)
    for split in ("train", "val", "test"):
        expected = sorted(r["sha256"] for r in index["records"] if r["split"] == split)
        ds = read_split(project.shards, split, batch_size=4, training=False, with_metadata=True)
        assert int(ds.cardinality()) == -(-manifest.split(split).num_records // 4)
        seen = sorted(h.decode() for batch in ds for h in batch[HASH_KEY].numpy())
        assert seen == expected
    reports = project.root / "reports"
    report = run_validate(
        project.shards,
        reports / "v.json",
        reports / "v.md",
        index_path=project.index,
    )
    checks = {c["name"]: c for c in report["checks"]}
    assert report["passed"], [c["message"] for c in checks.values() if not c["passed"]]
    assert checks["generations"]["details"]["old_shards"] > 0
    assert checks["generations"]["details"]["new_shards"] == len(manifest.generations[1].shards)
    # TensorFlow's parser read the new generation's shards (gen-00001/...) and agreed on the
    # first records of each: the append's bytes are what training will read.
    from tasks.validate.stage import CROSS_CHECK_PER_SHARD

    sizes = {s.file: s.num_records for info in manifest.splits.values() for s in info.shards}
    sampled = sum(min(CROSS_CHECK_PER_SHARD, sizes[f]) for f in manifest.generations[1].shards)
    assert checks["tensorflow_parser"]["details"]["records"] == sampled > 0


def test_validation_reads_new_shards_and_trusts_old_ones_by_hash(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    project, _, _ = grown
    manifest = load_manifest(project.shards)
    old = manifest.generations[0].shards[0]
    data = bytearray((project.shards / old).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in an old shard: caught by its sha256
    (project.shards / old).write_bytes(bytes(data))
    reports = project.root / "reports"
    report = run_validate(project.shards, reports / "v.json", reports / "v.md")
    failed = {c["name"]: c for c in report["checks"] if not c["passed"]}
    assert "files" in failed and old in failed["files"]["message"]


def test_a_damaged_new_shard_is_named_with_its_generation(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    """A bad record in an appended shard names ``gen-00001/<file>``: generation 0 may hold a
    file of the same bare name."""
    project, _, _ = grown
    manifest = load_manifest(project.shards)
    new = manifest.generations[1].shards[0]
    data = bytearray((project.shards / new).read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a record: its CRC no longer matches
    (project.shards / new).write_bytes(bytes(data))
    reports = project.root / "reports"
    report = run_validate(project.shards, reports / "v.json", reports / "v.md")
    failed = {c["name"]: c for c in report["checks"] if not c["passed"]}
    example = failed["records"]["details"]["examples"][0]
    assert new.startswith("gen-00001/") and example["file"] == new
    assert "record_index" in example and new in failed["records"]["message"]


def test_a_new_class_takes_the_next_index(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.update("rebuild")
    base = load_manifest(project.shards)
    added = add_images(project.source, "amber", 6, seed=2)  # sorts before every old class
    manifest = project.update("append")
    assert manifest.classes == [*base.classes, "amber"]
    assert manifest.generations[1].new_classes == ["amber"]
    amber = {hashlib.sha256((project.source / p).read_bytes()).hexdigest() for p in added}
    contents = records_by_file(project.shards)
    labels = {h: label for rows in contents.values() for h, label in rows}
    assert {labels[h] for h in amber} == {len(base.classes)}
    old = {
        h: label for f, rows in contents.items() if not f.startswith("gen-") for h, label in rows
    }
    index = load_index(project.index)
    by_hash = {r["sha256"]: r["label"] for r in index["records"]}
    assert all(base.classes[label] == by_hash[h] for h, label in old.items())  # never moved
    reports = project.root / "reports"
    assert run_validate(
        project.shards, reports / "v.json", reports / "v.md", index_path=project.index
    )["passed"]


def test_train_run_records_the_generation_list(
    grown: tuple[Project, dict[str, str], list[str]], mlflow_uri: str
) -> None:
    from tasks.contracts import run_records
    from tasks.runtime import tracking

    project, _, _ = grown
    manifest = load_manifest(project.shards)
    client = tracking.client(project.root)
    run_id = run_records.start_train_run(
        client, default_params(), manifest, shards_dir=project.shards, root=project.root
    )
    path = client.download_artifacts(run_id, "data/generations.json", str(project.root))
    logged = json.loads(Path(path).read_text())["generations"]
    assert [(g["number"], g["base_fingerprint"]) for g in logged] == [
        (0, None),
        (1, project.base_fingerprint),
    ]
    assert logged[1]["shards"] == manifest.generations[1].shards


def test_a_damaged_older_record_list_fails_generations_and_blames_no_intact_shard(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    project, _, _ = grown
    path = project.shards / "records.json"  # generation 0's list
    path.write_text(path.read_text().replace('"width"', '"width" ', 1))  # one byte more
    report = run_validate(project.shards, tmp_report(project), tmp_report(project, ".md"))
    failed = {c["name"]: c["message"] for c in report["checks"] if not c["passed"]}
    assert list(failed) == ["generations"] and "records.json" in failed["generations"]


def test_a_set_placed_under_the_earlier_rule_is_placed_afresh_and_an_append_names_the_rebuild(
    tmp_path: Path,
) -> None:
    """A set sharded when each image drew its split from its own content hash (no class
    shares, no thumbnails): the next ingest places every image afresh under the current
    rule, the append refuses the images that moved and names the rebuild, which passes."""
    from tasks.contracts.index import write_index
    from tasks.validate.stage import run_validate

    project = Project(tmp_path)
    project.update("rebuild")
    old = load_index(project.index)
    for record in old["records"]:  # what the earlier rule gave: a split per content hash
        key = hashlib.sha256(f"1337:{record['sha256']}".encode()).digest()
        u = int.from_bytes(key[:8], "big") / 2**64
        record["split"] = "train" if u < 0.5 else "val" if u < 0.75 else "test"
    earlier = {k: v for k, v in old["placement"].items() if k not in ("confirmation", "rule")}
    write_index(project.index, {**old, "placement": earlier})
    project.shard("rebuild")
    before = digests(project.shards)

    project.ingest()
    placed = {r["sha256"]: r["split"] for r in load_index(project.index)["records"]}
    moved = [r for r in old["records"] if placed[r["sha256"]] != r["split"]]
    assert moved  # the class shares move some images
    with pytest.raises(RebuildNeeded) as error:
        project.shard("append")
    message = str(error.value)
    assert f"{len(moved)} record(s) of the base shard set no longer match" in message
    assert "shard.mode: rebuild" in message and any(r["path"] in message for r in moved)
    assert digests(project.shards) == before
    project.shard("rebuild")
    report = run_validate(
        project.shards, tmp_path / "v.json", tmp_path / "v.md", index_path=project.index
    )
    assert report["passed"] is True


def test_append_keeps_old_shards_and_puts_new_images_in_new_shards(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    project, before, new = grown
    after = digests(project.shards)
    base_shards = {f: h for f, h in before.items() if ".tfrecord-" in f}
    assert base_shards and all(after[f] == h for f, h in base_shards.items())  # byte-identical
    added = {f for f in after if f not in before}
    assert added and all(f.startswith("gen-00001/") for f in added)

    manifest = load_manifest(project.shards)
    assert [g.number for g in manifest.generations] == [0, 1]
    assert manifest.generations[0].base_fingerprint is None
    assert manifest.generations[1].base_fingerprint == project.base_fingerprint
    new_hashes = {hashlib.sha256((project.source / p).read_bytes()).hexdigest() for p in new}
    contents = records_by_file(project.shards)
    in_new = {h for f, rows in contents.items() if f.startswith("gen-00001/") for h, _ in rows}
    in_old = {h for f, rows in contents.items() if not f.startswith("gen-") for h, _ in rows}
    assert in_new == new_hashes and not in_old & new_hashes
    assert sum(manifest.generations[1].num_records.values()) == len(new)
