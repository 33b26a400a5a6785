"""Growing data: incremental ingest, append-only shard generations, reading every generation."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tasks.contracts.index import load_index
from tasks.contracts.manifest import load_manifest
from tasks.ingest.stage import run_ingest
from tasks.runtime.params import SplitFractions, default_params
from tasks.schema import HASH_KEY, LABEL_KEY
from tasks.shard.append import RebuildNeeded
from tasks.shard.stage import shard_stage
from tests.conftest import write_image_folder

SPLITS = SplitFractions(train=0.5, val=0.25, test=0.25)


def add_images(source: Path, label: str, count: int, *, seed: int) -> list[str]:
    """Write ``count`` new distinct PNGs into ``source/label``; return their relative paths."""
    rng = np.random.default_rng(seed)
    (source / label).mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        pixels = rng.integers(0, 256, size=(24, 20 + i % 7, 3), dtype=np.uint8)
        name = f"{label}/new_{seed}_{i:03d}.png"
        Image.fromarray(pixels, mode="RGB").save(source / name)
        paths.append(name)
    return paths


def ingest_params(source: Path) -> Any:
    settings = {"source_dir": str(source), "splits": SPLITS.model_dump(), "workers": 1}
    return default_params(ingest=settings).ingest


class Project:
    """A source folder, its index and its shard set, run stage by stage like `dvc repro`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.source = write_image_folder(root / "images", per_class=8)
        self.index = root / "index.json"
        self.shards = root / "shards"
        self.base_fingerprint = ""

    def ingest(self) -> dict[str, Any]:
        params = default_params(
            ingest={"source_dir": str(self.source), "splits": SPLITS.model_dump(), "workers": 1}
        ).ingest
        return run_ingest(params, self.index, self.root / "ingest.json")

    def shard(self, mode: str = "append") -> Any:
        params = default_params(
            shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1, "mode": mode}
        ).shard
        return shard_stage(
            params, self.index, self.shards, diff_path=self.root / "diff.json"
        ).manifest

    def update(self, mode: str = "append") -> Any:
        self.ingest()
        return self.shard(mode)


def digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def grown(tmp_path: Path) -> tuple[Project, dict[str, str], list[str]]:
    """A rebuilt base, then 5 new red images appended; returns (project, base digests, new)."""
    return grow(tmp_path)


def grow(tmp_path: Path) -> tuple[Project, dict[str, str], list[str]]:
    """:func:`grown`'s project, for the slow tests' fixture of the same name."""
    project = Project(tmp_path)
    project.base_fingerprint = project.update("rebuild").fingerprint
    before = digests(project.shards)
    new = add_images(project.source, "red", 5, seed=1)
    project.update("append")
    return project, before, new


def records_by_file(shards_dir: Path) -> dict[str, list[tuple[str, int]]]:
    """(content hash, label) of every record, read back from the shard files."""
    import tensorflow as tf

    manifest = load_manifest(shards_dir)
    schema = manifest.record_schema
    out = {}
    for info in manifest.splits.values():
        for shard in info.shards:
            rows = []
            for raw in tf.data.TFRecordDataset(str(shards_dir / shard.file)):
                features = schema.parse_single(raw)
                rows.append((features[HASH_KEY].numpy().decode(), int(features[LABEL_KEY])))
            out[shard.file] = rows
    return out


def test_same_history_gives_the_same_bytes_in_two_clones(tmp_path: Path) -> None:
    results = []
    for clone in ("a", "b"):
        project = Project(tmp_path / clone)
        project.update("rebuild")
        add_images(project.source, "green", 4, seed=3)
        project.update("append")
        add_images(project.source, "blue", 3, seed=4)
        project.update("append")
        results.append(digests(project.shards))
    assert results[0] == results[1]
    assert any(f.startswith("gen-00002/") for f in results[0])


