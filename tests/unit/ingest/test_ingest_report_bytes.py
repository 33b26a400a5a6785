"""The ingest report is a typed record that writes the same JSON bytes as the dicts it
replaced: a golden written by the dict-built report for a folder that fills every field, and
a round trip of the committed report. The goldens were written by the dict-built code and
are never rewritten by the typed one; a field added since (``near_duplicates.flagged``) is
added to them by hand, and nothing else moves."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.near_duplicates import sample_photo
from tasks.ingest.demo_data import draw_shape
from tasks.ingest.report import IngestReport
from tasks.ingest.stage import RUN_COUNTS, run_ingest
from tasks.runtime.atomic import write_json
from tasks.runtime.params import default_params

HERE = Path(__file__).parent
GOLDEN = HERE / "golden_ingest_report.json"
ROOT = HERE.parents[2]


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def every_kind_of_file(src: Path) -> str:
    """A source folder with accepted, quarantined, duplicate, conflicting, skipped, excluded,
    near-duplicate and dropped-class entries; returns the excluded file's sha256."""
    rng = np.random.default_rng(0)
    for label, shape in (("a", "circle"), ("b", "square")):
        (src / label).mkdir(parents=True)
        for i in range(6):
            image = draw_shape(rng, shape, (32, 32))
            (src / label / f"good_{i}.png").write_bytes(encode(image, "PNG"))
    jpeg = encode(draw_shape(rng, "circle", (40, 40)), "JPEG")
    (src / "a" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (src / "a" / "sliver.png").write_bytes(encode(Image.new("RGB", (3, 40)), "PNG"))
    (src / "a" / "same_label_copy.png").write_bytes((src / "a" / "good_0.png").read_bytes())
    (src / "b" / "other_label_copy.png").write_bytes((src / "a" / "good_1.png").read_bytes())
    coffee = sample_photo("coffee")
    (src / "a" / "coffee.png").write_bytes(encode(coffee, "PNG"))
    (src / "a" / "coffee_small.jpg").write_bytes(encode(coffee.resize((200, 150)), "JPEG"))
    (src / "b" / "coffee_too.jpg").write_bytes(encode(coffee.resize((160, 120)), "JPEG"))
    (src / "c").mkdir()
    (src / "c" / "broken.png").write_bytes(b"not an image")
    (src / "empty").mkdir()
    (src / ".hidden.png").write_bytes(b"")
    (src / "loose.png").write_bytes((src / "a" / "good_2.png").read_bytes())
    excluded = encode(draw_shape(rng, "square", (32, 32)), "PNG")
    (src / "b" / "excluded.png").write_bytes(excluded)
    return hashlib.sha256(excluded).hexdigest()


def ingest_every_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Ingest the folder with a relative ``source_dir`` (the report names it)."""
    excluded = every_kind_of_file(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    params = default_params(ingest={"source_dir": "src", "workers": 1}).ingest
    return run_ingest(
        params, tmp_path / "index.json", tmp_path / "ingest.json", excluded=frozenset([excluded])
    )


def test_the_typed_ingest_report_writes_the_bytes_the_dict_report_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    returned = ingest_every_kind(tmp_path, monkeypatch)
    written = (tmp_path / "ingest.json").read_text()
    assert written == GOLDEN.read_text()
    report = json.loads(written)  # every field filled, so none can drop out unseen
    for key in ("quarantined", "duplicates", "skipped", "classes_dropped"):
        assert report[key], key
    assert report["near_duplicates"]["groups"] and report["near_duplicates"]["label_conflicts"]
    assert report["near_duplicates"]["flagged"]
    assert report["excluded_count"] == 1
    # what the flow logs: the file's fields plus how this run reached its verdicts
    assert {k: v for k, v in returned.items() if k not in RUN_COUNTS} == report
    assert set(returned) - set(report) == set(RUN_COUNTS)


def test_the_committed_ingest_report_round_trips_through_the_type(tmp_path: Path) -> None:
    committed = ROOT / "reports" / "ingest.json"
    report = IngestReport.model_validate_json(committed.read_text())
    write_json(tmp_path / "ingest.json", report.as_json())
    assert (tmp_path / "ingest.json").read_bytes() == committed.read_bytes()
