"""Image bytes -> model input: the one preprocessing that shards and predictions share.

Everything that decides a record's pixels lives here: format sniffing, the size guards, the
decode, EXIF orientation, the normalisation of every PIL mode to 8-bit RGB and the resize
policy. Ingest checks files with it, the shard stage writes records with it, and prediction
turns a new photo into the model's input with it, so training and serving can never disagree
about what an image looks like.

:func:`preprocessing_version` names this code. It covers the code tokens of this module and of
the record schema (the encoder), comments, docstrings and layout left out (:func:`code_digest`);
the versions of the libraries that compute pixels (Pillow, NumPy); and the pixels a fixed set
of probe images come out as. It is part of the shard plan hash and of ``manifest.json``, so a
change to any of those reshards, and a reworded comment or docstring does not.

Only the formats in :data:`DECODED_FORMATS` are decoded; every other file is refused from its
first bytes, before any other Pillow plugin sees it.

This module must stay free of TensorFlow and of any stage code: it is imported by shard
workers and by the serving model, and ``pyproject.toml``'s import contracts check it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import math
import tokenize
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    ImageOps,
    JpegImagePlugin,
    PngImagePlugin,
    PpmImagePlugin,
    TiffImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

# The formats decoded anywhere (ingest, shard workers, serving): what phones, cameras and the
# web give. Pillow's other plugins (EPS, which runs Ghostscript; FITS, PSD, ICO and the rest)
# are never asked to open a file: Image.open tries only these, so a file in another format is
# rejected from its first bytes. JPEG covers MPO (phone photos with a depth or preview
# image); PPM covers the PNM family (PBM, PGM, PPM, PFM).
DECODED_FORMATS = tuple(
    plugin.format
    for plugin in (
        JpegImagePlugin.JpegImageFile,
        PngImagePlugin.PngImageFile,
        WebPImagePlugin.WebPImageFile,
        GifImagePlugin.GifImageFile,
        BmpImagePlugin.BmpImageFile,
        TiffImagePlugin.TiffImageFile,
        PpmImagePlugin.PpmImageFile,
    )
)
# ISO-BMFF brands of HEIC/HEIF photos (iPhones' default): named in the reason for refusing them.
HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"}
# Pixels converted at a time (a strip of rows): keeps the float64 temporaries at 2 MB each.
STRIP_PIXELS = 1 << 18

RESAMPLE = Image.Resampling.BILINEAR
RESIZE_POLICIES = ("pad", "crop", "stretch")
# EXIF orientations that swap width and height (transpose, rotate 90/270, transverse).
SWAPPING_ORIENTATIONS = {5, 6, 7, 8}
ORIENTATION_TAG = 0x0112


class ImageRejected(ValueError):
    """Image bytes that cannot be used; the message is the quarantine (or error) reason."""


def open_checked(data: bytes, *, max_pixels: int, min_side: int) -> Image.Image:
    """Open image bytes lazily (header only) and enforce the size limits before any decode.

    The format comes from the bytes, never a file name. Pillow's decompression-bomb guard
    stays on (its error, past twice ``Image.MAX_IMAGE_PIXELS``, becomes a rejection); an
    image past ``max_pixels`` or with a side under ``min_side`` is refused from its header,
    before its pixel data is touched.
    """
    if not data:
        raise ImageRejected("empty file (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=DECODED_FORMATS)
    except UnidentifiedImageError:
        raise ImageRejected(unlisted_reason(data)) from None
    except Image.DecompressionBombError as exc:
        raise ImageRejected(
            f"absurd dimensions (Pillow's decompression-bomb guard): {exc}"
        ) from None
    except Exception as exc:
        raise ImageRejected(f"truncated or corrupt header: {exc}") from None
    width, height = image.size
    if width * height > max_pixels or min(width, height) < min_side:
        raise ImageRejected(
            f"absurd dimensions {width}x{height} (limits: {min_side} px per side, "
            f"{max_pixels} px in all)"
        )
    return image


def unlisted_reason(data: bytes) -> str:
    """Why bytes no listed format opens are refused, naming the format when Pillow knows it.

    Only each plugin's signature check runs (a test of the first 16 bytes); no other
    plugin code, and no decoder, ever sees the file.
    """
    Image.init()
    prefix = data[:16]
    for name in Image.ID:
        accept = Image.OPEN[name][1] if name in Image.OPEN else None
        if name in DECODED_FORMATS or accept is None:
            continue
        try:
            known = accept(prefix)
        except Exception:  # a signature check that trips on a short prefix: not this format
            continue
        if known and not isinstance(known, str):  # a str is Pillow's "maybe" warning
            return (
                f"format {name} is not decoded (formats decoded: {', '.join(DECODED_FORMATS)}); "
                "convert the file to one of them"
            )
    if data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS:  # no Pillow plugin knows HEIC
        return (
            f"format HEIC is not decoded (formats decoded: {', '.join(DECODED_FORMATS)}); "
            "convert the file to one of them (phones can save photos as JPEG)"
        )
    return "not an image (format not recognised from its bytes)"


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) after EXIF orientation, read from the header without decoding.

    Pillow's TIFF reader reports the oriented size already (and turns the pixels as it
    loads them), so a TIFF's size is taken as it is.
    """
    width, height = image.size
    if image.format == "TIFF":
        return width, height
    try:
        orientation = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block is the decoder's problem, not the size's
        orientation = 1
    return (height, width) if orientation in SWAPPING_ORIENTATIONS else (width, height)


