"""The built-in demo dataset: learnable shapes in mixed formats, with a few broken files.

Generated deterministically from a seed so every machine gets the same bytes. Six classes of
drawn shapes on noisy, coloured backgrounds at varied sizes; JPEG and PNG (some grayscale,
palette, RGBA or 16-bit, some with an extension that lies about the format, a few with an
EXIF rotation), plus deliberately broken files so a first run shows the quarantine at work.
"""

from __future__ import annotations

import argparse
import io
import shutil
import struct
import zlib
from pathlib import Path

import imagehash
import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "cross", "square", "stripes", "triangle", "ring")
# Every drawing's perceptual hash is more bits than this from every other's: well above
# ingest.near_duplicate_distance, with room for what encoding moves a hash (a few bits),
# so the demo has no near-duplicates and every image is placed on its own.
DISTINCT_BITS = 16


def draw_shape(rng: np.random.Generator, shape: str, size: tuple[int, int]) -> Image.Image:
    """One RGB image of ``shape`` at ``size`` (width, height) with random colours and noise."""
    width, height = size
    background = tuple(int(v) for v in rng.integers(0, 256, 3))
    foreground = tuple(int((b + rng.integers(96, 160)) % 256) for b in background)
    image = Image.fromarray(shaded_background(rng, background, width, height), mode="RGB")
    draw = ImageDraw.Draw(image)
    side = min(width, height)
    r = side * rng.uniform(0.22, 0.38)
    cx = width / 2 + rng.uniform(-0.12, 0.12) * width
    cy = height / 2 + rng.uniform(-0.12, 0.12) * height
    line = max(2, int(side * 0.08))
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=foreground)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=foreground, width=line)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=foreground)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=foreground)
    elif shape == "cross":
        draw.rectangle([cx - r, cy - line, cx + r, cy + line], fill=foreground)
        draw.rectangle([cx - line, cy - r, cx + line, cy + r], fill=foreground)
    elif shape == "stripes":
        step = max(4, int(side * rng.uniform(0.1, 0.18)))
        for x in range(0, width, 2 * step):
            draw.rectangle([x, 0, x + step - 1, height], fill=foreground)
    else:
        raise ValueError(f"unknown demo shape {shape!r}")
    pixels = np.asarray(image, dtype=np.int16)
    noise = rng.normal(0, 10, pixels.shape).astype(np.int16)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8), mode="RGB")


def shaded_background(
    rng: np.random.Generator, colour: tuple[int, ...], width: int, height: int
) -> np.ndarray:
    """A background of ``colour`` under random soft light (a few low-frequency waves).

    Without it every drawing is a centred blob on a flat ground, and perceptual hashes (which
    keep only an image's coarsest structure) make most of a class near-duplicates of each
    other, so near-duplicate placement would put whole classes in one split. The light
    gives each drawing a coarse structure of its own; the shape stays on top, as sharp.
    """
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    light = np.zeros((height, width), np.float32)
    for _ in range(4):
        fx, fy = rng.uniform(0.3, 2.0, 2) * rng.choice([-1, 1], 2)
        phase = rng.uniform(0, 2 * np.pi)
        light += np.cos(2 * np.pi * (fx * x / width + fy * y / height) + phase)
    shaded = np.asarray(colour, np.float32) + 40 * light[..., None]
    return np.clip(shaded, 0, 255).astype(np.uint8)


