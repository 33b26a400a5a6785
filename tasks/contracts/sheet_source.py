"""What a contact sheet was drawn from, written into the sheet itself (a PNG text chunk).

Pixels in a PNG cannot be found by searching bytes, so a sheet names the content hashes of
the set it was drawn from: ``shardflow forget`` reads them back (:func:`sheet_images`) and
removes every sheet of a set that held a forgotten image, and only those.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SHEET_IMAGES = "shardflow:images"  # the PNG text key: content hashes, space-separated


def sheet_text(hashes: Iterable[str]) -> dict[str, str]:
    """The PNG text chunk naming the set ``hashes`` (for ``savefig(metadata=...)``)."""
    return {SHEET_IMAGES: " ".join(sorted(set(hashes)))}


def sheet_images(path: Path) -> frozenset[str] | None:
    """The content hashes the sheet at ``path`` was drawn from; None when it names none (a
    sheet drawn before sheets carried their source, or a file that is no PNG)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            text = getattr(image, "text", {}).get(SHEET_IMAGES)
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError):
        return None
    return frozenset(str(text).split()) if text is not None else None