def decode_rgb(data: bytes, *, max_pixels: int, min_side: int) -> Image.Image:
    """Fully decode image bytes to an RGB PIL image with EXIF orientation applied.

    Raises :class:`ImageRejected` with the reason when the bytes cannot be used.
    """
    image = finish_decode(open_checked(data, max_pixels=max_pixels, min_side=min_side))
    return as_rgb(image)


def finish_decode(image: Image.Image) -> Image.Image:
    """Decode an opened image's pixels, apply EXIF orientation, normalise to 8 bits.

    The result is ``L`` for a grey source and ``RGB`` otherwise (see :func:`to_8bit`).
    """
    with decode_errors(image):
        return to_8bit(image, load_oriented(image))


def decode_for_resize(image: Image.Image) -> Image.Image | RgbBuffer:
    """:func:`finish_decode`'s pixels, for :func:`resize_image` only: an image Pillow stores
    in four bytes a pixel is converted within its own buffer (:func:`to_8bit_in_place`)."""
    with decode_errors(image):
        return to_8bit_in_place(image, load_oriented(image))


def load_oriented(image: Image.Image) -> float:
    """Decode an opened image's pixels and apply EXIF orientation; returns its
    :func:`integer_peak`, read from the file's header before the transpose."""
    image.load()
    peak = integer_peak(image)
    # In place: without an orientation to apply, exif_transpose would return a full copy.
    ImageOps.exif_transpose(image, in_place=True)
    return peak


@contextmanager
def decode_errors(image: Image.Image) -> Iterator[None]:
    """Any failure to decode or convert ``image`` as the :class:`ImageRejected` reason."""
    try:
        yield
    except Exception as exc:
        raise ImageRejected(f"truncated or corrupt {image.format} data: {exc}") from None


