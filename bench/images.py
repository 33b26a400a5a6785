"""A deterministic image set for benchmarking: class sub-folders of drawn-shape JPEGs.

Each image is drawn from its own seeded generator (``seed``, index), so the bytes do not
depend on how the work is split across processes. Generation runs in spawned processes and
is skipped when the folder already holds the same set (a marker file records the recipe).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from tasks.ingest.demo_data import shaded_background

CLASSES = ("circle", "cross", "ring", "square", "triangle")
MARKER = ".bench-images.json"
JPEG_QUALITY = 90


def draw_image(index: int, *, seed: int, min_size: int, max_size: int) -> tuple[str, bytes]:
    """(class name, JPEG bytes) of image ``index``: a noisy shape at a random size."""
    rng = np.random.default_rng([seed, index])
    shape = CLASSES[index % len(CLASSES)]
    width, height = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
    background = tuple(int(v) for v in rng.integers(0, 256, 3))
    foreground = tuple(int((b + 128) % 256) for b in background)
    # Under soft light of its own (as the demo's drawings): on a flat ground every drawing of
    # a class is a near-duplicate of the others by perceptual hash, and near-duplicate
    # placement would put nearly every bench image in a few groups (one split).
    image = Image.fromarray(shaded_background(rng, background, width, height), mode="RGB")
    draw = ImageDraw.Draw(image)
    side = min(width, height)
    r = side * rng.uniform(0.2, 0.38)
    cx, cy = width * rng.uniform(0.4, 0.6), height * rng.uniform(0.4, 0.6)
    line = max(2, int(side * 0.08))
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=foreground)
    elif shape == "ring":
        draw.ellipse(box, outline=foreground, width=line)
    elif shape == "square":
        draw.rectangle(box, fill=foreground)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=foreground)
    else:  # cross
        draw.rectangle([cx - r, cy - line, cx + r, cy + line], fill=foreground)
        draw.rectangle([cx - line, cy - r, cx + line, cy + r], fill=foreground)
    # Mild noise so JPEG sizes look like photos' rather than flat drawings'.
    pixels = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
        buffer, format="JPEG", quality=JPEG_QUALITY
    )
    return shape, buffer.getvalue()


def image_name(shape: str, index: int) -> str:
    return f"{shape}/{shape}_{index:06d}.jpg"


def _write_range(
    out_dir: str, start: int, stop: int, seed: int, min_size: int, max_size: int
) -> int:
    for index in range(start, stop):
        shape, data = draw_image(index, seed=seed, min_size=min_size, max_size=max_size)
        (Path(out_dir) / image_name(shape, index)).write_bytes(data)
    return stop - start


def generate_images(
    out_dir: Path,
    n: int,
    *,
    min_size: int = 200,
    max_size: int = 400,
    seed: int = 0,
    workers: int = 2,
    chunk: int = 500,
) -> Path:
    """Write ``n`` JPEGs into ``out_dir/<class>/``; reuse the folder if it already matches."""
    recipe = {
        "n": n,
        "min_size": min_size,
        "max_size": max_size,
        "seed": seed,
        "quality": JPEG_QUALITY,
        "classes": list(CLASSES),
        "version": 2,  # 2: drawings under soft light (few near-duplicates)
    }
    marker = out_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    for shape in CLASSES:
        (out_dir / shape).mkdir(parents=True, exist_ok=True)
    ranges = [(i, min(i + chunk, n)) for i in range(0, n, chunk)]
    args = (str(out_dir), seed, min_size, max_size)
    if workers <= 1 or len(ranges) < 2:
        for start, stop in ranges:
            _write_range(args[0], start, stop, *args[1:])
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            for future in [pool.submit(_write_range, args[0], a, b, *args[1:]) for a, b in ranges]:
                future.result()
    marker.write_text(json.dumps(recipe))  # last: a killed run is regenerated next time
    return out_dir


def list_images(source_dir: Path) -> list[tuple[Path, int]]:
    """(path, label index) of every JPEG, classes in sorted order (as Keras and ingest do)."""
    classes = sorted(
        p.name for p in source_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
    )
    return [
        (path, label)
        for label, name in enumerate(classes)
        for path in sorted((source_dir / name).glob("*.jpg"))
    ]
