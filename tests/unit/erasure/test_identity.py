"""What a file holds of a forgotten image is told by identity: its bytes are the image, its
name is the image's hash, its records or JSON carry the image's hash or path whole. A name
inside another (``a/1.png`` in ``a/11.png``) or shared by another class (``b/1.png``) is
another image."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from tasks.erasure.identity import Forgotten, holds, mentions, record_hashes
from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, SOURCE_KEY
from tasks.tfrecord import encode_example, frame_record

IMAGE = b"\x89PNG the pixels of a/1.png"
SHA = hashlib.sha256(IMAGE).hexdigest()
OTHER = hashlib.sha256(b"\x89PNG the pixels of a/11.png").hexdigest()
FORGOTTEN = Forgotten.of([SHA], ["a/1.png"], source_dir=Path("data/mini"), root=Path("."))


def shard(*records: tuple[str, str]) -> bytes:
    """A TFRecord stream of (content hash, source path) records."""
    return b"".join(
        frame_record(
            encode_example(
                {IMAGE_KEY: b"px", LABEL_KEY: 0, HASH_KEY: sha.encode(), SOURCE_KEY: path.encode()}
            )
        )
        for sha, path in records
    )


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("object", IMAGE),  # a copy of the source file
        (f"{SHA}.npy", b"re-encoded pixels"),  # named by its hash
        ("shard", shard((OTHER, "a/11.png"), (SHA, "a/1.png"))),
        ("shard.gz", gzip.compress(shard((SHA, "a/1.png")))),
        ("records.json", json.dumps({"shards": {"s": [{"sha256": SHA}]}}).encode()),
        ("listing.dir", json.dumps([{"md5": "x", "relpath": "a/1.png"}]).encode()),
        ("report.json", json.dumps({"wrong": ["data/mini/a/1.png"]}).encode()),
        ("index.json", b'{"version": 3}\n{"path": "a/1.png", "sha256": "x"}\n'),
        ("test_predictions.csv", b"path,label,predicted\na/11.png,0,0\na/1.png,0,1\n"),
        ("label_review.md", b"| image | label |\n|---|---|\n| `data/mini/a/1.png` | a |\n"),
    ],
)
def test_a_file_holding_the_image_by_identity_is_found(name: str, data: bytes) -> None:
    assert holds(name, data, FORGOTTEN)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("object", b"\x89PNG the pixels of a/11.png"),  # another image
        (f"{OTHER}.npy", b"re-encoded pixels"),
        ("shard", shard((OTHER, "a/11.png"), (OTHER[::-1], "b/1.png"))),
        ("records.json", json.dumps({"shards": {"s": [{"path": "a/11.png"}]}}).encode()),
        ("listing.dir", json.dumps([{"relpath": "b/1.png"}, {"relpath": "ba/1.png"}]).encode()),
        ("report.json", json.dumps({"wrong": ["data/mini/a/11.png", "1.png"]}).encode()),
        ("report.md", b"misclassified: a/1.png"),  # prose: a search reports it, never deletes
        ("test_predictions.csv", b"path,label\na/11.png,0\nb/1.png,1\n1.png,1\n"),
        ("workspace.lock", b""),
    ],
)
def test_names_inside_other_names_and_shared_across_classes_are_other_images(
    name: str, data: bytes
) -> None:
    assert not holds(name, data, FORGOTTEN)


def test_a_byte_search_finds_whole_names_and_hashes_only() -> None:
    assert mentions(b"misclassified: data/mini/a/1.png.", FORGOTTEN)
    assert mentions(b"raw " + bytes.fromhex(SHA), FORGOTTEN)
    assert not mentions(b"misclassified: data/mini/a/11.png, b/1.png, 1.png", FORGOTTEN)
    assert FORGOTTEN.named_in(f"decoded {SHA} in 3 ms")
    assert not FORGOTTEN.named_in(f"decoded {SHA}0 in 3 ms")
    assert FORGOTTEN.redact("a/1.png and a/11.png", "[x]") == "[x] and a/11.png"


def test_bytes_that_are_no_record_stream_are_not_taken_for_one() -> None:
    assert record_hashes(b"plain text, long enough for a header") is None
    assert record_hashes(shard((SHA, "a/1.png"))[:-1]) is None  # cut short
    assert record_hashes(b"") is None
