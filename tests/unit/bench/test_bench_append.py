"""The append bench: its pure parts, and one tiny measurement through the real stages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.__main__ import parse_args
from bench.append import (
    append_figures,
    classify_push,
    new_image_count,
    partition_images,
    pushed_count,
    remote_objects,
    snapshot,
    written_files,
)
from bench.report import append_rows, format_table
from bench.stats import evaluate_targets


def test_new_image_count_is_the_fraction_of_the_base_at_least_one() -> None:
    assert new_image_count(50000, 0.01) == 500
    assert new_image_count(2000, 0.01) == 20
    assert new_image_count(10, 0.01) == 1
    with pytest.raises(ValueError, match="--append-fraction"):
        new_image_count(100, 0.0)
    with pytest.raises(ValueError, match="--append-images"):
        new_image_count(0, 0.01)


def test_partition_images_by_global_number() -> None:
    names = ["ring/ring_000002.jpg", "circle/circle_000000.jpg", "cross/cross_000006.jpg"]
    base, new = partition_images(names, 5)
    assert base == ["circle/circle_000000.jpg", "ring/ring_000002.jpg"]
    assert new == ["cross/cross_000006.jpg"]
    with pytest.raises(ValueError, match=r"notes\.txt"):
        partition_images(["circle/notes.txt"], 5)


def test_written_files_counts_new_and_replaced_files_only(tmp_path: Path) -> None:
    (tmp_path / "old").write_bytes(b"x" * 10)
    (tmp_path / "kept").write_bytes(b"y" * 7)
    before = snapshot(tmp_path)
    # Rewritten the way the shard stage writes: same bytes, temp file renamed into place.
    (tmp_path / "tmp").write_bytes(b"x" * 10)
    os.replace(tmp_path / "tmp", tmp_path / "old")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "new").write_bytes(b"z" * 3)
    assert written_files(before, snapshot(tmp_path)) == {"old": 10, "gen/new": 3}
    assert written_files(before, before) == {}


def test_remote_objects_reads_dvc3_object_paths() -> None:
    paths = [
        "files/md5/ab/cdef0123",
        "files/md5/51/d429.dir",
        "files/md5/ab",  # a folder, not an object
        "tmp/whatever",
    ]
    assert remote_objects(paths) == {"abcdef0123", "51d429.dir"}


ENTRIES = {
    "train.tfrecord-00000-of-00002": "a1",
    "train.tfrecord-00001-of-00002": "a2",
    "gen-00001/train.tfrecord-00000-of-00001": "b1",
    "manifest.json": "m2",
    "offsets.json": "o2",
}
BASE = ["train.tfrecord-00000-of-00002", "train.tfrecord-00001-of-00002"]
NEW = ["gen-00001/train.tfrecord-00000-of-00001"]


def test_classify_push_of_only_the_new_shards() -> None:
    sent = classify_push({"b1", "m2", "o2", "ff.dir"}, ENTRIES, NEW, BASE)
    assert sent["shard_mismatch"] == 0
    assert (sent["objects"], sent["new_shards"], sent["old_shards"]) == (4, 1, 0)
    assert sent["other_files"] == ["manifest.json", "offsets.json"]
    assert sent["folder_listings"] == ["ff.dir"]
    assert sent["unmatched_objects"] == []


def test_classify_push_counts_old_shards_resent_and_new_ones_missing() -> None:
    resent = classify_push({"a2", "b1", "m2"}, ENTRIES, NEW, BASE)
    assert resent["shard_mismatch"] == 1
    assert resent["old_shards_resent"] == ["train.tfrecord-00001-of-00002"]
    missing = classify_push({"m2"}, ENTRIES, NEW, BASE)
    assert missing["shard_mismatch"] == 1
    assert missing["new_shards_missing"] == NEW


def test_pushed_count_parses_dvc_output() -> None:
    assert pushed_count("Collecting\n6 files pushed\n") == 6
    assert pushed_count("1 file pushed") == 1
    assert pushed_count("Everything is up to date.") is None


def test_append_figures_are_fractions_of_the_full_run() -> None:
    full = {"ingest_s": 10.0, "shard_s": 30.0, "validate_s": 10.0, "bytes_written": 1000}
    update = {
        "ingest_s": 2.0,
        "shard_s": 1.0,
        "validate_s": 2.0,
        "bytes_written": 20,
        "set_bytes": 1010,
    }
    figures = append_figures(full, update)
    assert figures["append.data_side_fraction"] == pytest.approx(5.0 / 50.0)
    assert figures["append.ingest_fraction"] == pytest.approx(0.2)
    assert figures["append.shard_time_fraction"] == pytest.approx(1.0 / 30.0)
    assert figures["append.bytes_written_fraction"] == pytest.approx(20 / 1010)
    assert figures["append.rebuild_bytes_written"] == 1000


def test_append_targets_pass_and_fail_on_the_issue_thresholds() -> None:
    good = {
        "append.bytes_written_fraction": 0.011,
        "append.data_side_fraction": 0.15,
        "append.push_shard_mismatch": 0,
    }
    bad = {
        "append.bytes_written_fraction": 0.031,
        "append.data_side_fraction": 0.25,
        "append.push_shard_mismatch": 2,
    }

    def verdicts(figures: dict[str, float]) -> list[bool | None]:
        return [t["pass"] for t in evaluate_targets(figures, "raw") if "append" in t["name"]]

    assert verdicts(good) == [True, True, True]
    assert verdicts(bad) == [False, False, False]
    assert verdicts({}) == [None, None, None]


def test_report_shows_append_rows_only_when_measured() -> None:
    assert append_rows({}) == []
    figures = {"append.shard_s": 1.5, "append.push_old_shards": 0, "append.push_new_shards": 3}
    rows = append_rows(figures)
    assert any(r.startswith("append shard") and "1.50" in r for r in rows)
    assert any("new shards sent" in r and r.split()[-1] == "3" for r in rows)
    assert "append shard" in format_table(figures, [])


def test_cli_append_options_and_defaults() -> None:
    args = parse_args([])
    assert (args.append_images, args.append_fraction) == (50000, 0.01)
    args = parse_args(["--append-images", "2000", "--append-fraction", "0.05"])
    assert (args.append_images, args.append_fraction) == (2000, 0.05)


# -- one tiny measurement through ingest, the shard flow, validation and DVC -----------------


def test_the_bench_runs_its_table_of_sections_in_order_minus_skips_and_others() -> None:
    from bench.__main__ import SECTIONS, wanted

    assert wanted(parse_args([])) == list(SECTIONS)
    skipped = wanted(parse_args(["--skip-orchestration", "--skip-scaling"]))
    assert skipped == [name for name in SECTIONS if name not in ("orchestration", "scaling")]
    assert wanted(parse_args(["--only", "plan_rss,read"])) == ["read", "plan_rss"]
