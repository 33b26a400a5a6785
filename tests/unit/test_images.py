"""The one preprocessing: reduced-size JPEG decoding stays faithful, and is versioned."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tasks.images import ImageRejected, decode_rgb, preprocess_bytes, resize_image, verify


def photo(width: int, height: int, *, orientation: int | None = None) -> bytes:
    """A smooth, photo-like JPEG (gradients plus a disc), optionally with EXIF orientation."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack(
        [255 * x / width, 255 * y / height, 128 + 100 * np.sin(x / 37.0) * np.cos(y / 23.0)],
        axis=-1,
    )
    disc = (x - width * 0.3) ** 2 + (y - height * 0.6) ** 2 < (min(width, height) * 0.2) ** 2
    pixels[disc] = (250, 30, 30)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
    buffer = io.BytesIO()
    extra: dict[str, object] = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        extra["exif"] = exif
    image.save(buffer, format="JPEG", quality=92, **extra)
    return buffer.getvalue()


@pytest.mark.parametrize("policy", ["pad", "crop", "stretch"])
@pytest.mark.parametrize("orientation", [None, 6])
def test_draft_decode_stays_close_to_a_full_decode(policy: str, orientation: int | None) -> None:
    data = photo(1600, 1000, orientation=orientation)
    full = resize_image(decode_rgb(data, max_pixels=10**8, min_side=1), (48, 64), policy)
    fast = preprocess_bytes(data, (48, 64), policy, max_pixels=10**8, draft=True)
    assert fast.shape == full.shape == (48, 64, 3)
    difference = np.abs(fast.astype(np.int16) - full.astype(np.int16))
    assert difference.mean() < 2.0 and np.percentile(difference, 99) < 16


def test_draft_off_is_exactly_the_full_decode() -> None:
    data = photo(900, 700)
    full = resize_image(decode_rgb(data, max_pixels=10**8, min_side=1), (32, 32), "pad")
    exact = preprocess_bytes(data, (32, 32), "pad", max_pixels=10**8, draft=False)
    fast = preprocess_bytes(data, (32, 32), "pad", max_pixels=10**8, draft=True)
    assert np.array_equal(exact, full)
    assert not np.array_equal(fast, full)  # the draft really took another path


def test_verify_reports_the_oriented_header_size_and_catches_truncation() -> None:
    data = photo(640, 480, orientation=6)
    assert verify(data, max_pixels=10**8, min_side=1, draft=True) == ("JPEG", 480, 640)
    with pytest.raises(ImageRejected, match="truncated or corrupt JPEG data"):
        verify(data[: len(data) * 2 // 3], max_pixels=10**8, min_side=1, draft=True)


def test_crop_never_asks_for_a_box_outside_the_source() -> None:
    # Sizes whose centred box lands a float hair below zero without the clamp.
    for width, height in [(18, 47), (22, 47), (61, 47), (23, 60), (41, 37)]:
        image = Image.new("RGB", (width, height), (10, 200, 30))
        for size in [(16, 16), (13, 29), (24, 9)]:
            out = resize_image(image, size, "crop")
            assert out.shape == (*size, 3) and (out == (10, 200, 30)).all()
