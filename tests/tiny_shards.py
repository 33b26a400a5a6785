"""Tiny, learnable shard sets for training tests, written straight from the record schema.

Built with :class:`RecordSchema` and :func:`build_manifest` only, so training tests do not
depend on the shard stage: three classes of noisy solid colours, learnable in a few epochs
(any of the four :data:`BASE_COLOURS`, in any order, on request).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tasks.contracts.manifest import (
    MANIFEST_NAME,
    ShardFile,
    SplitInfo,
    build_manifest,
    file_sha256,
)
from tasks.schema import RecordSchema
from tasks.tfrecord import TFRecordWriter

CLASSES = ("red", "green", "blue")
BASE_COLOURS = {
    "red": (200, 40, 40),
    "green": (40, 200, 40),
    "blue": (40, 40, 200),
    "yellow": (200, 200, 40),
}
DEFAULT_COUNTS = {"train": 24, "val": 6, "test": 10}  # per class


def write_tiny_shards(
    root: str | Path,
    *,
    size: int = 16,
    per_class: dict[str, int] | None = None,
    seed: int = 0,
    shards_per_split: int = 2,
    validated: bool = True,
    flipped: dict[str, int] | None = None,
    classes: Sequence[str] = CLASSES,
) -> Path:
    """Write ``root/data/shards`` (+ a passing ``root/reports/validation.json``).

    ``flipped`` gives, per split, how many records get a wrong label on purpose (the next
    class's); their source path still names the colour they are (``red/test_003.png``).
    ``classes``: names of :data:`BASE_COLOURS`, in the manifest's order (label = position).
    """
    root = Path(root)
    shards_dir = root / "data" / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    per_class = per_class or DEFAULT_COUNTS
    schema = RecordSchema(height=size, width=size, encoding="raw")
    rng = np.random.default_rng(seed)
    splits: dict[str, SplitInfo] = {}
    for split, count in per_class.items():
        made = []
        for label, name in enumerate(classes):
            for i in range(count):
                noise = rng.integers(-50, 51, size=(size, size, 3))
                pixels = np.clip(np.array(BASE_COLOURS[name]) + noise, 0, 255).astype(np.uint8)
                made.append((pixels, label, f"{name}/{split}_{i:03d}.png"))
        flips = (flipped or {}).get(split, 0)
        for position in np.linspace(0, len(made), flips, endpoint=False, dtype=int):
            pixels, label, source = made[position]
            made[position] = (pixels, (label + 1) % len(classes), source)
        records = [
            schema.serialize(
                schema.encode_image(pixels),
                label,
                hashlib.sha256(pixels.tobytes()).hexdigest(),
                source,
            )
            for pixels, label, source in made
        ]
        labels_given = [classes[label] for _, label, _ in made]
        order = rng.permutation(len(records))
        shards = []
        for index, part in enumerate(np.array_split(order, shards_per_split)):
            name = f"{split}.tfrecord-{index:05d}-of-{shards_per_split:05d}"
            with TFRecordWriter(shards_dir / name) as writer:
                for position in part:
                    writer.write(records[position])
            shards.append(
                ShardFile(
                    file=name,
                    num_records=len(part),
                    bytes=(shards_dir / name).stat().st_size,
                    sha256=file_sha256(shards_dir / name),
                )
            )
        splits[split] = SplitInfo(
            num_records=len(records),
            class_counts={name: labels_given.count(name) for name in classes},
            shards=shards,
        )
    manifest = build_manifest(
        schema,
        list(classes),
        "none",
        splits,
        resize="stretch",
        draft_decode=False,
        preprocessing_version="synthetic (tests/tiny_shards.py)",
    )
    (shards_dir / MANIFEST_NAME).write_text(manifest.to_json())
    if validated:
        write_validation_report(root, manifest.fingerprint, passed=True)
    return shards_dir


def write_validation_report(
    root: str | Path, fingerprint: str, *, passed: bool, failed_check: str = "class_balance"
) -> Path:
    """A validation report shaped like the validate stage's output."""
    checks = [{"name": "record_count", "passed": True, "message": "ok", "details": {}}]
    if not passed:
        checks.append(
            {"name": failed_check, "passed": False, "message": "class 'red' is 90%", "details": {}}
        )
    path = Path(root) / "reports" / "validation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"passed": passed, "fingerprint": fingerprint, "checks": checks}
    path.write_text(json.dumps(report, indent=2))
    return path
