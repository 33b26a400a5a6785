"""Sheets of the near-duplicate groups ingest flags (a group spanning classes, or holding
more than :data:`~tasks.contracts.near_duplicates.FLAGGED_GROUP_SHARE` of the images): one
PNG a group, each image a tile titled with its path and class, so a user sees at once
whether the group holds copies of one picture or pictures that merely look alike.

Drawn with Pillow from the source files (only a flagged group's images are read again),
into the per-clone sheets folder (:attr:`tasks.runtime.layout.Layout.sheets`), never a DVC out.
Each sheet names the content hashes of its group (:mod:`tasks.contracts.sheet_source`), so
``shardflow forget`` removes the sheets of the groups that held a forgotten image.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageOps
from PIL.PngImagePlugin import PngInfo

from tasks.contracts.sheet_source import sheet_text

TILE = 96  # pixels a side of each image's tile
CAPTION = 30  # pixels under each tile: up to two lines of its path and class
COLUMNS = 8
MAX_TILES = 64  # a group's first images by path; the report lists every one


def sheet_name(k: int) -> str:
    """The file name of the ``k``-th flagged group's sheet (from 1)."""
    return f"near-duplicate-group-{k}.png"


def write_group_sheet(
    source_dir: Path,
    group: dict[str, Any],
    labels: dict[str, str],
    hashes: dict[str, str],
    out: Path,
) -> Path:
    """Draw ``group`` (its ``paths``, relative to ``source_dir``) into ``out``: a title line,
    then one tile an image (a file that no longer decodes is a grey tile, still titled). The
    sheet names the group's content hashes (``hashes``: path -> sha256) as its source."""
    paths = list(group["paths"])[:MAX_TILES]
    rows = (len(paths) + COLUMNS - 1) // COLUMNS
    width = COLUMNS * TILE
    sheet = Image.new("RGB", (width, 24 + rows * (TILE + CAPTION)), "white")
    draw = ImageDraw.Draw(sheet)
    shown = f" (first {len(paths)})" if len(group["paths"]) > len(paths) else ""
    draw.text(
        (4, 6),
        f"{len(group['paths'])} images{shown}, classes {', '.join(group['labels'])}, "
        f"split {group['split']}",
        fill="black",
    )
    for k, path in enumerate(paths):
        left, top = (k % COLUMNS) * TILE, 24 + (k // COLUMNS) * (TILE + CAPTION)
        sheet.paste(_tile(source_dir / path), (left, top))
        caption = textwrap.wrap(f"{labels.get(path, '?')}: {Path(path).name}", 15)[:2]
        draw.multiline_text((left + 2, top + TILE + 1), "\n".join(caption), fill="black")
    source = PngInfo()
    for key, value in sheet_text(hashes[p] for p in group["paths"] if p in hashes).items():
        source.add_text(key, value)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out, pnginfo=source)
    return out


def _tile(path: Path) -> Image.Image:
    """The image at ``path`` fitted into a tile (grey when it cannot be read)."""
    try:
        with Image.open(path) as image:
            image.draft("RGB", (TILE, TILE))
            fitted = ImageOps.pad(image.convert("RGB"), (TILE - 4, TILE - 4), color="white")
    except (OSError, ValueError, Image.DecompressionBombError):
        fitted = Image.new("RGB", (TILE - 4, TILE - 4), "lightgrey")
    tile = Image.new("RGB", (TILE, TILE), "white")
    tile.paste(fitted, (2, 2))
    return tile
