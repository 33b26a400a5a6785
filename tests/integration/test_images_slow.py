"""Large images through the pixel contract: decoding memory stays bounded, big alpha and CMYK
images convert whole (seconds of decoding each; the contract's fast tests:
tests/unit/pixels/test_images.py)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.images import (
    RESIZE_POLICIES,
    preprocess_bytes,
)
from tests.unit.pixels.test_images import MEASURE, SIDE, png16, whole_image_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """6000x6000 images, 8-bit RGB and the deep, indexed, alpha and CMYK modes, cheap to
    compress."""
    folder = tmp_path_factory.mktemp("big")
    x = np.arange(SIDE, dtype=np.uint16)
    ramp = x[None, :] * 7 + x[:, None] * 3  # uint16, wrapping
    low = (ramp % 256).astype(np.uint8)
    rgba = np.dstack([low, low[::-1], low[:, ::-1], low.T])
    images = {
        "rgb8.png": Image.fromarray(rgba[..., :3], mode="RGB"),
        "grey16.png": Image.fromarray(ramp),
        "palette.png": Image.fromarray(low, mode="L").convert("P"),
        "int32.tif": Image.fromarray(low.astype(np.int32) << 23),
        "float.tif": Image.fromarray(low.astype(np.float32) / 7, mode="F"),
        "rgba8.png": Image.fromarray(rgba, mode="RGBA"),
        "la.png": Image.fromarray(rgba[..., ::3], mode="LA"),
        "cmyk.tif": Image.fromarray(rgba, mode="CMYK"),
    }
    paths = {}
    for name, image in images.items():
        paths[name] = folder / name
        options = {"compress_level": 1} if name.endswith("png") else {"compression": "tiff_deflate"}
        image.save(paths[name], **options)
    paths["rgba16.png"] = folder / "rgba16.png"  # Pillow opens it as 8-bit RGBA
    paths["rgba16.png"].write_bytes(png16(rgba.astype(np.uint16) * 257))
    return paths


def peak_bytes(path: Path, where: str) -> int:
    """Peak RSS growth of one decode to 224x224 in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), where],
        cwd=Path(__file__).parents[3],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


@pytest.mark.parametrize("where", ["shard", "serving"])
def test_decoding_memory_is_bounded_by_the_8bit_rgb_size(
    big_images: dict[str, Path], where: str
) -> None:
    """16-bit grey, RGBA (8 and 16 bits), LA and CMYK at most 1.5x an 8-bit RGB PNG of the
    same size, in both paths; palette, 32-bit integer and float too in the shard worker."""
    deep = ("palette.png", "int32.tif", "float.tif")  # the serving path's decode is the same
    names = [n for n in big_images if not (where == "serving" and n in deep)]
    # Each in its own interpreter, which measures its own peak: they may run side by side.
    with ThreadPoolExecutor(max_workers=2) as pool:
        peaks = dict(
            zip(names, pool.map(lambda n: peak_bytes(big_images[n], where), names), strict=True)
        )
    rgb = peaks.pop("rgb8.png")
    assert rgb < 4.5 * SIDE * SIDE  # the decoded RGB(X) image itself, and little else
    for name, peak in peaks.items():
        assert peak <= 1.5 * rgb, (name, peak / rgb)


def test_big_alpha_and_cmyk_images_come_out_as_the_whole_image_converted_then_resized(
    big_images: dict[str, Path],
) -> None:
    """At full size, with the module's own strips, each resize policy once."""
    names = ["rgba8.png", "la.png", "cmyk.tif", "rgba16.png"]
    for name, policy in zip(names, [*RESIZE_POLICIES, "pad"], strict=True):
        data = big_images[name].read_bytes()
        pixels = preprocess_bytes(data, (224, 224), policy, max_pixels=10**9, draft=True)
        expected = whole_image_reference(data, (224, 224), policy, True)
        assert pixels.tobytes() == expected.tobytes(), (name, policy)
