"""Ingest stage: find every input image, check it decodes, assign splits, quarantine the rest.

Every file found ends up in exactly one bucket: accepted (in the index, with its split),
quarantined (with a reason), or a duplicate of an accepted file. The index it writes is the
shard stage's only input besides the image bytes themselves.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import multiprocessing
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tasks.atomic import write_json
from tasks.manifest import SPLITS
from tasks.params import IngestParams, SplitFractions

INDEX_VERSION = 1
# Decoding is guarded by our own max_pixels check; PIL's bomb guard would fire first.
Image.MAX_IMAGE_PIXELS = None


class ImageRejected(ValueError):
    """An input file that cannot be used; the message is the quarantine reason."""


@dataclass(frozen=True)
class Candidate:
    path: str  # relative to the source folder (or as written in the CSV)
    label: str


@dataclass(frozen=True)
class Inspected:
    path: str
    label: str
    sha256: str | None
    format: str | None
    width: int
    height: int
    reason: str | None  # None when the image is usable


def decode_rgb(data: bytes, *, max_pixels: int, min_side: int) -> Image.Image:
    """Fully decode image bytes to an RGB PIL image with EXIF orientation applied.

    The format is sniffed from the bytes, never the file extension. Raises
    :class:`ImageRejected` with the reason when the bytes cannot be used.
    """
    if not data:
        raise ImageRejected("empty file (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageRejected("not an image (format not recognised from its bytes)") from None
    except Exception as exc:
        raise ImageRejected(f"truncated or corrupt header: {exc}") from None
    width, height = image.size
    if width * height > max_pixels or min(width, height) < min_side:
        raise ImageRejected(
            f"absurd dimensions {width}x{height} (limits: {min_side} px per side, "
            f"{max_pixels} px in all)"
        )
    try:
        image.load()
        oriented = ImageOps.exif_transpose(image) or image
        return to_rgb(oriented)
    except Exception as exc:
        raise ImageRejected(f"truncated or corrupt {image.format} data: {exc}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """Normalise any PIL mode (L, P, RGBA, CMYK, 16-bit, float) to 8-bit RGB.

    Transparent pixels are composited over black; 16-bit values are scaled, not clipped.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        pixels = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if mode.startswith("I;16") or pixels.max() > 255 else 255.0
        gray = np.clip(pixels / peak * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if mode == "F":
        pixels = np.asarray(image, dtype=np.float64)
        span = max(float(pixels.max() - pixels.min()), 1e-12)
        gray = ((pixels - pixels.min()) / span * 255.0 + 0.5).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if mode in ("P", "PA"):
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def inspect_file(
    source_dir: str, candidate: Candidate, max_pixels: int, min_side: int
) -> Inspected:
    """Read, hash and fully decode one file; never raises for a bad file."""
    path = Path(source_dir) / candidate.path
    try:
        data = path.read_bytes()
    except OSError as exc:
        return Inspected(candidate.path, candidate.label, None, None, 0, 0, f"unreadable: {exc}")
    digest = hashlib.sha256(data).hexdigest()
    fmt = None
    try:
        image = decode_rgb(data, max_pixels=max_pixels, min_side=min_side)
        fmt = Image.open(io.BytesIO(data)).format
        return Inspected(candidate.path, candidate.label, digest, fmt, *image.size, None)
    except ImageRejected as exc:
        return Inspected(candidate.path, candidate.label, digest, fmt, 0, 0, str(exc))


def _inspect_chunk(
    source_dir: str, chunk: list[Candidate], max_pixels: int, min_side: int
) -> list[Inspected]:
    return [inspect_file(source_dir, c, max_pixels, min_side) for c in chunk]


def discover(source_dir: Path, labels_csv: Path | None = None) -> list[Candidate]:
    """Files to ingest: one sub-folder per class, or the rows of a ``path,label`` CSV."""
    if labels_csv is not None:
        if not labels_csv.exists():
            raise FileNotFoundError(f"{labels_csv}: labels CSV not found (ingest.labels_csv)")
        with labels_csv.open(newline="") as handle:
            reader = csv.DictReader(handle)
            if not reader.fieldnames or not {"path", "label"} <= set(reader.fieldnames):
                raise ValueError(f"{labels_csv}: needs a header with columns `path,label`")
            rows = [Candidate(row["path"].strip(), row["label"].strip()) for row in reader]
        return sorted(rows, key=lambda c: c.path)
    if not source_dir.is_dir():
        raise FileNotFoundError(
            f"{source_dir}: source folder not found (ingest.source_dir); "
            "for the demo dataset run `make demo-data`"
        )
    found = []
    for class_dir in sorted(p for p in source_dir.iterdir() if p.is_dir()):
        if class_dir.name.startswith("."):
            continue
        for file in sorted(class_dir.rglob("*")):
            # Broken symlinks count too: they are reported as unreadable, not silently skipped.
            if (file.is_file() or file.is_symlink()) and not file.name.startswith("."):
                found.append(Candidate(file.relative_to(source_dir).as_posix(), class_dir.name))
    if not found:
        raise ValueError(f"{source_dir}: no files found in class sub-folders")
    return found


def assign_split(content_hash: str, fractions: SplitFractions, seed: int) -> str:
    """Split from a seeded hash of the content, so a file's split never depends on others.

    Each class is split independently at the same fractions, so every class is stratified
    in expectation; identical content always lands in the same split (no leakage).
    """
    key = hashlib.sha256(f"{seed}:{content_hash}".encode()).digest()
    u = int.from_bytes(key[:8], "big") / 2**64
    if u < fractions.train:
        return "train"
    if u < fractions.train + fractions.val:
        return "val"
    return "test"


def inspect_all(
    source_dir: Path, candidates: list[Candidate], params: IngestParams
) -> list[Inspected]:
    """Inspect every candidate, in parallel (spawned processes) when it pays."""
    from tqdm import tqdm

    workers = max(1, params.workers)
    chunk_size = 64
    chunks = [candidates[i : i + chunk_size] for i in range(0, len(candidates), chunk_size)]
    args = (str(source_dir), params.max_pixels, params.min_side)
    results: list[Inspected] = []
    with tqdm(total=len(candidates), desc="ingest", unit="img", mininterval=1.0) as bar:
        if workers == 1 or len(chunks) < 2:
            for chunk in chunks:
                results.extend(_inspect_chunk(args[0], chunk, args[1], args[2]))
                bar.update(len(chunk))
        else:
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
                futures = [
                    pool.submit(_inspect_chunk, args[0], c, args[1], args[2]) for c in chunks
                ]
                for future in futures:  # in submission order: output order is deterministic
                    chunk_result = future.result()
                    results.extend(chunk_result)
                    bar.update(len(chunk_result))
    return results


def build_index(
    inspected: list[Inspected], classes: list[str], params: IngestParams
) -> dict[str, Any]:
    """Sort inspected files into accepted / quarantined / duplicate, with splits."""
    quarantined = [
        {"path": i.path, "label": i.label, "reason": i.reason} for i in inspected if i.reason
    ]
    good = [i for i in inspected if i.reason is None]
    by_hash: dict[str, list[Inspected]] = defaultdict(list)
    for item in good:
        by_hash[str(item.sha256)].append(item)

    records, duplicates = [], []
    for item in good:
        group = by_hash[str(item.sha256)]
        labels = sorted({g.label for g in group})
        if len(labels) > 1:
            quarantined.append(
                {
                    "path": item.path,
                    "label": item.label,
                    "reason": f"duplicate content with conflicting labels {labels}: "
                    + ", ".join(g.path for g in group),
                }
            )
            continue
        keeper = group[0]  # inputs are sorted by path, so the first path wins
        if item is not keeper:
            duplicates.append({"path": item.path, "label": item.label, "duplicate_of": keeper.path})
            continue
        records.append(
            {
                "path": item.path,
                "label": item.label,
                "label_index": classes.index(item.label),
                "sha256": item.sha256,
                "split": assign_split(str(item.sha256), params.splits, params.seed),
                "format": item.format,
                "width": item.width,
                "height": item.height,
            }
        )
    quarantined.sort(key=lambda q: q["path"])
    return {"records": records, "quarantined": quarantined, "duplicates": duplicates}


def run_ingest(params: IngestParams, index_path: Path, report_path: Path) -> dict[str, Any]:
    """Ingest ``params.source_dir``; write the index and the ingest report; return the report."""
    source_dir = Path(params.source_dir)
    labels_csv = Path(params.labels_csv) if params.labels_csv else None
    candidates = discover(source_dir, labels_csv)
    classes = sorted({c.label for c in candidates})
    sorted_out = build_index(inspect_all(source_dir, candidates, params), classes, params)
    records = sorted_out["records"]
    present = sorted({r["label"] for r in records})
    classes = [c for c in classes if c in present]  # a class whose files all failed is dropped
    for record in records:
        record["label_index"] = classes.index(record["label"])

    counts = {c: {s: 0 for s in SPLITS} for c in classes}
    for record in records:
        counts[record["label"]][record["split"]] += 1
    report = {
        "source_dir": params.source_dir,
        "classes": classes,
        "files_found": len(candidates),
        "accepted": len(records),
        "quarantined_count": len(sorted_out["quarantined"]),
        "duplicate_count": len(sorted_out["duplicates"]),
        "counts": counts,
        "split_counts": {s: sum(counts[c][s] for c in classes) for s in SPLITS},
        "formats": dict(sorted(Counter(str(r["format"]) for r in records).items())),
        "quarantined": sorted_out["quarantined"],
        "duplicates": sorted_out["duplicates"],
    }
    accounted = report["accepted"] + report["quarantined_count"] + report["duplicate_count"]
    if accounted != report["files_found"]:  # a bug, never a data problem
        raise AssertionError(f"ingest lost files: {accounted} accounted of {len(candidates)}")
    index = {
        "version": INDEX_VERSION,
        "source_dir": params.source_dir,
        "classes": classes,
        "records": records,
    }
    write_json(index_path, index)
    write_json(report_path, report)
    return report


def load_index(index_path: Path) -> dict[str, Any]:
    if not index_path.exists():
        raise FileNotFoundError(f"{index_path}: no ingest index; run the ingest stage first")
    index: dict[str, Any] = json.loads(index_path.read_text())
    if index.get("version") != INDEX_VERSION:
        raise ValueError(
            f"{index_path}: index version {index.get('version')}, expected {INDEX_VERSION}"
        )
    return index


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-class table (class, train, val, test, total) for artifacts and README."""
    rows = []
    for cls in report["classes"]:
        c = report["counts"][cls]
        rows.append({"class": cls, **c, "total": sum(c.values())})
    return rows
