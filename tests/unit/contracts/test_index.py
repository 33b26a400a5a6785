"""The ingest index's format: lines exactly as ``json.dumps`` writes them, read a chunk at a
time with every bad line named by its byte offset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

import tasks.contracts.index as index
from tasks.contracts.index import iter_records, write_index


def sample_index(count: int) -> dict[str, Any]:
    records = [
        {
            "path": f'caf\u00e9/{i:03d} "q".jpg',
            "label": "caf\u00e9",
            "label_index": 0,
            "sha256": f"{i:064x}",
            "split": "train",
            "format": "JPEG",
            "width": 10 + i,
            "height": 7,
        }
        for i in range(count)
    ]
    verdicts = {r["path"]: [r["sha256"], "JPEG", r["width"], 7, None] for r in records}
    verdicts["caf\u00e9/bad.jpg"] = [None, None, None, None, "not an image: \u00fc"]
    return {"source_dir": "src", "classes": ["caf\u00e9"], "records": records, "verdicts": verdicts}


def expected_lines(data: dict[str, Any]) -> list[str]:
    header = {
        "version": index.INDEX_VERSION,
        "source_dir": data["source_dir"],
        "classes": data["classes"],
        "verdict_key": None,
        "num_records": len(data["records"]),
        "num_verdicts": len(data["verdicts"]),
        "placement": None,
    }
    values = [header, *data["records"], *([p, *v] for p, v in sorted(data["verdicts"].items()))]
    return [json.dumps(v, sort_keys=True, separators=(",", ":")) + "\n" for v in values]


@pytest.mark.parametrize("c_encoder", [True, False])
def test_lines_are_json_dumps_and_the_digest_is_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, c_encoder: bool
) -> None:
    if not c_encoder:  # a Python built without json's C accelerator
        monkeypatch.setattr(index, "_C_ENCODE", None)
    monkeypatch.setattr(index, "CHUNK_LINES", 4)  # lines cross chunk boundaries
    data = sample_index(10)
    path = tmp_path / "index.json"
    digest = write_index(path, data)
    assert path.read_text() == "".join(expected_lines(data))
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_records_come_back_with_their_byte_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index, "CHUNK_LINES", 3)
    data = sample_index(8)
    path = tmp_path / "index.json"
    write_index(path, data)
    found = list(iter_records(path))
    assert [r for _, r in found] == data["records"]
    raw = path.read_bytes()
    for offset, record in found:
        line = raw[offset : raw.index(b"\n", offset) + 1]
        assert json.loads(line) == record


@pytest.mark.parametrize(
    ("damage", "problem"),
    [("{not json}", "not a JSON record"), ("[1, 2]", "must be a JSON object"), ("", "not a JSON")],
)
def test_a_bad_record_line_is_named_by_its_byte_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, problem: str
) -> None:
    monkeypatch.setattr(index, "CHUNK_LINES", 4)
    path = tmp_path / "index.json"
    write_index(path, sample_index(8))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[6] = damage.encode() + b"\n"  # record 5: inside the second chunk
    path.write_bytes(b"".join(lines))
    offset = sum(len(line) for line in lines[:6])
    with pytest.raises(ValueError, match=rf"index\.json, byte {offset}: .*{problem}"):
        list(iter_records(path))


def test_lines_that_only_parse_together_are_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsed as one array, ``{"a": [1`` and ``2]}`` would join into one record: the count
    check sends the chunk to the line-by-line parser, which names the first."""
    monkeypatch.setattr(index, "CHUNK_LINES", 4)
    path = tmp_path / "index.json"
    write_index(path, sample_index(4))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1:3] = [b'{"a": [1\n', b"2]}\n"]
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=rf"byte {len(lines[0])}: not a JSON record"):
        list(iter_records(path))
