"""Near-duplicates: the relation on real images, the distance, the search and placement.

``python -m bench --only near_duplicates`` measures four things:

- ``confirmation``: the second check (:func:`tasks.contracts.near_duplicates.is_near`) on
  images that ship with installed packages, through ingest's own check (nothing
  downloaded, nothing written): scikit-learn's digits (8x8 scans: every scan of one digit
  shares a layout), non-overlapping tiles of its two sample photos (skies and walls are
  flat), scikit-image's sample photos, and letters drawn in every font Matplotlib bundles
  in three colour schemes (one letter in two fonts differs by a few stroke pixels on a
  flat background). The share of planted copies (resized, re-encoded, cropped, re-saved
  with and without alpha) it finds near, and the share of distinct pairs whose hashes are
  candidates that it confirms.
- ``placement_memory``: peak RSS of placing 50,000 and 1,000,000 images (random hashes and
  thumbnails, a tenth of them copies) by the confirmed, class-share rule and by the
  hash-only rule it replaced, on the same items, in fresh interpreters: their ratio.

- ``threshold``: perceptual-hash distances (bits of 64), through ingest's own check
  (:func:`tasks.ingest.inspection.check_image`, JPEGs at its 1/8 draft decode), on scikit-image's
  sample
  photos (shipped with the package, offline). Light edits of a photo (resized to 1/2 and 3/4,
  re-encoded as JPEG at quality 30 and 50 and as PNG, cropped by 2% a side or 3% off one
  side) must group with it; crops of other parts of it (its halves, stretched back to full
  size) and the other photos must not. ``ingest.near_duplicate_distance`` must lie between
  the largest light-edit distance and the smallest of the others;
  ``tests/unit/contracts/test_near_duplicates.py`` asserts that the default does.
- ``search``: placing 50,000 hashes (multi-index neighbour search, groups, splits) in a fresh
  interpreter: wall time of the search and of the placement, and peak RSS. The hashes are
  the phashes of 50,000 crops of the 15 sample photos (random position, scale, flip), a
  tenth of them with a light edit of another one beside it: a pessimistic set, since crops
  of the same few photos (dark sky, flat paper) are often near-duplicates, so buckets are
  far fuller than in 50,000 distinct photos. The same search over uniformly random hashes
  (evenly filled buckets) is reported beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# Photographs among scikit-image's samples (``cat`` is ``chelsea`` again; drawings, binary
# masks and periodic textures such as ``brick`` are left out: a crop of a periodic texture
# is a near-duplicate of the texture by any measure).
PHOTOS = (
    "astronaut",
    "camera",
    "chelsea",
    "clock",
    "coffee",
    "coins",
    "grass",
    "gravel",
    "hubble_deep_field",
    "immunohistochemistry",
    "moon",
    "page",
    "retina",
    "rocket",
    "text",
)


def sample_photo(name: str) -> Image.Image:
    """One scikit-image sample photo as an RGB PIL image."""
    from skimage import data

    pixels = getattr(data, name)()
    return Image.fromarray(pixels).convert("RGB")


def _jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def light_edits(image: Image.Image) -> dict[str, bytes]:
    """Copies a user would call "the same photo": resized, re-encoded, lightly cropped."""
    w, h = image.size
    return {
        "resized_1/2": _jpeg(image.resize((w // 2, h // 2), Image.Resampling.LANCZOS)),
        "resized_3/4": _jpeg(image.resize((w * 3 // 4, h * 3 // 4), Image.Resampling.LANCZOS)),
        "jpeg_q50": _jpeg(image, 50),
        "jpeg_q30": _jpeg(image, 30),
        "png": _png(image),
        "crop_2pct_each_side": _jpeg(
            image.crop((w * 2 // 100, h * 2 // 100, w - w * 2 // 100, h - h * 2 // 100))
        ),
        "crop_3pct_left": _jpeg(image.crop((w * 3 // 100, 0, w, h))),
    }


def other_positions(image: Image.Image) -> dict[str, bytes]:
    """Crops of other parts of the photo (each half), stretched back to its size."""
    w, h = image.size
    boxes = {
        "left": (0, 0, w // 2, h),
        "right": (w // 2, 0, w, h),
        "top": (0, 0, w, h // 2),
        "bottom": (0, h // 2, w, h),
        "top_left": (0, 0, w // 2, h // 2),
        "bottom_right": (w // 2, h // 2, w, h),
    }
    return {name: _jpeg(image.crop(box).resize((w, h))) for name, box in boxes.items()}


def ingest_hash(data: bytes) -> str:
    """The hash ingest stores for these bytes (its own check and decode)."""
    from tasks.ingest.inspection import check_image

    return check_image(data, max_pixels=10**9, min_side=1, draft=True)[3]


def measure_threshold() -> dict[str, Any]:
    """Distances from each photo (as a quality-95 JPEG) to its light edits, to crops of its
    other parts, and between different photos; the summary gives each kind's extreme."""
    from tasks.contracts.near_duplicates import hamming

    light: dict[str, dict[str, int]] = {}
    other: dict[str, dict[str, int]] = {}
    originals: dict[str, str] = {}
    for name in PHOTOS:
        image = sample_photo(name)
        original = originals[name] = ingest_hash(_jpeg(image, 95))
        light[name] = {k: hamming(original, ingest_hash(v)) for k, v in light_edits(image).items()}
        parts = {k: ingest_hash(v) for k, v in other_positions(image).items()}
        distances = {f"original~{k}": hamming(original, v) for k, v in parts.items()}
        for (a, ha), (b, hb) in itertools.combinations(parts.items(), 2):
            distances[f"{a}~{b}"] = hamming(ha, hb)
        other[name] = distances
    different = {
        f"{a}~{b}": hamming(originals[a], originals[b])
        for a, b in itertools.combinations(PHOTOS, 2)
    }
    return {
        "photos": list(PHOTOS),
        "light_edits": light,
        "other_positions": other,
        "different_photos": different,
        "max_light_edit_bits": max(max(d.values()) for d in light.values()),
        "min_other_position_bits": min(min(d.values()) for d in other.values()),
        "min_different_photo_bits": min(different.values()),
    }


