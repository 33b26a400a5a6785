"""Near-duplicates: the distance that separates them on real photos, and the search at 50,000.

``python -m bench --only near_duplicates`` measures two things:

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
    from tasks.ingest.stage import assign_split
    from tasks.runtime.params import SplitFractions

    hashes = json.loads(hashes_path.read_text())
    fractions = SplitFractions(train=0.8, val=0.1, test=0.1)
    items = [Item(f"{i:064x}", f"c{i % 10}/{i}.jpg", f"c{i % 10}", h) for i, h in enumerate(hashes)]
    rss_before = psutil.Process().memory_info().rss
    start, cpu = time.perf_counter(), time.process_time()
    pairs = near_pairs(hash_values(hashes), distance)
    search_s, search_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    groups = near_components(hash_values(hashes), distance)
    start, cpu = time.perf_counter(), time.process_time()
    placement = place(items, {}, distance, lambda sha: assign_split(sha, fractions, 1337))
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


def measure_look_alikes(count: int, distance: int) -> dict[str, Any]:
    """In this process: ``count`` look-alike hashes (:func:`look_alike_hashes`, one group)
    placed as ingest places them, then checked as validation checks the shards' splits."""
    from tasks.contracts.near_duplicates import Item, place, straddling_pairs

    hashes = [f"{int(h):016x}" for h in look_alike_hashes(count)]
    items = [Item(f"{i:064x}", f"c/{i}.jpg", "c", h) for i, h in enumerate(hashes)]
    start, cpu = time.perf_counter(), time.process_time()
    placement = place(items, {}, distance, lambda sha: "train")
    place_s, place_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    splits = [placement.splits[item.sha256] for item in items]
    start, cpu = time.perf_counter(), time.process_time()
    leaks = straddling_pairs(hashes, splits, distance)
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


def measure_near_duplicates(work: Path, *, count: int, distance: int, log: Any) -> dict[str, Any]:
    """Both measurements; the search runs in a fresh interpreter for its peak RSS."""
    from bench.measured import run_measured

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
    return {"threshold": threshold, "search": search, "look_alikes": alike}


def main() -> None:
    parser = argparse.ArgumentParser(description="the timed child of the near_duplicates bench")
    parser.add_argument("job", choices=["search", "look-alikes"])
    parser.add_argument("hashes", help="the hashes' JSON file (search) or their count")
    parser.add_argument("distance", type=int)
    args = parser.parse_args()
    if args.job == "search":
        print(json.dumps(measure_search(Path(args.hashes), args.distance)))
    else:
        print(json.dumps(measure_look_alikes(int(args.hashes), args.distance)))


if __name__ == "__main__":
    main()
