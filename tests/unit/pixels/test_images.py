"""The one preprocessing: reduced-size JPEG decoding stays faithful, and is versioned."""

from __future__ import annotations

import io
import itertools
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from tasks import images
from tasks.images import (
    DECODED_FORMATS,
    GREY_INTEGER_MODES,
    RESIZE_POLICIES,
    ImageRejected,
    as_rgb,
    code_digest,
    decode_rgb,
    draft_for,
    finish_decode,
    float_range,
    integer_peak,
    open_checked,
    preprocess_bytes,
    resize_image,
    strip_to_8bit,
    verify,
)


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


def png16(pixels: np.ndarray) -> bytes:
    """A 16-bit PNG of HxWxC samples (C: 2 grey and alpha, 4 RGBA), which Pillow cannot write."""
    height, width, channels = pixels.shape
    rows = np.zeros((height, 1 + width * channels * 2), np.uint8)  # filter byte 0: none
    rows[:, 1:] = pixels.astype(">u2").reshape(height, -1).view(np.uint8)

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    colour = {2: 4, 4: 6}[channels]
    head = struct.pack(">IIBBBBB", width, height, 16, colour, 0, 0, 0)
    idat = zlib.compress(rows, 1)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def every_mode(width: int, height: int, seed: int) -> dict[str, bytes]:
    """Noise of this size in each mode and container the decoders give, alpha half clear."""
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    rgba[..., 3] = np.where(rng.random((height, width)) < 0.5, rgba[..., 3], 255)
    rgb = Image.fromarray(rgba[..., :3], mode="RGB")
    orientation = Image.Exif()
    orientation[0x0112] = 6
    palette = rgb.quantize(16)
    # Pillow's LAB to RGB sets up a colour transform per call, 5 ms a strip: small images only.
    lab = Image.fromarray(rgba[..., :3], mode="LAB") if width * height <= 400 else None
    return {
        "RGB png": encoded(rgb, "PNG"),
        "RGBA png": encoded(Image.fromarray(rgba, mode="RGBA"), "PNG"),
        "LA png": encoded(Image.fromarray(rgba[..., ::3], mode="LA"), "PNG"),
        "RGBA 16-bit png": png16(rgba.astype(np.uint16) * 257 + 3),
        "LA 16-bit png": png16(rgba[..., ::3].astype(np.uint16) * 251),
        "RGB keyed png": encoded(rgb, "PNG", transparency=tuple(rgba[0, 0, :3].tolist())),
        "L keyed png": encoded(rgb.convert("L"), "PNG", transparency=int(rgba[0, 0, 0] // 2)),
        "P keyed png": encoded(palette, "PNG", transparency=3),
        "16-bit grey png": encoded(Image.fromarray(rgba[..., 0].astype(np.uint16) * 199), "PNG"),
        "CMYK tiff": encoded(Image.fromarray(rgba, mode="CMYK"), "TIFF"),
        "CMYK jpeg": encoded(Image.fromarray(rgba, mode="CMYK"), "JPEG", quality=90),
        "RGBA tiff": encoded(Image.fromarray(rgba, mode="RGBA"), "TIFF"),
        "LA tiff": encoded(Image.fromarray(rgba[..., ::3], mode="LA"), "TIFF"),
        "PA tiff": encoded(palette.convert("PA"), "TIFF"),
        "YCbCr tiff": encoded(Image.fromarray(rgba[..., :3], mode="YCbCr"), "TIFF"),
        **({"LAB tiff": encoded(lab, "TIFF")} if lab else {}),
        "float tiff": encoded(Image.fromarray(rgba[..., 0].astype(np.float32) / 9), "TIFF"),
        "RGBA webp": encoded(Image.fromarray(rgba, mode="RGBA"), "WEBP", lossless=True),
        "P keyed gif": encoded(palette, "GIF", transparency=5),
        "RGB rotated jpeg": encoded(rgb, "JPEG", quality=90, exif=orientation),
        "RGBA rotated png": encoded(Image.fromarray(rgba, mode="RGBA"), "PNG", exif=orientation),
        "CMYK rotated jpeg": encoded(Image.fromarray(rgba, mode="CMYK"), "JPEG", exif=orientation),
        "L jpeg": encoded(rgb.convert("L"), "JPEG", quality=90),
    }


def whole_image_reference(
    data: bytes, size: tuple[int, int], policy: str, draft: bool
) -> np.ndarray:
    """The plain preprocessing: the whole image converted to 8-bit RGB at once (alpha,
    palette and colour keys composited over black), then ``Image.resize`` of that RGB image."""
    image = open_checked(data, max_pixels=10**9, min_side=1)
    if draft:
        draft_for(image, size, policy)
    image.load()
    peak = integer_peak(image)
    image = ImageOps.exif_transpose(image)
    if image.mode in (*GREY_INTEGER_MODES, "F"):  # the scaled modes: the samples' own rule
        rgb = as_rgb(strip_to_8bit(image, peak, float_range(image)))
    elif image.mode in ("RGBA", "LA", "PA", "P") or "transparency" in image.info:
        black = Image.new("RGBA", image.size, (0, 0, 0, 255))
        rgb = Image.alpha_composite(black, image.convert("RGBA")).convert("RGB")
    else:
        rgb = image.convert("RGB")
    assert rgb.mode == "RGB"
    return resize_image(rgb, size, policy)


@pytest.mark.parametrize(
    ("width", "height"), [(16, 12), (1, 157), (211, 1), (7, 389), (397, 5), (53, 41), (96, 131)]
)
def test_every_mode_comes_out_as_the_whole_image_converted_then_resized(
    width: int, height: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strip-by-strip conversion, within the decoded image's own buffer where it has
    room, and the resize of that buffer give the bytes of the plain whole-image way, for
    every mode, size (very tall and very wide, odd, the target's own), policy and target."""
    monkeypatch.setattr(images, "STRIP_PIXELS", 97)  # many strips, rows split at odd places
    for name, data in every_mode(width, height, seed=width * 1000 + height).items():
        drafts = (True, False) if name.endswith("jpeg") else (False,)  # only JPEG drafts
        for size, policy, draft in itertools.product(
            [(12, 16), (29, 8), (200, 150)], RESIZE_POLICIES, drafts
        ):
            expected = whole_image_reference(data, size, policy, draft)
            pixels = preprocess_bytes(data, size, policy, max_pixels=10**9, draft=draft)
            assert pixels.tobytes() == expected.tobytes(), (name, size, policy, draft)
            if not draft:  # ingest's decode, which the hand-off resizes, gives them too
                decoded = finish_decode(open_checked(data, max_pixels=10**9, min_side=1))
                assert resize_image(decoded, size, policy).tobytes() == expected.tobytes(), name


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


# -- the formats decoded, and the others refused unread -------------------------------------

EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\n"
    b"0 setgray 0 0 16 16 rectfill\nshowpage\n%%EOF\n"
)


def fits() -> bytes:
    """A 16x16 8-bit FITS image, written by hand (Pillow opens FITS; it cannot save it)."""
    cards = ["SIMPLE  = T", "BITPIX  = 8", "NAXIS   = 2", "NAXIS1  = 16", "NAXIS2  = 16", "END"]
    header = "".join(card.ljust(80) for card in cards).ljust(2880).encode()
    return header + bytes(range(256)).ljust(2880, b"\0")


def unlisted_files() -> dict[str, bytes]:
    """Files Pillow would open (it has plugins for them) in formats not on the list."""
    return {
        "EPS": EPS,
        "FITS": fits(),
        "PCX": encoded(Image.new("RGB", (16, 16), (1, 2, 3)), "PCX"),
    }


@pytest.fixture
def plugins_never_opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every unlisted plugin's ``_open`` (header parsing) records a call and fails."""
    from PIL import EpsImagePlugin, FitsImagePlugin, PcxImagePlugin

    opened: list[str] = []
    for plugin in (
        EpsImagePlugin.EpsImageFile,
        FitsImagePlugin.FitsImageFile,
        PcxImagePlugin.PcxImageFile,
    ):

        def refuse(self: Image.Image, name: str = plugin.format) -> None:
            opened.append(name)
            raise AssertionError(f"{name} plugin opened a file")

        monkeypatch.setattr(plugin, "_open", refuse)
    return opened


def test_pillow_knows_the_unlisted_formats() -> None:
    """The refusal below is a choice: Pillow on its own opens each of these files."""
    for name, data in unlisted_files().items():
        assert Image.open(io.BytesIO(data)).format == name


def test_unlisted_formats_are_refused_from_their_first_bytes(
    plugins_never_opened: list[str],
) -> None:
    for name, data in unlisted_files().items():
        with pytest.raises(ImageRejected, match=f"format {name} is not decoded"):
            verify(data, max_pixels=10**6, min_side=1, draft=False)
        with pytest.raises(ImageRejected, match=f"format {name} is not decoded"):
            preprocess_bytes(data, (8, 8), "pad", max_pixels=10**6)
    assert plugins_never_opened == []


def test_ingest_quarantines_unlisted_formats_with_the_reason(
    tmp_path: Path, plugins_never_opened: list[str]
) -> None:
    from tasks.ingest.stage import run_ingest
    from tasks.runtime.params import default_params

    source = tmp_path / "src"
    for label in ("a", "b"):
        (source / label).mkdir(parents=True)
        for i in range(3):
            color = (40 * i, 100 if label == "a" else 200, 7)
            (source / label / f"good_{i}.png").write_bytes(
                encoded(Image.new("RGB", (16, 16), color), "PNG")
            )
    for name, data in unlisted_files().items():
        (source / "a" / f"picture.{name.lower()}").write_bytes(data)
    params = default_params(ingest={"source_dir": str(source), "workers": 1}).ingest
    report = run_ingest(params, tmp_path / "index.json", tmp_path / "ingest.json")
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert report["accepted"] == 6
    for name in unlisted_files():
        assert reasons[f"a/picture.{name.lower()}"].startswith(f"format {name} is not decoded")
    assert plugins_never_opened == []


def test_a_heic_photo_is_named_and_anything_else_is_not_an_image() -> None:
    """Pillow has no HEIC plugin; phones' default format still gets a reason that names it."""
    heic = b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + b"\0" * 64
    with pytest.raises(ImageRejected, match="format HEIC is not decoded"):
        verify(heic, max_pixels=10**6, min_side=1, draft=False)
    with pytest.raises(ImageRejected, match=r"not an image \(format not recognised"):
        verify(b"plain text, no image", max_pixels=10**6, min_side=1, draft=False)


@pytest.mark.parametrize("fmt", [*DECODED_FORMATS, "MPO"])
def test_every_listed_format_decodes(fmt: str) -> None:
    """What phones, cameras and the web give: JPEG (and MPO), PNG, WebP, GIF, BMP, TIFF, PNM."""
    image = Image.new("RGB", (24, 16), (200, 100, 50))
    extra = {"save_all": True, "append_images": [image]} if fmt == "MPO" else {}
    data = encoded(image, fmt, **extra)  # a two-frame MPO, as phones write them
    assert verify(data, max_pixels=10**6, min_side=1, draft=False) == (fmt, 24, 16)
    pixels = preprocess_bytes(data, (16, 24), "stretch", max_pixels=10**6, draft=False)
    assert np.abs(pixels.astype(int) - (200, 100, 50)).max() <= 8  # lossy formats: close


# -- the preprocessing version follows code, not prose --------------------------------------


def test_comments_and_docstrings_keep_the_version_and_a_code_token_moves_it() -> None:
    """On copies of the real sources, through the hash the version uses."""
    from tasks import images, schema

    for module in (images, schema):
        source = Path(str(module.__file__)).read_text()
        digest = code_digest(source)
        prose = (
            source.replace('"""', '"""Reworded. ', 1)  # the module docstring
            .replace("\n\n\n", "\n\n\n# a new comment\n\n", 1)
            .replace("\n", "\r\n")  # and Windows line ends
        )
        assert prose != source and code_digest(prose) == digest, module.__name__
    source = Path(images.__file__).read_text()
    for old, new in [
        ("Image.Resampling.BILINEAR", "Image.Resampling.BICUBIC"),  # a name
        ("* 255.0 + 0.5", "* 255.0 + 0.49"),  # a number
        ('"pad", "crop", "stretch"', '"pad", "stretch", "crop"'),  # an order
    ]:
        assert old in source
        assert code_digest(source.replace(old, new, 1)) != code_digest(source), new


def test_a_string_that_is_data_is_code() -> None:
    """Only a string standing alone as a statement is a docstring; others are values."""
    base = 'def f():\n    """Doc."""\n    return "a"\n'
    assert code_digest(base.replace('"""Doc."""', '"""Other doc."""')) == code_digest(base)
    assert code_digest(base.replace('return "a"', 'return "b"')) != code_digest(base)


# -- decoding memory is bounded by the 8-bit RGB size ----------------------------------------

SIDE = 6000
MEASURE = """
import re, sys
import psutil
path, where = sys.argv[1], sys.argv[2]
data = open(path, "rb").read()
if where == "serving":
    from tasks.predict import ServingSpec, model_input
    from tasks.schema import RecordSchema
    spec = ServingSpec(
        record_schema=RecordSchema(224, 224, "raw").to_dict(), resize="pad", draft_decode=True,
        classes=["a", "b"], preprocessing_version="", max_pixels=10**8, min_side=1,
        max_file_bytes=2**30,
    )
    run = lambda: model_input(data, spec)
else:  # the shard worker's own function; ingest enforced the size limits
    import hashlib, os
    from tasks.schema import RecordSchema
    from tasks.shard.spec import ShardRecord, preprocess
    record = ShardRecord(os.path.basename(path), 0, hashlib.sha256(data).hexdigest())
    schema = RecordSchema(224, 224, "raw")
    run = lambda: preprocess(os.path.dirname(path), record, schema, "pad", True)
before = psutil.Process().memory_info().rss
pixels = run()
assert len(pixels if where == "shard" else pixels.tobytes()) == 224 * 224 * 3
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent (pytest).
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024 - before)
"""


@pytest.mark.parametrize(("value", "expected"), [(0.0, 0), (0.5, 128), (1.0, 255), (7.0, 255)])
def test_a_constant_float_image_reads_on_the_zero_to_one_scale(value: float, expected: int) -> None:
    """No range to stretch: 0 is black and 1 white (a constant 0.5 once came out black)."""
    flat = np.full((6, 8), value, np.float32)
    flat[0, 0] = np.nan  # NaN stays black
    pixels = grey(encoded(Image.fromarray(flat, mode="F"), "TIFF"))
    assert pixels[0, 0] == 0 and (pixels.flat[1:] == expected).all()
