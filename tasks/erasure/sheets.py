"""Contact sheets and ``shardflow forget``: the dry run's sheet of what would go, and the
sheets a forget removes because the set they were drawn from held a forgotten image.

Sheets live in two places. Per clone, under :attr:`~tasks.runtime.layout.Layout.sheets`:
the near-duplicate groups' and the dry runs', each naming the content hashes of its set in
the PNG (:mod:`tasks.contracts.sheet_source`). Tracked, in ``plots/eval`` (the evaluate
stage's out): the misclassified and label-review pictures, drawn from the evaluated shard
set, which ``dvc.lock`` names. Pixels cannot be searched for, so a sheet goes by what it was
drawn from, never by its bytes; one that names no source goes too (it is drawn again).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.contracts.manifest import MANIFEST_NAME, MEMBERSHIP_NAME, load_manifest
from tasks.contracts.membership import Membership
from tasks.contracts.sheet_source import sheet_images, sheet_text
from tasks.erasure.lost_revisions import object_id
from tasks.evaluate.sheets import image_sheet
from tasks.schema import HASH_KEY, IMAGE_KEY
from tasks.tfrecord import open_records, read_framed

DRY_RUN_SHEET = "forget-dry-run.png"
EVAL_PICTURES = ("misclassified.png", "label_issues.png")  # drawn from shard images
TILE_PIXELS = 256  # a source image is shrunk to this side before it is drawn


@dataclass(frozen=True)
class SheetImage:
    """One tile of a dry run's sheet: the image's path (None: no file in the index) and
    content hash."""

    path: str | None
    sha256: str
    title: str


def write_dry_run_sheet(
    images: Sequence[SheetImage], *, source_dir: Path, shards_dir: Path, out: Path
) -> Path:
    """Draw every image of ``images`` into ``out``, from its source file, or from its shard
    record when the file is gone (a grey tile when neither is left); the sheet names the
    images' content hashes as its source."""
    tiles = [(pixels_of(image, source_dir, shards_dir), image.title) for image in images]
    out.parent.mkdir(parents=True, exist_ok=True)
    figure = image_sheet(tiles, "no image would go")
    figure.savefig(out, dpi=80, metadata=sheet_text(image.sha256 for image in images))
    return out


def pixels_of(image: SheetImage, source_dir: Path, shards_dir: Path) -> np.ndarray:
    """The image's pixels: its source file's, else its shard record's, else grey."""
    from PIL import Image, UnidentifiedImageError

    if image.path is not None and (source_dir / image.path).is_file():
        try:
            with Image.open(source_dir / image.path) as opened:
                opened.thumbnail((TILE_PIXELS, TILE_PIXELS))
                return np.asarray(opened.convert("RGB"))
        except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError):
            pass
    record = shard_pixels(shards_dir, image.sha256)
    return record if record is not None else np.full((8, 8, 3), 200, dtype=np.uint8)


def shard_pixels(shards_dir: Path, sha256: str) -> np.ndarray | None:
    """The pixels of the current shard set's record of ``sha256`` (None: it holds none)."""
    membership_path = shards_dir / MEMBERSHIP_NAME
    if not membership_path.is_file():
        return None
    with Membership(membership_path) as membership:
        found = membership.find(sha256)
    if not found:
        return None
    manifest = load_manifest(shards_dir)
    gzip_compressed = manifest.compression == "gzip"
    with open_records(shards_dir / found[0].shard_file, gzip_compressed=gzip_compressed) as f:
        while (data := read_framed(f)) is not None:
            features = manifest.record_schema.parse(data)
            if features[HASH_KEY] == sha256:
                return np.asarray(features[IMAGE_KEY])
    return None


def clone_sheets_of(sheets_dir: Path, hashes: Iterable[str]) -> list[Path]:
    """The per-clone sheets under ``sheets_dir`` drawn from a set holding one of ``hashes``,
    and those that name no source (nothing tells they did not)."""
    wanted = set(hashes)
    found = []
    for path in sorted(sheets_dir.rglob("*.png")) if sheets_dir.is_dir() else []:
        images = sheet_images(path)
        if images is None or images & wanted:
            found.append(path)
    return found


def evaluated_set(root: Path, shards_dir: Path) -> str | None:
    """The fingerprint of the shard set the working tree's evaluation was drawn from, as
    ``dvc.lock`` names it: the manifest of the shard listing the evaluate stage read (from
    the DVC cache), else the current set's when that listing is the shard stage's out;
    None when unknown."""
    stages = _lock_stages(root)
    folder = shards_dir.relative_to(root).as_posix() if shards_dir.is_relative_to(root) else ""
    read = _entry_md5(stages.get("evaluate", {}).get("deps", []), folder)
    if read is None:
        return None
    listing = _cached_json(root, read)
    entries = [e for e in listing if isinstance(e, dict)] if isinstance(listing, list) else []
    manifest = next((e for e in entries if e.get("relpath") == MANIFEST_NAME), None)
    document = _cached_json(root, str(manifest.get("md5", ""))) if manifest else None
    if isinstance(document, dict) and document.get("fingerprint"):
        return str(document["fingerprint"])
    if read != _entry_md5(stages.get("shard", {}).get("outs", []), folder):
        return None
    try:
        return load_manifest(shards_dir).fingerprint
    except (OSError, ValueError):
        return None


def picture_objects(root: Path, eval_dir: Path) -> list[str]:
    """The DVC object ids (md5) of the evaluation's pictures: those the ``plots/eval``
    listing ``dvc.lock`` names lists (when the listing is in the cache) and those of the
    pictures in the working tree."""
    folder = eval_dir.relative_to(root).as_posix() if eval_dir.is_relative_to(root) else ""
    listing_id = _entry_md5(_lock_stages(root).get("evaluate", {}).get("outs", []), folder)
    listing = _cached_json(root, listing_id) if listing_id else None
    ids = {
        str(entry["md5"])
        for entry in (listing if isinstance(listing, list) else [])
        if isinstance(entry, dict) and entry.get("relpath") in EVAL_PICTURES and entry.get("md5")
    }
    ids |= {md5_of(eval_dir / name) for name in EVAL_PICTURES if (eval_dir / name).is_file()}
    return sorted(ids)


def remove_objects(folders: Iterable[Path], ids: set[str], keep: set[str]) -> list[Path]:
    """Delete the DVC objects ``ids`` (but ``keep``) wherever ``folders`` store them."""
    removed = []
    for folder in folders:
        for top, _, names in os.walk(folder) if Path(folder).is_dir() else []:
            for name in names:
                path = Path(top) / name
                found = object_id(str(path))
                if found in ids and found not in keep and path.is_file():
                    path.unlink()
                    removed.append(path)
    return sorted(removed)


def md5_of(path: Path) -> str:
    """The DVC object id of a file: the md5 of its bytes."""
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def _lock_stages(root: Path) -> dict[str, Any]:
    import yaml

    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    return stages if isinstance(stages, dict) else {}


def _entry_md5(entries: Any, path: str) -> str | None:
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("path") == path and entry.get("md5"):
            return str(entry["md5"])
    return None


def _cached_json(root: Path, md5: str) -> Any:
    path = root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
