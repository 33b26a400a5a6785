"""Record lists read a shard's list at a time, and the data diff held as a compact table."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tasks.contracts import shard_changes as data_diff
from tasks.contracts.manifest import _JsonStream, load_manifest, load_records, stream_records
from tests.unit.shard.test_append import Project, add_images


@pytest.fixture
def two_generations(tmp_path: Path) -> Project:
    """A rebuilt base, then an append holding a path with multi-byte UTF-8 characters."""
    project = Project(tmp_path)
    project.update("rebuild")
    (name,) = add_images(project.source, "red", 1, seed=3)
    shutil.move(project.source / name, project.source / "red" / "crème brûlée 漢字.png")
    add_images(project.source, "green", 2, seed=4)
    project.update("append")
    return project


def documents(project: Project) -> dict[str, list[dict[str, object]]]:
    """Every generation's record list, parsed whole with json.loads."""
    per_file: dict[str, list[dict[str, object]]] = {}
    for generation in load_manifest(project.shards).generations:
        per_file.update(
            json.loads((project.shards / generation.records_file).read_text())["shards"]
        )
    return per_file


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_streamed_lists_equal_the_documents_whatever_the_read_size(
    two_generations: Project, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # reads of 1 and 7 bytes split numbers, strings and multi-byte characters between reads
    monkeypatch.setattr(_JsonStream, "CHUNK", chunk)
    project = two_generations
    manifest = load_manifest(project.shards)
    want = documents(project)
    assert len(manifest.generations) == 2
    assert any("brûlée 漢字" in str(r["path"]) for rs in want.values() for r in rs)
    assert load_records(project.shards, manifest) == want
    pairs = list(stream_records(project.shards, manifest))
    assert [f for f, _ in pairs] == [f for f, rs in want.items() for _ in rs]
    assert len(pairs) == manifest.total_records


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace('"red/', '"rad/', 1),  # still valid JSON, other bytes
        lambda text: text[: len(text) // 2],  # torn
        lambda text: text.replace("[", "{", 1),  # not a record list
    ],
    ids=["edited", "torn", "garbled"],
)
def test_a_damaged_list_is_refused_naming_the_file(
    two_generations: Project, damage: Callable[[str], str]
) -> None:
    project = two_generations
    manifest = load_manifest(project.shards)
    path = project.shards / manifest.generations[0].records_file
    path.write_text(damage(path.read_text()))
    with pytest.raises(ValueError, match=rf"{path}: sha256 differs from the manifest"):
        list(stream_records(project.shards, manifest))


def row(sha: str, path: str, split: str, label: str, width: int, height: int) -> data_diff.Row:
    return data_diff.Row(sha * 64, path, split, label, width, height)


def test_table_diff_counts_added_removed_shares_and_sizes(tmp_path: Path) -> None:
    project = Project(tmp_path)
    manifest = project.update("rebuild")  # any manifest: only its names and classes are read
    before = data_diff.Table.of(
        [
            row("a", "old/1.png", "train", "old", 10, 10),
            row("b", "red/1.png", "train", "red", 30, 10),
            row("c", "red/2.png", "val", "red", 20, 40),
        ]
    )
    after = data_diff.Table.of(
        [
            row("b", "red/1.png", "train", "red", 30, 10),
            row("c", "red/2.png", "val", "red", 20, 40),
            row("d", "blue/1.png", "test", "blue", 50, 25),
            row("e", "blue/2.png", "test", "blue", 60, 30),
        ]
    )
    diff = data_diff.compute(manifest, before, manifest, after, mode="rebuild")
    assert diff["records"] == {"before": 3, "after": 4}
    assert diff["added"] == {"train": {}, "val": {}, "test": {"blue": 2}}
    assert diff["removed"] == {"train": {"old": 1}, "val": {}, "test": {}}
    assert (diff["added_total"], diff["removed_total"]) == (2, 1)
    assert diff["class_share"]["old"] == {"before": 0.333333, "after": 0.0, "shift": -0.333333}
    assert diff["class_share"]["blue"] == {"before": 0.0, "after": 0.5, "shift": 0.5}
    assert diff["new_classes"] == ["blue", "green"]  # the manifest's classes the before lacked
    assert list(diff["class_share"]) == ["blue", "green", "red", "old"]
    # nearest rank over sorted values: p10 of 4 is the first, p50 the third, p90 the fourth
    assert diff["image_size"]["after"]["aspect"] == [0.5, 2.0, 3.0]
    assert diff["image_size"]["before"]["width"] == [10.0, 20.0, 30.0]


