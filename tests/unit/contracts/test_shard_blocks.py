"""The block list: each shard's sha256 block by block, beside the manifest and outside its
fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.contracts.manifest import ShardFile, ShardManifest, SplitInfo, build_manifest
from tasks.contracts.shard_blocks import (
    BLOCKS_NAME,
    BlockListError,
    ShardBlocks,
    block_count,
    check_block_list,
    hash_blocks,
    parse_block_list,
    write_block_list,
)
from tasks.schema import RecordSchema

BLOCK = 64
# a shard of two blocks and a half, one of exactly two, one of a single short block, an empty one
SIZES = {"train-0": 2 * BLOCK + BLOCK // 2, "train-1": 2 * BLOCK, "val-0": 5, "test-0": 0}


def shard_folder(root: Path, sizes: dict[str, int], *, seed: int = 0) -> ShardManifest:
    """Files of random bytes and a manifest listing them (their sizes and sha256)."""
    rng = np.random.default_rng(seed)
    splits: dict[str, list[ShardFile]] = {"train": [], "val": [], "test": []}
    for name, size in sizes.items():
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (root / name).write_bytes(data)
        shard = ShardFile(
            file=name, num_records=1, bytes=size, sha256=hashlib.sha256(data).hexdigest()
        )
        splits[name.split("-")[0]].append(shard)
    infos = {
        split: SplitInfo(num_records=len(shards), class_counts={"a": len(shards)}, shards=shards)
        for split, shards in splits.items()
    }
    schema = RecordSchema(height=4, width=4, encoding="raw")
    return build_manifest(
        schema, ["a"], "none", infos, resize="pad", draft_decode=False, preprocessing_version="v"
    )


def shard_of(manifest: ShardManifest, name: str = "train-0") -> ShardFile:
    return next(s for i in manifest.splits.values() for s in i.shards if s.file == name)


def test_the_block_list_is_deterministic_and_hashes_every_block(tmp_path: Path) -> None:
    manifest = shard_folder(tmp_path, SIZES)
    write_block_list(manifest, tmp_path, block_size=BLOCK)
    first = (tmp_path / BLOCKS_NAME).read_bytes()
    (tmp_path / BLOCKS_NAME).unlink()
    write_block_list(manifest, tmp_path, block_size=BLOCK)
    assert (tmp_path / BLOCKS_NAME).read_bytes() == first  # same shards, same bytes
    listed = parse_block_list(first.decode(), where=BLOCKS_NAME)
    assert listed.block_size == BLOCK
    assert listed.fingerprint == manifest.fingerprint
    assert sorted(listed.shards) == sorted(SIZES)
    for name, size in SIZES.items():
        data, entry = (tmp_path / name).read_bytes(), listed.shards[name]
        assert (entry.bytes, entry.sha256) == (size, hashlib.sha256(data).hexdigest())
        spans = [entry.span(n, BLOCK) for n in range(len(entry.blocks))]
        assert [last - first + 1 for first, last in spans] == [
            min(BLOCK, size - n * BLOCK) for n in range(block_count(size, BLOCK))
        ]  # the last block shorter, together exactly the shard
        assert list(entry.blocks) == [
            hashlib.sha256(data[first : last + 1]).hexdigest() for first, last in spans
        ]
    check_block_list(listed, manifest, where=BLOCKS_NAME)  # describes its manifest


def test_the_fingerprint_does_not_cover_the_block_list(tmp_path: Path) -> None:
    manifest = shard_folder(tmp_path, SIZES)
    before = manifest.compute_fingerprint()
    write_block_list(manifest, tmp_path, block_size=BLOCK)
    assert BLOCKS_NAME not in manifest.to_json()
    assert manifest.compute_fingerprint() == before == manifest.fingerprint


def test_a_shard_changed_since_its_manifest_gets_no_block_list(tmp_path: Path) -> None:
    manifest = shard_folder(tmp_path, SIZES)
    data = bytearray((tmp_path / "train-1").read_bytes())
    data[BLOCK + 3] ^= 0x01
    (tmp_path / "train-1").write_bytes(bytes(data))
    with pytest.raises(BlockListError, match=r"train-1: .* the manifest says 128 bytes"):
        write_block_list(manifest, tmp_path, block_size=BLOCK)
    assert not (tmp_path / BLOCKS_NAME).exists()


def test_an_append_keeps_the_base_entries_byte_identical_and_hashes_only_new_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.contracts.shard_blocks as blocks

    base = shard_folder(tmp_path, SIZES)
    write_block_list(base, tmp_path, block_size=BLOCK)
    old_lines = set((tmp_path / BLOCKS_NAME).read_text().splitlines()[1:-1])
    grown = shard_folder(tmp_path, {**SIZES, "train-2": 3 * BLOCK + 1}, seed=0)
    hashed: list[str] = []
    real = blocks.hash_blocks

    def spy(path: Path, shard: ShardFile, block_size: int = BLOCK) -> ShardBlocks:
        hashed.append(shard.file)
        return real(path, shard, block_size)

    monkeypatch.setattr(blocks, "hash_blocks", spy)
    write_block_list(grown, tmp_path, base, block_size=BLOCK)
    assert hashed == ["train-2"]  # the base's shards were not read again
    text = (tmp_path / BLOCKS_NAME).read_text()
    lines = {line.rstrip(",") for line in text.splitlines()[1:-1]}
    assert {line.rstrip(",") for line in old_lines} <= lines  # old entries, byte for byte
    assert len(lines) == len(SIZES) + 1
    monkeypatch.setattr(blocks, "hash_blocks", real)
    (tmp_path / BLOCKS_NAME).unlink()
    write_block_list(grown, tmp_path, block_size=BLOCK)  # every shard hashed now
    assert (tmp_path / BLOCKS_NAME).read_text() == text


def test_an_append_on_a_list_of_another_set_hashes_the_base_again(tmp_path: Path) -> None:
    base = shard_folder(tmp_path, SIZES)
    write_block_list(base, tmp_path, block_size=BLOCK)
    data = json.loads((tmp_path / BLOCKS_NAME).read_text())
    data["shards"]["train-0"]["blocks"][0] = "0" * 64  # the base's list, edited
    data["fingerprint"] = "f" * 64
    (tmp_path / BLOCKS_NAME).write_text(json.dumps(data))
    grown = shard_folder(tmp_path, {**SIZES, "train-2": 7})
    write_block_list(grown, tmp_path, base, block_size=BLOCK)
    listed = parse_block_list((tmp_path / BLOCKS_NAME).read_text(), where=BLOCKS_NAME)
    assert listed.shards["train-0"] == hash_blocks(tmp_path / "train-0", shard_of(base), BLOCK)


def edit_entry(data: dict[str, Any], change: str) -> str:
    """``data`` (a parsed list) with one disagreement with its manifest; what names it."""
    entry = data["shards"]["train-0"]
    if change == "sha256":
        entry["sha256"] = "0" * 64
    elif change == "bytes":
        entry["bytes"] += 1
    elif change == "blocks":
        entry["blocks"].pop()
    elif change == "missing":
        del data["shards"]["train-0"]
    elif change == "extra":
        data["shards"]["stray"] = dict(entry)
        return "stray"
    elif change == "fingerprint":
        data["fingerprint"] = "f" * 64
        return "another set"
    return "train-0"


@pytest.mark.parametrize("change", ["sha256", "bytes", "blocks", "missing", "extra", "fingerprint"])
def test_a_list_that_disagrees_with_its_manifest_is_refused_naming_it(
    tmp_path: Path, change: str
) -> None:
    manifest = shard_folder(tmp_path, SIZES)
    write_block_list(manifest, tmp_path, block_size=BLOCK)
    data = json.loads((tmp_path / BLOCKS_NAME).read_text())
    named = edit_entry(data, change)
    listed = parse_block_list(json.dumps(data), where="s3://b/set/blocks.json")
    with pytest.raises(BlockListError, match=f"s3://b/set/blocks.json: .*{named}.*republish"):
        check_block_list(listed, manifest, where="s3://b/set/blocks.json")


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"version": 2, "block_size": 64, "fingerprint": "x", "shards": {}}',
        '{"version": 1, "block_size": 0, "fingerprint": "x", "shards": {}}',
        '{"version": 1, "block_size": 64, "fingerprint": "x", "shards": {"a": {"bytes": 1}}}',
        '{"version": 1, "block_size": 64, "fingerprint": "x", '
        '"shards": {"a": {"bytes": 1, "sha256": "s", "blocks": ["not a hash"]}}}',
    ],
)
def test_what_is_not_a_block_list_is_refused_naming_the_file(text: str) -> None:
    with pytest.raises(BlockListError, match=r"data/shards/blocks\.json: not a block list"):
        parse_block_list(text, where="data/shards/blocks.json")