def test_append_with_nothing_new_changes_nothing(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    project, _, _ = grown
    before = digests(project.shards)
    project.update("append")
    assert digests(project.shards) == before


def test_missing_base_is_refused_naming_the_command(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.ingest()
    # the set this clone built is gone from the folder (deleted): its cache has it
    with pytest.raises(FileNotFoundError, match=r"dvc checkout data/shards.*dvc pull data/shards"):
        project.shard("append")
    assert not (project.shards / "manifest.json").exists()  # nothing silently rebuilt


def test_removed_or_changed_image_needs_a_rebuild_which_gives_one_generation(
    grown: tuple[Project, dict[str, str], list[str]],
) -> None:
    project, _, new = grown
    (project.source / new[0]).unlink()
    before = digests(project.shards)
    with pytest.raises(RebuildNeeded, match=r"shard\.mode: rebuild") as error:
        project.update("append")
    assert f"{new[0]} removed, changed or quarantined" in str(error.value)
    assert digests(project.shards) == before  # the refused append left the set as it was
    manifest = project.shard("rebuild")
    assert [g.number for g in manifest.generations] == [0]
    assert not list(project.shards.glob("gen-*"))


def test_incremental_ingest_decodes_only_new_or_changed_files(tmp_path: Path) -> None:
    project = Project(tmp_path)
    first = project.ingest()
    assert first["reused_count"] == 0 and first["decoded_count"] == first["files_found"]
    added = add_images(project.source, "red", 3, seed=5)
    changed = project.source / "blue" / "001.png"
    Image.new("RGB", (30, 30), (1, 2, 3)).save(changed)
    second = project.ingest()
    assert second["decoded_count"] == len(added) + 1
    assert second["reused_count"] == first["files_found"] - 1
    full = tmp_path / "full"
    params = default_params(
        ingest={"source_dir": str(project.source), "splits": SPLITS.model_dump(), "workers": 1}
    ).ingest
    run_ingest(params, full / "index.json", full / "ingest.json")
    # the same verdicts and records as a full ingest; the splits are the placed ones (a full
    # placement shares every class out afresh, an incremental one keeps what shards hold)
    incremental, whole = load_index(project.index), load_index(full / "index.json")
    for index in (incremental, whole):
        for record in index["records"]:
            del record["split"]
    assert incremental == whole


def test_unchanged_files_are_not_read_again_and_any_rewrite_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose size, mtime, ctime and inode match the last ingest keeps its hash
    unread; a rewrite that keeps size and mtime still moves ctime, so it is read again."""
    from tasks.ingest import stage as ingest
    from tasks.ingest.stage import signatures_path

    project = Project(tmp_path)
    project.ingest()
    fresh = project.ingest()
    assert fresh["stat_trusted_count"] == 0  # written just now: racily clean, never trusted

    monkeypatch.setattr(ingest, "RACE_MARGIN_NS", 0)
    project.ingest()
    index_before = project.index.read_bytes()
    trusted = project.ingest()
    assert trusted["stat_trusted_count"] == trusted["reused_count"] == trusted["files_found"]
    assert trusted["decoded_count"] == 0 and project.index.read_bytes() == index_before

    target = project.source / "blue" / "001.png"
    before = target.stat()
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (
        before.st_size,
        before.st_mtime_ns,
    )
    caught = project.ingest()
    assert caught["stat_trusted_count"] == trusted["stat_trusted_count"] - 1
    verdicts = load_index(project.index)["verdicts"]
    assert verdicts["blue/001.png"][0] == hashlib.sha256(bytes(data)).hexdigest()

    # Signatures belong to the index they were written with: another index, none trusted.
    other = tmp_path / "other"
    add_images(project.source, "red", 1, seed=9)
    params = ingest_params(project.source)
    run_ingest(params, other / "index.json", other / "ingest.json")
    project.index.write_bytes((other / "index.json").read_bytes())
    assert signatures_path(project.index).is_file()
    assert project.ingest()["stat_trusted_count"] == 0

    off = default_params(ingest={**params.model_dump(mode="json"), "trust_file_stat": False}).ingest
    run_ingest(off, project.index, project.root / "ingest.json")
    report = run_ingest(off, project.index, project.root / "ingest.json")
    assert report["stat_trusted_count"] == 0 and report["reused_count"] == report["files_found"]


@pytest.mark.parametrize("base_index", ["kept", "stale"])
def test_append_reads_only_new_headers_for_the_offset_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base_index: str
) -> None:
    """An append takes the base's record offsets from its checked offset index; a stale
    one is not trusted and every header is read again. Either way the index is exact."""
    import tasks.contracts.numpy_reader as records

    project = Project(tmp_path)
    project.update("rebuild")
    base_files = {s.file for i in load_manifest(project.shards).splits.values() for s in i.shards}
    if base_index == "stale":
        offsets_path = project.shards / records.OFFSETS_NAME
        stale = json.loads(offsets_path.read_text())
        stale["fingerprint"] = "0" * 64
        offsets_path.write_text(json.dumps(stale))
    add_images(project.source, "red", 5, seed=1)
    read: list[str] = []
    real = records.record_offsets

    def spy(path: str | Path, **kwargs: Any) -> list[tuple[int, int]]:
        read.append(Path(path).relative_to(project.shards).as_posix())
        return real(path, **kwargs)

    monkeypatch.setattr(records, "record_offsets", spy)
    manifest = project.update("append")
    new_files = {s.file for i in manifest.splits.values() for s in i.shards} - base_files
    assert new_files and set(read) == (
        new_files if base_index == "kept" else new_files | base_files
    )
    monkeypatch.setattr(records, "record_offsets", real)
    written = json.loads((project.shards / records.OFFSETS_NAME).read_text())
    assert written == records.offsets_json(manifest, project.shards)  # every header, read now


def test_an_image_moved_to_another_class_needs_a_rebuild_and_the_message_says_where(
    tmp_path: Path,
) -> None:
    project = Project(tmp_path)
    project.update("rebuild")
    index = load_index(project.index)
    record = next(r for r in index["records"] if r["path"] == "red/000.jpg")
    (project.source / record["path"]).rename(project.source / "blue" / "moved.png")
    (project.source / "red" / "001.png").rename(project.source / "red" / "renamed.png")  # fine
    before = digests(project.shards)
    with pytest.raises(RebuildNeeded) as error:
        project.update("append")
    split = record["split"]  # drawn from the content: a move keeps it
    assert "1 record(s) of the base shard set no longer match" in str(error.value)
    assert f"{record['path']} moved from red/{split} to blue/{split}" in str(error.value)
    assert digests(project.shards) == before


def test_a_renamed_image_is_kept_once_and_the_diff_names_both_paths(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.update("rebuild")
    (project.source / "red" / "001.png").rename(project.source / "red" / "renamed.png")
    new = add_images(project.source, "blue", 2, seed=9)
    manifest = project.update("append")
    diff = json.loads((project.root / "diff.json").read_text())
    assert diff["duplicates"] == [{"path": "red/renamed.png", "same_content_as": "red/001.png"}]
    assert diff["added_total"] == len(new) and diff["removed_total"] == 0
    assert manifest.total_records == diff["records"]["before"] + len(new)


def test_an_append_that_would_decode_otherwise_needs_a_rebuild(tmp_path: Path) -> None:
    """The manifest has one draft_decode for every record, and serving decodes by it: an
    append under the other setting would leave old and new records made two ways."""
    project = Project(tmp_path)
    project.update("rebuild")
    add_images(project.source, "red", 2, seed=11)
    project.ingest()
    before = digests(project.shards)
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1, "mode": "append"}
    ).shard
    with pytest.raises(RebuildNeeded, match=r"\(draft_decode\)"):
        shard_stage(
            params.model_copy(update={"draft_decode": False}), project.index, project.shards
        )
    assert digests(project.shards) == before


def tmp_report(project: Project, suffix: str = ".json") -> Path:
    return project.root / f"validation{suffix}"


def test_the_stage_spills_beside_the_shards_and_leaves_nothing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data diff's tables go to disk inside the shard folder while the stage runs
    (memory flat in the number of records) and are gone when it ends; a killed run's
    leftovers are removed by the next run."""
    from tasks.contracts import shard_changes as data_diff

    project = Project(tmp_path)
    project.update("rebuild")
    stale = project.shards / f"{data_diff.SPILL_PREFIX}killed"
    stale.mkdir()
    (stale / "000").write_bytes(b"x" * 59)
    seen: list[Path] = []
    real = data_diff.SpilledTable.__init__

    def spy(self: data_diff.SpilledTable, folder: Path) -> None:
        real(self, folder)
        seen.append(self.folder)

    monkeypatch.setattr(data_diff.SpilledTable, "__init__", spy)
    add_images(project.source, "red", 3, seed=9)
    project.update("append")
    assert seen and all(folder.parent == project.shards for folder in seen)
    assert not list(project.shards.glob(f"{data_diff.SPILL_PREFIX}*"))
    project.update("rebuild")
    assert not list(project.shards.glob(f"{data_diff.SPILL_PREFIX}*"))


def test_an_append_rereads_only_the_base_shards_whose_offsets_are_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base's offset index is read an entry at a time; one entry that does not match
    the base manifest is read again from its shard's headers, the rest are taken."""
    import tasks.contracts.numpy_reader as records

    project = Project(tmp_path)
    project.update("rebuild")
    offsets_path = project.shards / records.OFFSETS_NAME
    index = json.loads(offsets_path.read_text())
    damaged = sorted(index["shards"])[0]
    index["shards"][damaged]["offsets"].append(10**9)
    offsets_path.write_text(json.dumps(index, indent=1))  # whitespace is read too
    base_files = set(index["shards"])
    read: list[str] = []
    real = records.record_offsets

    def spy(path: str | Path, **kwargs: Any) -> list[tuple[int, int]]:
        read.append(Path(path).relative_to(project.shards).as_posix())
        return real(path, **kwargs)

    monkeypatch.setattr(records, "record_offsets", spy)
    add_images(project.source, "red", 5, seed=1)
    manifest = project.update("append")
    new_files = {s.file for i in manifest.splits.values() for s in i.shards} - base_files
    assert new_files and set(read) == new_files | {damaged}
    monkeypatch.setattr(records, "record_offsets", real)
    want = json.dumps(
        records.offsets_json(manifest, project.shards), sort_keys=True, separators=(",", ":")
    )
    assert offsets_path.read_text() == want + "\n"  # the bytes of the whole document


def test_an_append_keeps_the_block_lists_old_entries_and_adds_the_new_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard stage writes blocks.json beside offsets.json; an append keeps each base
    shard's entry byte for byte (not read again) and adds the new generation's."""
    import tasks.contracts.shard_blocks as blocks

    project = Project(tmp_path)
    base = project.update("rebuild")
    old = (project.shards / blocks.BLOCKS_NAME).read_text()
    base_files = {s.file for i in base.splits.values() for s in i.shards}
    add_images(project.source, "red", 5, seed=1)
    hashed: list[str] = []
    real = blocks.hash_blocks

    def spy(path: Path, shard: Any, block_size: int = blocks.BLOCK_SIZE) -> Any:
        hashed.append(shard.file)
        return real(path, shard, block_size)

    monkeypatch.setattr(blocks, "hash_blocks", spy)
    manifest = project.update("append")
    new_files = {s.file for i in manifest.splits.values() for s in i.shards} - base_files
    assert new_files and set(hashed) == new_files
    text = (project.shards / blocks.BLOCKS_NAME).read_text()
    entries = {line.rstrip(",") for line in text.splitlines()[1:-1]}
    assert {line.rstrip(",") for line in old.splitlines()[1:-1]} <= entries
    assert len(entries) == len(base_files | new_files)
    monkeypatch.setattr(blocks, "hash_blocks", real)
    fresh = blocks.block_entries(manifest, project.shards)  # every shard read now
    assert text == blocks.block_list_text(manifest.fingerprint, fresh, blocks.BLOCK_SIZE)
