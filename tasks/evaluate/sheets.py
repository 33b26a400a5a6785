"""Contact sheets: a grid of shard images with a title each, saved as a PNG.

Evaluation's misclassified test images and the label review's suspect records are both
drawn here, so the sheets look alike and are drawn one way. Each image has one title block
above it, wrapped to the image's width and cut at :data:`TITLE_LINES` lines, and the grid
leaves every row room for that block: no title runs into a neighbour's, however long the
file names (a title set in one long line overlapped the next column's).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLUMNS = 4
TILE_INCHES = 2.4  # an image's side on the sheet
TITLE_POINTS = 8
# characters a title line holds across one image at TITLE_POINTS (DejaVu Sans averages
# about 0.6 em a character: 28 x 4.8 pt fits 2.4 in = 173 pt with room to spare)
TITLE_CHARS = 28
TITLE_LINES = 4
LINE_INCHES = TITLE_POINTS * 1.25 / 72
GAP_INCHES = 0.25  # between the blocks, across and down


def title_block(title: str) -> str:
    """``title`` wrapped to an image's width, at most :data:`TITLE_LINES` lines: the longest
    of its own lines (what, and where) gives up wrapped lines first, so a long class name never
    pushes the file name off; a part cut short ends in an ellipsis."""
    parts = [
        textwrap.wrap(part, TITLE_CHARS, break_long_words=True) or [""]
        for part in title.split("\n")[:TITLE_LINES]
    ]
    room = [len(part) for part in parts]
    while sum(room) > TITLE_LINES:
        room[room.index(max(room))] -= 1
    lines = []
    for part, kept in zip(parts, room, strict=True):
        if kept < len(part):
            part = [*part[: kept - 1], part[kept - 1][: TITLE_CHARS - 1] + "\u2026"]
        lines += part
    return "\n".join(lines)


def image_sheet(tiles: Sequence[tuple[np.ndarray, str]], empty_note: str) -> Figure:
    """The sheet of ``tiles`` (pixels, title), :data:`COLUMNS` to a row, each title a block
    above its image; ``empty_note`` in the first cell when there is none."""
    from matplotlib.figure import Figure

    rows = max(1, -(-len(tiles) // COLUMNS))
    title_inches = TITLE_LINES * LINE_INCHES
    width = COLUMNS * (TILE_INCHES + GAP_INCHES)
    height = rows * (TILE_INCHES + title_inches + GAP_INCHES) + GAP_INCHES
    figure = Figure(figsize=(width, height))
    grid = figure.add_gridspec(
        rows,
        COLUMNS,
        # as fractions of an image: room for the title block and a gap above it
        hspace=(title_inches + GAP_INCHES) / TILE_INCHES,
        wspace=GAP_INCHES / TILE_INCHES,
        left=0.5 * GAP_INCHES / width,
        right=1 - 0.5 * GAP_INCHES / width,
        top=1 - (title_inches + 0.5 * GAP_INCHES) / height,
        bottom=0.5 * GAP_INCHES / height,
    )
    axes = [
        figure.add_subplot(grid[row, column]) for row in range(rows) for column in range(COLUMNS)
    ]
    for axis in axes:
        axis.axis("off")
    if not tiles:
        axes[0].text(0.5, 0.5, title_block(empty_note), ha="center", va="center")
    for axis, (image, title) in zip(axes, tiles, strict=False):
        axis.imshow(image)
        axis.set_title(title_block(title), fontsize=TITLE_POINTS, loc="center")
    return figure


def plot_image_sheet(tiles: Sequence[tuple[np.ndarray, str]], empty_note: str, path: Path) -> None:
    """Draw ``tiles`` (pixels, title) into ``path`` (:func:`image_sheet`)."""
    image_sheet(tiles, empty_note).savefig(path, dpi=80)
