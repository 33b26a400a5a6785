"""A sheet names the set it was drawn from in its own PNG, and that name reads back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from tasks.contracts.sheet_source import sheet_images, sheet_text
from tasks.evaluate.sheets import image_sheet

A, B = "a" * 64, "b" * 64


def test_a_sheet_saved_by_pillow_or_matplotlib_reads_back_the_hashes_it_was_drawn_from(
    tmp_path: Path,
) -> None:
    info = PngInfo()
    for key, value in sheet_text([B, A, A]).items():
        info.add_text(key, value)
    Image.new("RGB", (4, 4)).save(tmp_path / "pillow.png", pnginfo=info)
    figure = image_sheet([(np.zeros((4, 4, 3), np.uint8), "x")], "none")
    figure.savefig(tmp_path / "matplotlib.png", metadata=sheet_text([A]))

    assert sheet_images(tmp_path / "pillow.png") == {A, B}
    assert sheet_images(tmp_path / "matplotlib.png") == {A}


def test_a_sheet_that_names_no_source_or_no_png_reads_as_none(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "plain.png")
    (tmp_path / "text.png").write_text(A)

    assert sheet_images(tmp_path / "plain.png") is None
    assert sheet_images(tmp_path / "text.png") is None
    assert sheet_images(tmp_path / "missing.png") is None