def _encode(rng: np.random.Generator, image: Image.Image, index: int) -> tuple[bytes, str]:
    """Encode in a varied format; returns (bytes, extension). Extensions sometimes lie."""
    buffer = io.BytesIO()
    kind = index % 20
    if kind < 12:
        image.save(buffer, format="JPEG", quality=int(rng.integers(70, 96)))
        ext = ".jpg"
    elif kind < 14:
        image.convert("L").save(buffer, format="JPEG", quality=90)  # grayscale JPEG
        ext = ".jpeg"
    elif kind < 16:
        image.save(buffer, format="PNG")
        ext = ".png"
    elif kind == 16:
        image.convert("P", palette=Image.Palette.ADAPTIVE, colors=64).save(buffer, format="PNG")
        ext = ".png"
    elif kind == 17:
        rgba = image.convert("RGBA")
        rgba.putalpha(255)
        rgba.save(buffer, format="PNG")
        ext = ".png"
    elif kind == 18:
        gray16 = (np.asarray(image.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
        Image.fromarray(gray16).save(buffer, format="PNG")  # 16-bit grayscale PNG
        ext = ".png"
    else:
        image.save(buffer, format="PNG")
        ext = ".jpg"  # a PNG named .jpg: the format must come from the bytes
    return buffer.getvalue(), ext


def _exif_rotated_jpeg(image: Image.Image) -> bytes:
    """A JPEG stored rotated with EXIF orientation 6, which displays as ``image``."""
    stored = image.transpose(Image.Transpose.ROTATE_90)  # undone by orientation 6 (270 CW)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", quality=90, exif=exif.tobytes())
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims absurd dimensions (a decompression-bomb shape)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def generate(
    out_dir: Path,
    *,
    per_class: int = 500,
    seed: int = 7,
    broken: bool = True,
    classes: tuple[str, ...] = CLASSES,
    min_size: int = 40,
    max_size: int = 160,
) -> int:
    """Write the demo dataset into ``out_dir`` (replacing it); returns the number of files."""
    # Build beside the target and rename at the end: a killed run leaves no half dataset.
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    rng = np.random.default_rng(seed)
    count = 0
    drawn = Distinct()
    for shape in classes:
        class_dir = staging / shape
        class_dir.mkdir(parents=True)
        for i in range(per_class):
            image = _draw_any_size(rng, shape, min_size, max_size)
            while not drawn.add(image):  # a near-duplicate of an earlier drawing: redraw
                image = _draw_any_size(rng, shape, min_size, max_size)
            if i % 97 == 5:
                data, ext = _exif_rotated_jpeg(image), ".jpg"
            else:
                data, ext = _encode(rng, image, i)
            (class_dir / f"{shape}_{i:05d}{ext}").write_bytes(data)
            count += 1
    if broken:
        count += _write_broken(staging, classes, rng)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return count


def _draw_any_size(
    rng: np.random.Generator, shape: str, min_size: int, max_size: int
) -> Image.Image:
    size = (int(rng.integers(min_size, max_size + 1)), int(rng.integers(min_size, max_size + 1)))
    return draw_shape(rng, shape, size)


class Distinct:
    """The perceptual hashes of the drawings kept so far (see DISTINCT_BITS)."""

    def __init__(self) -> None:
        self.hashes = np.empty(0, dtype=np.uint64)

    def add(self, image: Image.Image) -> bool:
        """Keep ``image`` unless it is a near-duplicate of a kept drawing; whether it was."""
        value = np.uint64(int(str(imagehash.phash(image)), 16))
        if (np.bitwise_count(self.hashes ^ value) <= DISTINCT_BITS).any():
            return False
        self.hashes = np.append(self.hashes, value)
        return True


def _write_broken(out_dir: Path, classes: tuple[str, ...], rng: np.random.Generator) -> int:
    """One file per quarantine reason, plus duplicates (agreeing and conflicting labels)."""
    first, second = out_dir / classes[0], out_dir / classes[1]
    good = io.BytesIO()
    draw_shape(rng, classes[0], (96, 96)).save(good, format="JPEG", quality=90)
    data = good.getvalue()
    (first / "broken_truncated.jpg").write_bytes(data[: len(data) // 2])
    (first / "broken_empty.jpg").write_bytes(b"")
    (first / "broken_not_an_image.png").write_bytes(b"this is a text file, not a picture\n")
    (second / "broken_absurd_dimensions.png").write_bytes(_png_header_only(200_000, 200_000))
    (second / "broken_tiny.png").write_bytes(_png_bytes(np.zeros((2, 2, 3), np.uint8)))
    sample = sorted(first.glob(f"{classes[0]}_*"))[0]
    (first / "copy_of_first.jpg").write_bytes(sample.read_bytes())  # same label: duplicate
    conflict = sorted(first.glob(f"{classes[0]}_*"))[1]
    (second / "conflicting_label.jpg").write_bytes(conflict.read_bytes())  # other label
    return 7


def _png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--per-class", type=int, default=500)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--if-missing", action="store_true", help="do nothing if out_dir exists")
    parser.add_argument(
        "--if-source",
        metavar="PARAMS",
        help="do nothing unless ingest.source_dir in this params file names out_dir",
    )
    args = parser.parse_args(argv)
    if args.if_missing and args.out_dir.exists():
        return
    if args.if_source and not names_folder(Path(args.if_source), args.out_dir):
        return
    print(f"generating the demo dataset into {args.out_dir} ...", flush=True)
    n = generate(args.out_dir, per_class=args.per_class, seed=args.seed)
    print(f"wrote {n} files to {args.out_dir}")


def names_folder(params_path: Path, folder: Path) -> bool:
    """Whether ``ingest.source_dir`` in ``params_path`` is ``folder`` (as the dataset's
    identity names them: relative to the current directory, the repository root)."""
    from tasks.runtime.dataset_identity import dataset_identity
    from tasks.runtime.params import load_params

    source = load_params(params_path).ingest.source_dir
    return dataset_identity(source, None) == dataset_identity(str(folder), None)


if __name__ == "__main__":
    main()
