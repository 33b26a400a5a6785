"""Flagged near-duplicate groups: reported with why, a sheet of their images and what to do."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image

from bench.near_duplicates import sample_photo
from flows.cli.run_summary import flagged_lines
from tasks.contracts.content import file_sha256
from tasks.contracts.sheet_source import sheet_images
from tasks.ingest.group_sheets import COLUMNS, TILE
from tasks.ingest.stage import run_ingest
from tasks.runtime.params import default_params


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_a_group_spanning_classes_is_flagged_with_a_sheet_and_what_to_do(tmp_path: Path) -> None:
    clock = sample_photo("clock").resize((192, 128))
    write(tmp_path / "src" / "cup" / "clock.jpg", jpeg(clock, 95))
    write(tmp_path / "src" / "plate" / "clock_small.jpg", jpeg(clock.resize((150, 100))))
    for name in ("coffee", "rocket", "camera"):
        write(
            tmp_path / "src" / "other" / f"{name}.jpg", jpeg(sample_photo(name).resize((192, 128)))
        )
    params = default_params(ingest={"source_dir": str(tmp_path / "src"), "workers": 1})
    sheets = tmp_path / "sheets"

    report = run_ingest(
        params.ingest, tmp_path / "index.json", tmp_path / "ingest.json", sheets=sheets
    )

    (flagged,) = report["near_duplicates"]["flagged"]
    assert flagged["paths"] == ["cup/clock.jpg", "plate/clock_small.jpg"]
    assert flagged["why"] == "spans 2 classes (cup, plate)"
    assert flagged["sheet"] == str(sheets / "near-duplicate-group-1.png")
    assert "label error" in flagged["inspect"] and "near_duplicate_distance" in flagged["inspect"]
    with Image.open(flagged["sheet"]) as sheet:
        assert sheet.width == COLUMNS * TILE and sheet.height > TILE  # one row of tiles
        tile = sheet.crop((2, 24 + 2, TILE - 2, 24 + TILE - 2)).convert("L")
        assert max(tile.getextrema()) - min(tile.getextrema()) > 50  # the photo, not a blank
    # the sheet names its group's images by content, for `shardflow forget` to find it
    shown = {file_sha256(tmp_path / "src" / path) for path in flagged["paths"]}
    assert sheet_images(Path(flagged["sheet"])) == shown
    (line,) = flagged_lines(json.loads((tmp_path / "ingest.json").read_text()))
    assert "2 images spans 2 classes" in line and "near-duplicate-group-1.png" in line


def test_a_set_without_flagged_groups_writes_no_flagged_key(tmp_path: Path) -> None:
    for name in ("coffee", "rocket"):
        write(tmp_path / "src" / "a" / f"{name}.jpg", jpeg(sample_photo(name).resize((96, 64))))
    params = default_params(ingest={"source_dir": str(tmp_path / "src"), "workers": 1})

    run_ingest(
        params.ingest, tmp_path / "index.json", tmp_path / "ingest.json", sheets=tmp_path / "s"
    )

    assert "flagged" not in json.loads((tmp_path / "ingest.json").read_text())["near_duplicates"]
    assert not (tmp_path / "s").exists()
