"""Which sheets a forget removes, told by what they were drawn from, and the pixels a dry
run's sheet draws (the source file, else the shard record)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import yaml
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from tasks.contracts.content import file_sha256
from tasks.contracts.sheet_source import sheet_text
from tasks.erasure.sheets import (
    SheetImage,
    clone_sheets_of,
    evaluated_set,
    pixels_of,
    remove_objects,
    shard_pixels,
)
from tests.unit.erasure.test_lineage import layout_project, shard_set

A, B = "a" * 64, "b" * 64


def sheet(path: Path, hashes: list[str] | None) -> Path:
    info = PngInfo()
    for key, value in sheet_text(hashes).items() if hashes is not None else []:
        info.add_text(key, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4)).save(path, pnginfo=info)
    return path


def test_the_sheets_of_a_set_holding_an_image_go_and_those_of_other_sets_stay(
    tmp_path: Path,
) -> None:
    held = sheet(tmp_path / "groups" / "held.png", [A, B])
    other = sheet(tmp_path / "groups" / "other.png", [B])
    unnamed = sheet(tmp_path / "unnamed.png", None)

    assert clone_sheets_of(tmp_path, [A]) == sorted([held, unnamed])
    assert other.exists()
    assert clone_sheets_of(tmp_path / "absent", [A]) == []


def test_a_tile_comes_from_the_source_file_else_from_the_shard_record(tmp_path: Path) -> None:
    project, layout = layout_project(tmp_path)
    shard_set(project, layout)
    path = next(p for p in sorted(project.source.rglob("*.png")))
    sha, relative = file_sha256(path), path.relative_to(project.source).as_posix()
    image = SheetImage(relative, sha, "t")
    with Image.open(path) as source:
        from_file = np.asarray(source.convert("RGB"))

    assert np.array_equal(pixels_of(image, project.source, layout.shards_dir), from_file)
    path.unlink()
    record = shard_pixels(layout.shards_dir, sha)
    assert record is not None and record.shape == (16, 16, 3)
    assert np.array_equal(pixels_of(image, project.source, layout.shards_dir), record)
    assert shard_pixels(layout.shards_dir, A) is None


def cached(root: Path, data: bytes, suffix: str = "") -> str:
    md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
    path = root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / (md5[2:] + suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return md5 + suffix


def test_the_evaluated_set_is_the_manifest_of_the_shard_listing_dvc_lock_names(
    tmp_path: Path,
) -> None:
    manifest = cached(tmp_path, json.dumps({"fingerprint": A}).encode())
    listing = cached(
        tmp_path, json.dumps([{"md5": manifest, "relpath": "manifest.json"}]).encode(), ".dir"
    )
    shards = tmp_path / "data" / "shards"
    read = {"evaluate": {"deps": [{"path": "data/shards", "md5": listing}]}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"stages": read}))
    assert evaluated_set(tmp_path, shards) == A

    unknown = {"evaluate": {"deps": [{"path": "data/shards", "md5": "0" * 32 + ".dir"}]}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"stages": unknown}))
    assert evaluated_set(tmp_path, shards) is None
    (tmp_path / "dvc.lock").unlink()
    assert evaluated_set(tmp_path, shards) is None


def test_picture_objects_go_from_every_store_but_those_the_working_tree_keeps(
    tmp_path: Path,
) -> None:
    cache, remote = tmp_path / "cache", tmp_path / "remote"
    gone, kept = "1" * 32, "2" * 32
    paths = {
        f"{store.name}-{md5[0]}": store / "files" / "md5" / md5[:2] / md5[2:]
        for store in (cache, remote)
        for md5 in (gone, kept)
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"png")
    other = cache / "files" / "md5" / "33" / ("3" * 30)  # an object not asked for
    other.parent.mkdir(parents=True)
    other.write_bytes(b"png")

    removed = remove_objects([cache, remote], {gone, kept}, keep={kept})

    assert removed == sorted([paths["cache-1"], paths["remote-1"]])
    assert paths["cache-2"].exists() and paths["remote-2"].exists() and other.exists()
