"""Contact sheets: a grid of shard images with a title each, saved as a PNG.

Evaluation's misclassified test images and the label review's suspect records are both
drawn here, so the two sheets look alike and are drawn one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

COLUMNS = 4


def plot_image_sheet(tiles: Sequence[tuple[np.ndarray, str]], empty_note: str, path: Path) -> None:
    """Draw ``tiles`` (pixels, title) four to a row into ``path``; ``empty_note`` is written
    in the first cell when there is none."""
    from matplotlib.figure import Figure

    rows = max(1, -(-len(tiles) // COLUMNS))
    figure = Figure(figsize=(3 * COLUMNS, 3 * rows))
    axes = np.atleast_1d(figure.subplots(rows, COLUMNS)).ravel()
    for axis in axes:
        axis.axis("off")
    if not tiles:
        axes[0].text(0.5, 0.5, empty_note, ha="center", va="center")
    for axis, (image, title) in zip(axes, tiles, strict=False):
        axis.imshow(image)
        axis.set_title(title, fontsize=8)
    figure.savefig(path, dpi=80, bbox_inches="tight")
