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


def encoded(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def pgm16(samples: np.ndarray) -> bytes:
    """A 16-bit binary PGM (Pillow opens it in mode ``I``)."""
    height, width = samples.shape
    return f"P5\n{width} {height}\n65535\n".encode() + samples.astype(">u2").tobytes()


def grey(data: bytes) -> np.ndarray:
    return np.asarray(decode_rgb(data, max_pixels=10**6, min_side=1))[..., 0]


def test_integer_samples_scale_from_the_range_the_format_declares() -> None:
    """A dark 16-bit image stays dark, and a sample's grey never depends on the others."""
    dark = np.full((8, 8), 200, np.uint16)
    with_a_bright_pixel = dark.copy()
    with_a_bright_pixel[0, 0] = 65535
    for samples in (dark, with_a_bright_pixel):
        assert grey(pgm16(samples))[4, 4] == 1  # 200 / 65535 of white, as 8 bits
        assert grey(encoded(Image.fromarray(samples), "PNG"))[4, 4] == 1
    signed = np.array([[0, -5], [2**31 - 1, 2**30]], np.int32).repeat(4, 0).repeat(4, 1)
    tiff = grey(encoded(Image.fromarray(signed), "TIFF"))  # 32-bit signed: mode I
    assert (tiff[0, 0], tiff[0, 4], tiff[4, 0], tiff[4, 4]) == (0, 0, 255, 128)


def test_a_colour_key_is_transparent_like_alpha_and_a_palette() -> None:
    """The same picture with its right half transparent: every way of saying so composites
    those pixels over black."""
    rgb = Image.new("RGB", (16, 8), (40, 90, 160))
    rgb.paste((255, 255, 255), (8, 0, 16, 8))
    alpha = rgb.convert("RGBA")
    alpha.putalpha(
        Image.fromarray(np.where(np.asarray(rgb)[..., 0] == 255, 0, 255).astype(np.uint8))
    )
    palette = Image.fromarray((np.asarray(rgb)[..., 0] == 255).astype(np.uint8), mode="P")
    palette.putpalette([40, 90, 160, 255, 255, 255])
    ways = {
        "alpha": encoded(alpha, "PNG"),
        "palette": encoded(palette, "PNG", transparency=1),
        "rgb key": encoded(rgb, "PNG", transparency=(255, 255, 255)),
        "grey key": encoded(rgb.convert("L"), "PNG", transparency=255),
    }
    for way, data in ways.items():
        pixels = np.asarray(decode_rgb(data, max_pixels=10**6, min_side=1))
        assert pixels[:, 8:].max() == 0, way
        assert pixels[:, :8].min() > 0, way


def test_a_float_image_keeps_its_range_around_nan_and_infinity() -> None:
    ramp = np.tile(np.linspace(0.0, 1.0, 6, dtype=np.float32), (4, 1))
    clean = grey(encoded(Image.fromarray(ramp, mode="F"), "TIFF"))
    spoiled = ramp.copy()
    spoiled[0, 2], spoiled[1, 3] = np.nan, np.inf
    pixels = grey(encoded(Image.fromarray(spoiled, mode="F"), "TIFF"))
    assert list(clean[2]) == [0, 51, 102, 153, 204, 255]
    assert (pixels[2:] == clean[2:]).all()  # one NaN no longer blacks out the image
    assert (pixels[0, 2], pixels[1, 3]) == (0, 255)  # NaN is black, +inf the top


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "TIFF", "WEBP"])
def test_verify_reports_the_size_the_decoded_image_has(fmt: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: a 60x40 image is 40x60 once oriented
    data = encoded(Image.new("RGB", (60, 40), (10, 20, 30)), fmt, exif=exif)
    _, width, height = verify(data, max_pixels=10**6, min_side=1, draft=False)
    assert (width, height) == decode_rgb(data, max_pixels=10**6, min_side=1).size == (40, 60)