def crop_hashes(count: int, *, seed: int = 0) -> list[str]:
    """``count`` phashes of random crops of the sample photos, one in ten followed by a
    light edit of itself (a near-duplicate pair to find)."""
    import imagehash

    rng = np.random.default_rng(seed)
    photos = [sample_photo(name) for name in PHOTOS]
    hashes: list[str] = []
    while len(hashes) < count:
        photo = photos[int(rng.integers(len(photos)))]
        w, h = photo.size
        side = rng.uniform(0.15, 0.6)
        cw, ch = int(w * side), int(h * side)
        x, y = int(rng.integers(0, w - cw)), int(rng.integers(0, h - ch))
        crop = photo.crop((x, y, x + cw, y + ch)).resize((64, 64), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        hashes.append(str(imagehash.phash(crop)))
        if rng.random() < 0.1:
            edited = crop.resize((48, 48), Image.Resampling.LANCZOS).crop((1, 1, 47, 47))
            hashes.append(str(imagehash.phash(edited)))
    return hashes[:count]


def look_alike_hashes(count: int, seed: int = 0, base: int | None = None) -> np.ndarray:
    """``count`` hashes three bits each from one base hash, all within six bits of each
    other: a set of look-alike images (product shots on white, scans, video frames), whose
    near pairs grow with the square of its size."""
    rng = np.random.default_rng(seed)
    drawn = np.uint64(rng.integers(0, 2**63))
    centre = drawn if base is None else np.uint64(base)
    bits = np.array([rng.choice(64, 3, replace=False) for _ in range(count)], dtype=np.uint64)
    return centre ^ (np.uint64(1) << bits).sum(axis=1).astype(np.uint64)


# Glyphs drawn for the confirmation measurement: letters and digits whose shapes differ
# little between fonts, each in three colour schemes on a flat background.
GLYPHS = "AEKMRSaegx38"
GLYPH_COLOURS = (
    ((255, 255, 255), (0, 0, 0)),
    ((200, 30, 30), (255, 255, 255)),
    ((30, 30, 200), (250, 220, 0)),
)


def digit_scans(count: int) -> list[tuple[str, Image.Image]]:
    """scikit-learn's handwritten digits (8x8 scans, 16 grey levels) at 64 px: every scan of
    one digit shares its layout, so their hashes are often candidates."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return [
        (
            f"digits/{int(label)}/{k}",
            Image.fromarray((pixels * 255 / 16).astype(np.uint8)).resize(
                (64, 64), Image.Resampling.BILINEAR
            ),
        )
        for k, (pixels, label) in enumerate(zip(digits.images[:count], digits.target, strict=False))
    ]


def sample_tiles(per_photo: int) -> list[tuple[str, Image.Image]]:
    """Non-overlapping 96 px tiles of scikit-learn's two sample photos: skies, walls and
    petals are flat, so tiles of one photo often share a hash."""
    from sklearn.datasets import load_sample_images

    tiles = []
    for k, pixels in enumerate(load_sample_images().images):
        photo = Image.fromarray(pixels)
        boxes = [
            (x, y, x + 96, y + 96)
            for y in range(0, photo.height - 95, 96)
            for x in range(0, photo.width - 95, 96)
        ]
        tiles += [(f"sample{k}/{box[0]}_{box[1]}", photo.crop(box)) for box in boxes[:per_photo]]
    return tiles


def font_glyphs(letters: str = GLYPHS) -> list[tuple[str, Image.Image]]:
    """``letters`` drawn in every font Matplotlib bundles (64 px, three colour schemes):
    one letter in two fonts is two pictures of one layout."""
    import matplotlib
    from PIL import ImageDraw, ImageFont

    glyphs = []
    for font_path in sorted((Path(matplotlib.get_data_path()) / "fonts" / "ttf").glob("*.ttf")):
        font = ImageFont.truetype(str(font_path), 48)
        for letter in letters:
            for scheme, (background, ink) in enumerate(GLYPH_COLOURS):
                image = Image.new("RGB", (64, 64), background)
                ImageDraw.Draw(image).text((32, 32), letter, font=font, fill=ink, anchor="mm")
                glyphs.append((f"glyphs/{font_path.stem}/{ord(letter)}/{scheme}", image))
    return glyphs


def real_images(scale: int = 1) -> dict[str, list[tuple[str, Image.Image]]]:
    """Images that ship with installed packages, by source (nothing downloaded, nothing
    written): ``scale`` 1 is the bench's set, smaller slices are the tests'."""
    return {
        "digits": digit_scans(600 // scale),
        "sample_tiles": sample_tiles(max(4, 24 // scale)),
        "skimage_photos": [(name, sample_photo(name)) for name in PHOTOS[: max(3, 15 // scale)]],
        "glyphs": font_glyphs(GLYPHS[: max(2, len(GLYPHS) // scale)]),
    }


def planted_copies(image: Image.Image) -> dict[str, bytes]:
    """What users file twice: the picture resized, re-encoded, lightly cropped, re-saved
    with and without an alpha channel."""
    w, h = image.size
    rgb = image.convert("RGB")
    return {
        "resized_3/4": _jpeg(rgb.resize((w * 3 // 4, h * 3 // 4), Image.Resampling.LANCZOS)),
        "resized_1/2": _png(rgb.resize((w // 2, h // 2), Image.Resampling.LANCZOS)),
        "jpeg_q50": _jpeg(rgb, 50),
        "crop_2pct_each_side": _jpeg(
            rgb.crop((w * 2 // 100, h * 2 // 100, w - w * 2 // 100, h - h * 2 // 100))
        ),
        "crop_3pct_left": _png(rgb.crop((w * 3 // 100, 0, w, h))),
        "with_alpha": _png(rgb.convert("RGBA")),
        "without_alpha": _jpeg(rgb, 90),
    }


def ingest_view(data: bytes) -> tuple[int, str]:
    """The perceptual hash (as an integer) and thumbnail ingest stores for these bytes."""
    from tasks.ingest.inspection import check_image

    _, _, _, phash, thumb = check_image(data, max_pixels=10**9, min_side=1, draft=True)
    return int(phash, 16), thumb


def measure_confirmation(distance: int, scale: int = 1, copies_every: int = 10) -> dict[str, Any]:
    """Per source: how many planted-copy pairs (every ``copies_every``-th image, each of
    :func:`planted_copies`) the relation confirms, and how many hash-candidate pairs of
    distinct images (within ``distance`` bits) it confirms, through ingest's own check.
    Images whose decoded pixels equal another's are one picture, counted once."""
    from tasks.contracts.near_duplicates import is_near, thumb_values

    by_source: dict[str, dict[str, Any]] = {}
    for source, images in real_images(scale).items():
        seen: dict[str, tuple[int, str]] = {}
        for _, image in images:
            data = _png(image)
            seen.setdefault(
                hashlib.sha256(image.convert("RGB").tobytes()).hexdigest(), ingest_view(data)
            )
        views = list(seen.values())
        hashes = np.array([v[0] for v in views], dtype=np.uint64)
        thumbs = thumb_values([v[1] for v in views])
        first, second = np.triu_indices(len(views), 1)
        candidate = np.bitwise_count(hashes[first] ^ hashes[second]) <= distance
        first, second = first[candidate], second[candidate]
        distinct = is_near(hashes[first], thumbs[first], hashes[second], thumbs[second], distance)
        copy_pairs = [
            (ingest_view(_png(image)), ingest_view(data))
            for _, image in images[::copies_every]
            for data in planted_copies(image).values()
        ]
        a_hash = np.array([a[0] for a, _ in copy_pairs], dtype=np.uint64)
        b_hash = np.array([b[0] for _, b in copy_pairs], dtype=np.uint64)
        confirmed = is_near(
            a_hash,
            thumb_values([a[1] for a, _ in copy_pairs]),
            b_hash,
            thumb_values([b[1] for _, b in copy_pairs]),
            distance,
        )
        by_source[source] = {
            "images": len(views),
            "copy_pairs": len(copy_pairs),
            "copies_confirmed": int(confirmed.sum()),
            "candidate_pairs": len(first),
            "distinct_confirmed": int(distinct.sum()),
        }
    copies = sum(s["copy_pairs"] for s in by_source.values())
    candidates = sum(s["candidate_pairs"] for s in by_source.values())
    return {
        "sources": by_source,
        "copies_confirmed_share": sum(s["copies_confirmed"] for s in by_source.values()) / copies,
        "distinct_confirmed_share": (
            sum(s["distinct_confirmed"] for s in by_source.values()) / max(1, candidates)
        ),
    }


def measure_search(hashes_path: Path, distance: int) -> dict[str, Any]:
    """In this process: neighbour search and placement of the hashes in ``hashes_path``."""
    import psutil

    from tasks.contracts.near_duplicates import (
        Item,
        hash_values,
        near_components,
        near_pairs,
        place,
    )

    hashes = json.loads(hashes_path.read_text())
    thumbs = synthetic_thumbs(hashes)
    items = [
        Item(f"{i:064x}", f"c{i % 10}/{i}.jpg", f"c{i % 10}", h, t)
        for i, (h, t) in enumerate(zip(hashes, thumbs, strict=True))
    ]
    rss_before = psutil.Process().memory_info().rss
    start, cpu = time.perf_counter(), time.process_time()
    pairs = near_pairs(hash_values(hashes), distance)
    search_s, search_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    groups = near_components(hash_values(hashes), distance)
    start, cpu = time.perf_counter(), time.process_time()
    placement = place(items, {}, distance, SHARES, 1337)
    place_s, place_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    uniform = np.random.default_rng(0).integers(0, 2**64, len(hashes), dtype=np.uint64)
    start, cpu = time.perf_counter(), time.process_time()
    near_pairs(uniform, distance)
    uniform_s, uniform_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {
        "hashes": len(hashes),
        "distance": distance,
        "pairs": len(pairs),
        "groups": int(np.count_nonzero(np.bincount(groups) > 1)),
        "largest_group": int(np.bincount(groups).max()),
        # wall and CPU seconds: CPU time is what a busy machine inflates least
        "search_s": round(search_s, 3),
        "search_cpu_s": round(search_cpu_s, 3),
        "place_s": round(place_s, 3),  # search (again), groups, splits: what ingest adds
        "place_cpu_s": round(place_cpu_s, 3),
        # the same search over uniformly random hashes: evenly filled buckets
        "search_uniform_s": round(uniform_s, 3),
        "search_uniform_cpu_s": round(uniform_cpu_s, 3),
        "report_groups": len(placement.groups),
        "rss_before_search_mb": round(rss_before / 2**20, 1),
    }


SHARES = {"train": 0.8, "val": 0.1, "test": 0.1}


def synthetic_thumbs(hashes: list[str]) -> list[str]:
    """A thumbnail per hash for the timing sets: images with equal hashes get equal
    thumbnails, the others random ones (so only true copies are confirmed)."""
    from tasks.contracts.near_duplicates import THUMB_BYTES

    made: dict[str, str] = {}
    rng = np.random.default_rng(0)
    return [
        made.setdefault(h, rng.integers(0, 256, THUMB_BYTES, dtype=np.uint8).tobytes().hex())
        for h in hashes
    ]


def placement_set(count: int, seed: int = 0) -> tuple[list[Any], dict[str, float]]:
    """``count`` images in 10 classes as placement gets them (:class:`Item`: content hash,
    path, label, perceptual hash, thumbnail), a tenth of them copies of another (2 bits
    off its hash, its thumbnail): the memory of a 1M-image placement without 1M decodes."""
    from tasks.contracts.near_duplicates import THUMB_BYTES, Item

    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, count, dtype=np.uint64)
    copies = rng.choice(count, count // 10, replace=False)
    originals = rng.choice(count, count // 10)
    hashes[copies] = hashes[originals] ^ np.uint64(0b101)
    pixels = rng.integers(0, 256, (count, THUMB_BYTES), dtype=np.uint8)
    pixels[copies] = pixels[originals]
    items = [
        Item(
            f"{i:064x}", f"c{i % 10}/{i:07d}.jpg", f"c{i % 10}", f"{int(h):016x}", p.tobytes().hex()
        )
        for i, (h, p) in enumerate(zip(hashes.tolist(), pixels, strict=True))
    ]
    return items, SHARES


def measure_placement_memory(count: int, distance: int, rule: str) -> dict[str, Any]:
    """In this process: place :func:`placement_set` (``count`` images) by ``rule``:
    ``confirmed`` (ingest's :func:`~tasks.contracts.near_duplicates.place`) or ``hash-only``
    (the rule it replaced: hash candidates alone, a seeded hash split per group), on the
    same items, so that the two peak RSS figures compare the rules alone."""
    import psutil

    from tasks.contracts.near_duplicates import draw, hash_values, near_components, place

    items, shares = placement_set(count)
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if rule == "confirmed":
        splits = place(items, {}, distance, shares, 1337).splits
    else:
        ordered = sorted(items, key=lambda item: item.sha256)
        groups = near_components(hash_values([i.phash for i in ordered]), distance).tolist()
        bounds = np.cumsum(list(shares.values()))
        names = list(shares)

        def hash_split(sha: str) -> str:
            u = int.from_bytes(draw(1337, sha)[:8], "big") / 2**64
            return names[min(int(np.searchsorted(bounds, u, side="right")), len(names) - 1)]

        splits = {
            i.sha256: hash_split(ordered[g].sha256) for i, g in zip(ordered, groups, strict=True)
        }
    return {
        "images": count,
        "rule": rule,
        "place_s": round(time.perf_counter() - start, 3),
        "placed": len(splits),
        "rss_before_place_mb": round(rss_before / 2**20, 1),
    }


def measure_look_alikes(count: int, distance: int) -> dict[str, Any]:
    """In this process: ``count`` look-alike hashes (:func:`look_alike_hashes`, one group)
    placed as ingest places them, then checked as validation checks the shards' splits."""
    from tasks.contracts.near_duplicates import THUMB_BYTES, Item, place, straddling_pairs

    hashes = [f"{int(h):016x}" for h in look_alike_hashes(count)]
    same = "80" * THUMB_BYTES  # copies of one picture: every candidate is confirmed
    items = [Item(f"{i:064x}", f"c/{i}.jpg", "c", h, same) for i, h in enumerate(hashes)]
    start, cpu = time.perf_counter(), time.process_time()
    placement = place(items, {}, distance, SHARES, 1337)
    place_s, place_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    splits = [placement.splits[item.sha256] for item in items]
    start, cpu = time.perf_counter(), time.process_time()
    leaks = straddling_pairs(hashes, splits, distance, [same] * len(hashes))
    check_s, check_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {
        "hashes": count,
        "largest_group": max(len(group["paths"]) for group in placement.groups),
        "place_s": round(place_s, 3),
        "place_cpu_s": round(place_cpu_s, 3),
        "check_s": round(check_s, 3),
        "check_cpu_s": round(check_cpu_s, 3),
        "pairs_across_splits": len(leaks),
    }


def measure_near_duplicates(
    work: Path,
    *,
    count: int,
    distance: int,
    log: Any,
    placements: tuple[int, ...] = (50_000, 1_000_000),
) -> dict[str, Any]:
    """Every measurement; the search and the placements run in fresh interpreters for their
    peak RSS."""
    from bench.measured import run_measured

    confirmation = measure_confirmation(distance)
    sources = ", ".join(
        f"{name} {s['copies_confirmed']}/{s['copy_pairs']} copies, "
        f"{s['distinct_confirmed']}/{s['candidate_pairs']} distinct"
        for name, s in confirmation["sources"].items()
    )
    log(
        f"   second check: {confirmation['copies_confirmed_share']:.1%} of planted copies near, "
        f"{confirmation['distinct_confirmed_share']:.1%} of distinct hash candidates ({sources})"
    )
    memory = [measure_placement_rss(work, images, distance, log) for images in placements]
    threshold = measure_threshold()
    log(
        f"   light edits <= {threshold['max_light_edit_bits']} bits; other parts >= "
        f"{threshold['min_other_position_bits']}; other photos >= "
        f"{threshold['min_different_photo_bits']} (ingest.near_duplicate_distance: {distance})"
    )
    hashes_path = work / f"near-duplicate-hashes-{count}.json"
    if not hashes_path.exists():
        hashes_path.parent.mkdir(parents=True, exist_ok=True)
        hashes_path.write_text(json.dumps(crop_hashes(count)))
    search = run_measured(
        "bench.near_duplicates",
        ["search", str(hashes_path), str(distance)],
        work / "near-duplicates.log",
    )
    log(
        f"   {count:,} hashes: search {search['search_s']} s ({search['search_cpu_s']} s CPU), "
        f"placement {search['place_s']} s ({search['place_cpu_s']} s CPU), peak RSS "
        f"{search['peak_rss_mb']} MB ({search['rss_before_search_mb']} MB before)"
    )
    alike = run_measured(
        "bench.near_duplicates",
        ["look-alikes", str(count), str(distance)],
        work / "near-duplicates-look-alikes.log",
    )
    log(
        f"   {count:,} look-alike hashes (one group of {alike['largest_group']:,}): placement "
        f"{alike['place_s']} s, validation's check {alike['check_s']} s, peak RSS "
        f"{alike['peak_rss_mb']} MB"
    )
    return {
        "threshold": threshold,
        "search": search,
        "look_alikes": alike,
        "confirmation": confirmation,
        "placement_memory": memory,
    }


def measure_placement_rss(work: Path, images: int, distance: int, log: Any) -> dict[str, Any]:
    """Peak RSS of placing ``images`` (:func:`placement_set`) by the confirmed rule and by
    the hash-only rule it replaced, each in a fresh interpreter; their ratio."""
    from bench.measured import run_measured

    runs = {
        rule: run_measured(
            "bench.near_duplicates",
            [f"place-{rule}", str(images), str(distance)],
            work / f"near-duplicates-place-{rule}-{images}.log",
        )
        for rule in ("hash-only", "confirmed")
    }
    ratio = runs["confirmed"]["peak_rss_mb"] / runs["hash-only"]["peak_rss_mb"]
    log(
        f"   placing {images:,} images: peak RSS {runs['confirmed']['peak_rss_mb']} MB "
        f"confirmed, {runs['hash-only']['peak_rss_mb']} MB hash-only ({ratio:.2f}x); "
        f"{runs['confirmed']['place_s']} s and {runs['hash-only']['place_s']} s"
    )
    return {"images": images, **runs, "peak_rss_ratio": round(ratio, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description="the timed child of the near_duplicates bench")
    parser.add_argument(
        "job", choices=["search", "look-alikes", "place-confirmed", "place-hash-only"]
    )
    parser.add_argument("hashes", help="the hashes' JSON file (search) or their count")
    parser.add_argument("distance", type=int)
    args = parser.parse_args()
    if args.job == "search":
        print(json.dumps(measure_search(Path(args.hashes), args.distance)))
    elif args.job == "look-alikes":
        print(json.dumps(measure_look_alikes(int(args.hashes), args.distance)))
    else:
        rule = args.job.removeprefix("place-")
        print(json.dumps(measure_placement_memory(int(args.hashes), args.distance, rule)))


if __name__ == "__main__":
    main()