def test_a_table_refuses_a_count_the_manifest_does_not_have() -> None:
    rows = [row("a", "red/1.png", "train", "red", 1, 1)]
    with pytest.raises(ValueError, match="hold 1 records, the manifest 2"):
        data_diff.Table.of(rows, expected=2)
    with pytest.raises(ValueError, match="not a sha256"):
        data_diff.Table.of([row("a", "red/1.png", "train", "red", 1, 1)._replace(sha256="ab")])


def test_hashes_ending_in_zero_bytes_stay_distinct(tmp_path: Path) -> None:
    """numpy's fixed-width bytes pad with zeros: hashes that end in them must still differ."""
    manifest = Project(tmp_path).update("rebuild")
    one, two = "ab" * 31 + "00", "ab" * 30 + "0000"
    before = data_diff.Table.of([data_diff.Row(one, "red/1.png", "train", "red", 4, 4)])
    after = data_diff.Table.of(
        [
            data_diff.Row(one, "red/1.png", "train", "red", 4, 4),
            data_diff.Row(two, "red/2.png", "train", "red", 4, 4),
        ]
    )
    diff = data_diff.compute(manifest, before, manifest, after, mode="rebuild")
    assert (diff["added_total"], diff["removed_total"]) == (1, 0)
    assert data_diff.missing_from(before.hash_array(), after.hash_array()).tolist() == [False]
    assert data_diff.missing_from(after.hash_array(), before.hash_array()).tolist() == [False, True]


def random_rows(rng: np.random.Generator, n: int, start: int = 0) -> list[data_diff.Row]:
    rows = []
    for i in range(start, start + n):
        digest = bytearray(rng.bytes(32))
        digest[0] = i % 3  # some hashes start with zero bytes (numpy pads and strips those)
        rows.append(
            data_diff.Row(
                digest.hex(),
                f"c{i % 4}/{i}.png",
                ("train", "val", "test")[i % 3],
                f"c{i % 4}",
                int(rng.integers(10, 20)),
                int(rng.integers(10, 20)),
            )
        )
    return rows


def test_a_spilled_table_diffs_exactly_as_the_table_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard stage's tables live on disk a bucket of hashes at a time; the diff, the
    mask of records found and the size quantiles come out as from the whole table."""
    monkeypatch.setattr(data_diff, "SPILL_CHUNK", 97)  # many flushes, every bucket appended to
    manifest = Project(tmp_path / "project").update("rebuild")
    rng = np.random.default_rng(5)
    old = random_rows(rng, 1500)
    # after: 300 removed, 200 moved to another class, 400 new
    new = [r._replace(label="c9") if i < 200 else r for i, r in enumerate(old[300:])]
    new += random_rows(rng, 400, start=1500)
    spills = tmp_path / "shards"
    spills.mkdir()
    before = data_diff.SpilledTable.of(spills, old, expected=1500)
    after = data_diff.SpilledTable.of(spills, new)
    want = data_diff.compute(
        manifest, data_diff.Table.of(old), manifest, data_diff.Table.of(new), mode="rebuild"
    )
    got = data_diff.compute(manifest, before, manifest, after, mode="rebuild")
    assert got == want
    assert (got["added_total"], got["removed_total"], got["moved_total"]) == (600, 500, 200)
    in_before = data_diff.found_mask(after, before)
    assert in_before.tolist() == [i < 1200 for i in range(1600)]
    twin = before.copy(spills)
    assert data_diff.compute(manifest, twin, manifest, before, mode="x")["added_total"] == 0
    assert len(list(spills.iterdir())) == 3
    for table in (before, after, twin):
        table.close()
    assert not list(spills.iterdir())
    with pytest.raises(ValueError, match="hold 1500 records, the manifest 2"):
        data_diff.SpilledTable.of(spills, old, expected=2)
    assert not list(spills.iterdir())  # a refused table leaves nothing behind