def verify(data: bytes, *, max_pixels: int, min_side: int, draft: bool) -> tuple[str, int, int]:
    """Ingest's check: (format, width, height after EXIF orientation) of usable image bytes.

    Every byte of the image data is decoded, so truncated or corrupt files are caught. With
    ``draft`` a JPEG is decoded at 1/8 scale (libjpeg's DCT scaling still parses the whole
    entropy-coded stream, at a fraction of a full decode's cost); the size comes from the
    header either way.
    """
    image = open_checked(data, max_pixels=max_pixels, min_side=min_side)
    fmt, (width, height) = str(image.format), oriented_size(image)
    if draft and image.format == "JPEG":
        image.draft(None, (max(1, image.width // 8), max(1, image.height // 8)))
    finish_decode(image)
    return fmt, width, height


def draft_for(image: Image.Image, size: tuple[int, int], policy: str) -> None:
    """Ask a JPEG decoder for the smallest DCT-scaled size (1/2, 1/4, 1/8) that still covers
    what ``policy`` needs at ``size`` = (height, width); a no-op for other formats.

    Reduced-size decoding replaces most of the resize by libjpeg's DCT scaling: a 12 MP photo
    decodes to 224 px several times faster than a full decode. The pixels differ slightly
    from a full decode followed by the resize (the DCT scaling is the first filter); that is
    the exactness trade-off, named by the preprocessing version and switched off by
    ``shard.draft_decode: false``. The decoder never scales below the size the resize needs,
    so the final resample still only reduces or keeps.
    """
    if image.format != "JPEG":
        return
    height, width = size
    src_w, src_h = oriented_size(image)
    if policy == "stretch":
        need_w, need_h = width, height
    else:
        scale = (min if policy == "pad" else max)(width / src_w, height / src_h)
        need_w, need_h = math.ceil(src_w * scale), math.ceil(src_h * scale)
    if (src_w, src_h) != image.size:  # EXIF orientation swaps the axes after decoding
        need_w, need_h = need_h, need_w
    image.draft(None, (max(1, need_w), max(1, need_h)))


def as_rgb(image: Image.Image) -> Image.Image:
    """An ``L`` or ``RGB`` image as RGB (grey replicated into the three channels)."""
    return image if image.mode == "RGB" else image.convert("RGB")


GREY_INTEGER_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
# Grey with alpha: composited over black, every channel is the grey's.
GREY_ALPHA_MODES = ("LA", "La")
# Modes a decoder can give that Pillow stores in four bytes a pixel, as it stores RGB:
# converted within their own buffer by to_8bit_in_place.
IN_PLACE_MODES = ("RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")


@dataclass(frozen=True)
class RgbBuffer:
    """A decoded image whose buffer holds 8-bit RGB samples, whatever its mode says: an image
    in one of :data:`IN_PLACE_MODES` after :func:`to_8bit_in_place`. Only
    :func:`resize_image` reads it."""

    image: Image.Image

    @property
    def raw_mode(self) -> str:
        """The mode whose bands the buffer's are: RGBA (R, G, B, 255) for four bands."""
        return "RGBA" if len(self.image.getbands()) == 4 else "RGB"


def to_8bit(image: Image.Image, peak: float = 65535.0) -> Image.Image:
    """Normalise any PIL mode (L, P, RGBA, CMYK, 16-bit, float) to 8-bit ``L`` or ``RGB``.

    Transparent pixels are composited over black, whether the transparency is an alpha
    channel, a palette's or a PNG colour key (``tRNS`` in an L or RGB image). Integer
    samples are scaled from ``peak``, the white their format declares
    (:func:`integer_peak`), never from the image's own values. Float images are scaled
    from their own finite range (no format declares one; :func:`float_range`); NaN is black.

    A grey source stays ``L``, grey with alpha too (composited over black, its channels are
    equal): the resize is the same per channel, so resizing first and replicating after
    gives the same pixels from a third of the memory. Other modes are converted a strip of
    rows at a time (:data:`STRIP_PIXELS`), so the temporaries stay small whatever the image's
    size and bit depth: the full-size buffers are the decoded image and the 8-bit result
    only (the decoded image alone, for the modes :func:`to_8bit_in_place` converts there).
    """
    mode = image.mode
    keyed = mode in ("1", "L", "RGB") and image.info.get("transparency") is not None
    if mode in ("L", "RGB") and not keyed:
        return image
    grey = not keyed and mode in (*GREY_INTEGER_MODES, *GREY_ALPHA_MODES, "F", "1")
    value_range = float_range(image) if mode == "F" else (0.0, 0.0)
    out = Image.new("L" if grey else "RGB", image.size)
    for top, strip in strips(image):
        out.paste(strip_to_8bit(strip, peak, value_range), (0, top))
    return out


def to_8bit_in_place(image: Image.Image, peak: float = 65535.0) -> Image.Image | RgbBuffer:
    """:func:`to_8bit`'s samples without a second full-size buffer where the image has room
    for them.

    An RGB result takes four bytes a pixel, as much again as an image in
    :data:`IN_PLACE_MODES` or a colour-keyed RGB image: each of their converted strips is
    written back into the image's own buffer instead, as RGB bytes under the image's own mode
    (an :class:`RgbBuffer`; a keyed RGB image stays a plain RGB one). Other modes go through
    :func:`to_8bit`, whose result is smaller than them (or is them).
    """
    mode = image.mode
    keyed = mode == "RGB" and image.info.get("transparency") is not None
    if mode not in IN_PLACE_MODES and not keyed:
        return to_8bit(image, peak)
    buffer = RgbBuffer(image)
    for top, strip in strips(image):
        rgb = strip_to_8bit(strip, peak, (0.0, 0.0)).convert(buffer.raw_mode)
        image.paste(Image.merge(mode, rgb.split()), (0, top))  # bands as they are
    image.info.pop("transparency", None)  # the key is applied: its pixels are black now
    return image if keyed else buffer


def strips(image: Image.Image) -> Iterator[tuple[int, Image.Image]]:
    """(top row, a copy of the rows from there) covering the image, STRIP_PIXELS each."""
    width, height = image.size
    rows = max(1, STRIP_PIXELS // max(1, width))
    for top in range(0, height, rows):
        yield top, image.crop((0, top, width, min(height, top + rows)))


def float_range(image: Image.Image) -> tuple[float, float]:
    """The (black, white) of a float image: its finite (low, high).

    Without two different finite values there is no range to stretch, and the image is read
    on the float convention's own scale, 0 black and 1 white: a constant 0.5 is mid-grey,
    not black.
    """
    low, high = math.inf, -math.inf
    for _, strip in strips(image):
        pixels = np.asarray(strip, dtype=np.float64)
        finite = pixels[np.isfinite(pixels)]
        if finite.size:
            low, high = min(low, float(finite.min())), max(high, float(finite.max()))
    return (low, high) if low < high else (0.0, 1.0)


def strip_to_8bit(image: Image.Image, peak: float, value_range: tuple[float, float]) -> Image.Image:
    """One strip of :func:`to_8bit`; ``value_range`` is the whole float image's."""
    mode = image.mode
    key = image.info.get("transparency")
    if mode in ("1", "L", "RGB") and key is not None:
        image, mode = image.convert("RGBA"), "RGBA"  # the colour key becomes alpha
    if mode in GREY_INTEGER_MODES:
        pixels = np.asarray(image, dtype=np.float64)
        gray = np.clip(pixels / peak * 255.0 + 0.5, 0, 255).astype(np.uint8)
        if isinstance(key, int):
            gray[pixels == key] = 0
        return Image.fromarray(gray, mode="L")
    if mode == "F":
        low, high = value_range
        pixels = np.asarray(image, dtype=np.float64)
        pixels = np.nan_to_num(pixels, nan=low, posinf=high, neginf=low)
        span = max(high - low, 1e-12)
        gray = np.clip((pixels - low) / span * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L")
    if mode == "1":
        return image.convert("L")
    if mode in ("P", "PA"):
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "RGBa", *GREY_ALPHA_MODES):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        composite = Image.alpha_composite(background, rgba)
        return composite.convert("L" if mode in GREY_ALPHA_MODES else "RGB")
    return image.convert("RGB")  # CMYK, YCbCr, LAB, HSV


def integer_peak(image: Image.Image) -> float:
    """The white of an integer-mode image: the largest sample its format declares.

    16-bit modes, and the 16-bit PNG and PPM/PGM samples Pillow opens as ``I`` (a PGM's
    own maximum is rescaled to 65535 as it loads), reach 65535. A TIFF declares its bits per
    sample and whether they are signed (32-bit integer TIFFs open as ``I`` too).
    """
    if image.format == "TIFF":
        tags = getattr(image, "tag_v2", {})
        bits = tags.get(258, (16,))
        bits = int(bits[0] if isinstance(bits, tuple) else bits)
        signed = tags.get(339, (1,))
        signed = int(signed[0] if isinstance(signed, tuple) else signed) == 2
        return float(2 ** (bits - 1 if signed else bits) - 1)
    return 65535.0


def resize_image(image: Image.Image | RgbBuffer, size: tuple[int, int], policy: str) -> np.ndarray:
    """Resize an ``RGB`` or ``L`` image (or an :class:`RgbBuffer`) to ``size`` = (height,
    width) under a policy; uint8 HxWx3 (grey is replicated after the resize).

    ``pad`` fits inside and letterboxes on black (centred), ``crop`` covers then
    centre-crops, ``stretch`` ignores the aspect ratio. ``BILINEAR``, antialiased when
    reducing, with ``reducing_gap=None`` (no draft/reduce shortcut), so the result does not
    depend on how the decoder was configured.
    """
    height, width = size
    src_w, src_h = (image.image if isinstance(image, RgbBuffer) else image).size
    if policy == "stretch":
        out = resample(image, (width, height))
    elif policy == "crop":
        # Resize only the centred source box with the target's aspect ratio: one resample.
        scale = max(width / src_w, height / src_h)
        box_w, box_h = width / scale, height / scale
        # Clamped: float rounding can put a centred box a hair outside the source.
        left, top = max(0.0, (src_w - box_w) / 2), max(0.0, (src_h - box_h) / 2)
        box = (left, top, min(float(src_w), left + box_w), min(float(src_h), top + box_h))
        out = resample(image, (width, height), box)
    elif policy == "pad":
        scale = min(width / src_w, height / src_h)
        new_w = min(width, max(1, round(src_w * scale)))
        new_h = min(height, max(1, round(src_h * scale)))
        fitted = resample(image, (new_w, new_h))
        out = Image.new(fitted.mode, (width, height), 0)
        out.paste(fitted, ((width - new_w) // 2, (height - new_h) // 2))
    else:
        raise ValueError(
            f"unknown resize policy {policy!r} (shard.resize: {' | '.join(RESIZE_POLICIES)})"
        )
    return np.asarray(as_rgb(out), dtype=np.uint8)


def resample(
    image: Image.Image | RgbBuffer,
    size: tuple[int, int],
    box: tuple[float, float, float, float] | None = None,
) -> Image.Image:
    """``image.resize(size, RESAMPLE, box, reducing_gap=None)``, as ``L`` or ``RGB``.

    An :class:`RgbBuffer` is resampled by Pillow's core, each byte channel on its own as an
    RGB image's are (``Image.resize`` would first copy an RGBA buffer into premultiplied
    RGBa, a second full-size buffer, and would read a CMYK one's bytes as CMYK); only the
    small result is then read as RGB.
    """
    if not isinstance(image, RgbBuffer):
        return image.resize(size, RESAMPLE, box=box, reducing_gap=None)
    buffer = image.image
    whole = (0.0, 0.0, float(buffer.width), float(buffer.height))
    box = whole if box is None else box
    if size == buffer.size and box == whole:  # what Image.resize returns: a copy
        small = buffer.copy()
    else:  # Image.resize's own last step, which Pillow has no public name for
        small = buffer._new(buffer.im.resize(size, RESAMPLE, box))
    return Image.merge(image.raw_mode, small.split()).convert("RGB")


def preprocess_bytes(
    data: bytes,
    size: tuple[int, int],
    policy: str,
    *,
    max_pixels: int,
    min_side: int = 1,
    draft: bool = True,
) -> np.ndarray:
    """Image file bytes -> the model's uint8 HxWx3 input: decode, orient, RGB, resize.

    The shard stage and prediction both call this, with the same ``draft`` (see
    :func:`draft_for`); :class:`ImageRejected` says why bytes cannot be used.
    """
    image = open_checked(data, max_pixels=max_pixels, min_side=min_side)
    if draft:
        draft_for(image, size, policy)
    return resize_image(decode_for_resize(image), size, policy)


def preprocessing_version() -> str:
    """Names the code and libraries that compute pixels: any change gives a new version.

    Three parts: the code tokens of this module and of the record schema (the encoder;
    comments and docstrings do not count, see :func:`code_digest`), the versions of Pillow
    and NumPy, and the output of the preprocessing itself on a fixed set
    of probe images (every resize policy, EXIF rotation, alpha, palette, JPEG and PNG
    sources). The probe catches what a source hash cannot: a codec library built
    differently, or a filter swapped at run time.

    Computed once per process for each (library versions, resampling filter): the probe
    took 20 ms, paid by every shard a worker wrote (6-10% of a 4 MB shard of small images).
    """
    import PIL

    return _preprocessing_version(PIL.__version__, np.__version__, RESAMPLE)


@functools.cache
def _preprocessing_version(pillow: str, numpy: str, resample: Image.Resampling) -> str:
    """The version for these libraries and this filter (which preprocess_bytes reads from
    :data:`RESAMPLE`: here it only keys the cache)."""
    from tasks import schema

    digest = hashlib.sha256(b"shardflow-preprocessing-v2")
    for source in (Path(__file__), Path(schema.__file__)):
        digest.update(code_digest(source.read_text(encoding="utf-8")))
    digest.update(f"pillow={pillow};numpy={numpy}".encode())
    for probe in _probe_images():
        for policy, draft in itertools.product(RESIZE_POLICIES, (False, True)):
            pixels = preprocess_bytes(probe, (12, 16), policy, max_pixels=1 << 20, draft=draft)
            digest.update(pixels.tobytes())
            for encoding in ("jpeg", "png"):
                encoder = schema.RecordSchema(12, 16, encoding)  # type: ignore[arg-type]
                digest.update(encoder.encode_image(pixels))
    return digest.hexdigest()[:16]


def code_digest(source: str) -> bytes:
    """A hash of Python source's code tokens: comments, docstrings and layout left out.

    Built on :mod:`tokenize`, whose tokens are the language's and stable across Python
    versions (``ast.dump`` output is not). A string that stands alone as a statement (a
    docstring) is dropped with its line; every other token counts by its type and text, so
    a changed name, number or operator gives a new digest and a reworded comment does not.
    """
    digest = hashlib.sha256()
    for token in code_tokens(source):
        digest.update(token.encode())
        digest.update(b"\0")
    return digest.digest()


def code_tokens(source: str) -> Iterator[str]:
    """The ``TYPE:text`` of each token that can change behaviour, in order."""
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
    tokens = [
        token
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in skipped
    ]
    line_starts = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.type == tokenize.STRING and (i == 0 or tokens[i - 1].type in line_starts):
            end = i
            while end < len(tokens) and tokens[end].type == tokenize.STRING:
                end += 1  # implicit concatenation: "a" "b"
            if end == len(tokens) or tokens[end].type == tokenize.NEWLINE:
                i = end + 1  # a string statement (a docstring) and its line end
                continue
        # Line ends (LF or CRLF) and indentation count by their place, not their characters.
        layout = (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)
        text = "" if token.type in layout else token.string
        yield f"{tokenize.tok_name[token.type]}:{text}"
        i += 1


def _probe_images() -> list[bytes]:
    """Small deterministic images in the formats and modes preprocessing must handle."""
    # 132x90 px: large enough that a 12x16 target decodes JPEGs at 1/4 scale under draft.
    y, x = np.mgrid[0:90, 0:132]
    rgb = (np.stack([x * 5, y * 8, x * y], axis=-1) % 256).astype(np.uint8)
    base = Image.fromarray(rgb, mode="RGB")
    probes = []
    for image, fmt, extra in (
        (base, "JPEG", {"quality": 85}),
        (base, "PNG", {}),
        (base.convert("RGBA"), "PNG", {}),
        (base.convert("P"), "PNG", {}),
        (base.convert("L"), "JPEG", {"quality": 85}),
        (base, "PNG", {"transparency": (0, 0, 0)}),  # a colour key: tRNS in an RGB PNG
        (Image.fromarray(rgb[..., 0].astype(np.uint16) * 257), "PNG", {}),  # 16-bit grey
    ):
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **extra)
        probes.append(buffer.getvalue())
    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = 6
    base.save(rotated, format="JPEG", quality=85, exif=exif)
    probes.append(rotated.getvalue())
    return probes
