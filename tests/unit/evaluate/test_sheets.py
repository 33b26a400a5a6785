"""Contact sheets are readable: one title block per image, none overlapping another's or an
image, whatever the titles hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.evaluate.sheets import TITLE_LINES, image_sheet, plot_image_sheet, title_block

LONG_NAME = "flag_of_the_united_kingdom_of_great_britain_and_northern_ireland_v2.png"


def digit_tiles(count: int) -> list[tuple[np.ndarray, str]]:
    """Real scans (scikit-learn's digits) titled as the label review titles them, with long
    file names and class names."""
    from sklearn.datasets import load_digits

    images = load_digits().images[:count]
    return [
        (
            np.repeat((image * 15).astype(np.uint8)[..., None], 3, axis=2),
            f"likely label error: saint_vincent_and_the_grenadines -> "
            f"united_states_minor_outlying_islands (0.97)\nval: {n}_{LONG_NAME}",
        )
        for n, image in enumerate(images)
    ]


def overlaps(a: object, b: object) -> bool:
    return bool(a.overlaps(b))  # type: ignore[attr-defined]


@pytest.mark.parametrize("count", [1, 6, 16])
def test_each_image_has_one_title_block_and_none_overlap(count: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = image_sheet(digit_tiles(count), "none")
    renderer = FigureCanvasAgg(figure).get_renderer()
    shown = [axis for axis in figure.axes if axis.images]
    assert len(shown) == count
    titles = [axis.title.get_window_extent(renderer) for axis in shown]
    images = [axis.get_window_extent(renderer) for axis in shown]
    page = figure.bbox
    for n, title in enumerate(titles):
        assert len(shown[n].texts) == 0 and shown[n].title.get_text()  # one block: the title
        assert title.x0 >= page.x0 and title.x1 <= page.x1 and title.y1 <= page.y1
        assert not any(overlaps(title, other) for m, other in enumerate(titles) if m != n)
        assert not any(overlaps(title, image) for image in images)


def test_a_title_is_wrapped_to_its_image_and_cut_at_its_lines() -> None:
    block = title_block(f"a -> b (0.50)\ntest: {LONG_NAME * 3}")
    lines = block.split("\n")
    assert lines[0] == "a -> b (0.50)" and len(lines) == TITLE_LINES
    assert lines[1].startswith("test: flag_of") and lines[-1].endswith("\u2026")
    # a long first part keeps to its share: the file name still shows
    block = title_block(f"{'saint_vincent_and_the_grenadines ' * 4}\nval: 7.png").split("\n")
    assert len(block) <= TITLE_LINES and block[-1] == "val: 7.png"
    assert title_block("short") == "short"


def test_an_empty_sheet_says_so(tmp_path: Path) -> None:
    path = tmp_path / "sheet.png"
    plot_image_sheet([], "no misclassified test images", path)
    figure = image_sheet([], "no misclassified test images")
    assert [t.get_text() for a in figure.axes for t in a.texts] == ["no misclassified test images"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
