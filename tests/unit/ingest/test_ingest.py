"""Ingest: every file accounted for, bad files quarantined with reasons, stable splits."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.contracts.index import load_index
from tasks.images import ImageRejected, decode_rgb
from tasks.ingest.demo_data import _exif_rotated_jpeg, _png_header_only, draw_shape, generate
from tasks.ingest.refusals import SetWouldBeLost
from tasks.ingest.stage import run_ingest
from tasks.runtime.params import default_params
from tasks.runtime.refusals import Refused
from tests.conftest import write_image_folder


def encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def ingest(source: Path, tmp_path: Path, **kwargs: object) -> tuple[dict, dict]:
    params = default_params(ingest={"source_dir": str(source), "workers": 1, **kwargs}).ingest
    report = run_ingest(params, tmp_path / "index.json", tmp_path / "ingest.json")
    return report, load_index(tmp_path / "index.json")


@pytest.fixture
def bad_inputs(tmp_path: Path) -> Path:
    """One class folder per kind of trouble, next to good images."""
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    for label in ("a", "b"):
        (src / label).mkdir(parents=True)
        for i in range(6):
            (src / label / f"good_{i}.png").write_bytes(
                encode(draw_shape(rng, "circle" if label == "a" else "square", (32, 32)), "PNG")
            )
    jpeg = encode(draw_shape(rng, "circle", (40, 40)), "JPEG")
    (src / "a" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (src / "a" / "empty.jpg").write_bytes(b"")
    (src / "a" / "notes.png").write_bytes(b"not an image at all")
    (src / "a" / "bomb.png").write_bytes(_png_header_only(100_000, 100_000))
    (src / "a" / "sliver.png").write_bytes(encode(Image.new("RGB", (3, 40)), "PNG"))
    (src / "b" / "unreadable.png").symlink_to(src / "b" / "does-not-exist.png")
    (src / "a" / "same_label_copy.png").write_bytes((src / "a" / "good_0.png").read_bytes())
    (src / "b" / "other_label_copy.png").write_bytes((src / "a" / "good_1.png").read_bytes())
    return src


def test_every_bad_file_is_quarantined_with_its_reason(bad_inputs: Path, tmp_path: Path) -> None:
    report, index = ingest(bad_inputs, tmp_path)
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons["a/truncated.jpg"].startswith("truncated or corrupt")
    assert reasons["a/empty.jpg"] == "empty file (0 bytes)"
    assert reasons["a/notes.png"].startswith("not an image")
    assert reasons["a/bomb.png"].startswith("absurd dimensions")
    assert "10000000000 pixels" in reasons["a/bomb.png"]
    assert reasons["a/sliver.png"].startswith("absurd dimensions 3x40")
    assert reasons["b/unreadable.png"].startswith("unreadable")
    # Conflicting labels: both copies are quarantined, naming each other.
    assert "conflicting labels" in reasons["a/good_1.png"]
    assert "b/other_label_copy.png" in reasons["a/good_1.png"]
    assert "conflicting labels" in reasons["b/other_label_copy.png"]
    assert report["duplicates"] == [
        {"path": "a/same_label_copy.png", "label": "a", "duplicate_of": "a/good_0.png"}
    ]
    # Nothing lost: accepted + quarantined + duplicates = found, and the index holds the accepted.
    assert report["files_found"] == 20
    assert report["accepted"] + report["quarantined_count"] + report["duplicate_count"] == 20
    assert len(index["records"]) == report["accepted"] == 11  # 12 good, 1 in a conflict
    accepted = {r["path"] for r in index["records"]}
    assert accepted.isdisjoint(reasons) and "a/same_label_copy.png" not in accepted


def test_format_comes_from_bytes_not_extension(tmp_path: Path) -> None:
    src = tmp_path / "src" / "x"
    src.mkdir(parents=True)
    rng = np.random.default_rng(1)
    (src / "really_a_png.jpg").write_bytes(encode(draw_shape(rng, "ring", (30, 30)), "PNG"))
    (src / "really_a_jpeg.png").write_bytes(encode(draw_shape(rng, "ring", (30, 30)), "JPEG"))
    _, index = ingest(tmp_path / "src", tmp_path)
    formats = {r["path"]: r["format"] for r in index["records"]}
    assert formats == {"x/really_a_jpeg.png": "JPEG", "x/really_a_png.jpg": "PNG"}


@pytest.mark.parametrize(
    "mode_image",
    [
        Image.new("L", (20, 10), 128),
        Image.new("P", (20, 10), 3),
        Image.new("RGBA", (20, 10), (255, 0, 0, 0)),
        Image.new("CMYK", (20, 10), (0, 255, 0, 0)),
        Image.fromarray(np.full((10, 20), 65535, np.uint16)),
        Image.new("1", (20, 10), 1),
    ],
    ids=["L", "P", "RGBA", "CMYK", "I16", "1"],
)
def test_every_mode_normalises_to_rgb(mode_image: Image.Image) -> None:
    fmt = "JPEG" if mode_image.mode == "CMYK" else "PNG"
    rgb = decode_rgb(encode(mode_image, fmt), max_pixels=10**6, min_side=4)
    assert rgb.mode == "RGB" and rgb.size == (20, 10)
    pixels = np.asarray(rgb)
    if mode_image.mode == "I;16":
        assert pixels.min() == 255  # scaled from 16 bits, not clipped to garbage
    if mode_image.mode == "RGBA":
        assert pixels.max() == 0  # fully transparent red composites to black


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 20, 20))  # left half white
    rgb = decode_rgb(_exif_rotated_jpeg(image), max_pixels=10**6, min_side=4)
    pixels = np.asarray(rgb).mean(axis=2)
    assert rgb.size == (40, 20)
    assert pixels[:, :15].mean() > 200 and pixels[:, 25:].mean() < 50


def test_decode_rejects_with_reason() -> None:
    with pytest.raises(ImageRejected, match="empty file"):
        decode_rgb(b"", max_pixels=10, min_side=1)


def test_adding_files_never_moves_existing_files(tmp_path: Path) -> None:
    """The next ingest into the same index keeps every placed split (the shards hold
    them); only the new files are placed, into the splits their classes lag behind in."""
    src = tmp_path / "src"
    generate(
        src, per_class=30, broken=False, classes=("circle", "square"), min_size=16, max_size=24
    )
    _, before = ingest(src, tmp_path / "one")
    extra = tmp_path / "extra"
    generate(
        extra,
        per_class=20,
        seed=99,
        broken=False,
        classes=("circle", "square", "ring"),
        min_size=16,
        max_size=24,
    )
    for file in extra.rglob("*.*"):
        target = src / file.parent.name / f"new_{file.name}"
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(file.read_bytes())
    _, after = ingest(src, tmp_path / "one")
    old = {r["path"]: r["split"] for r in before["records"]}
    new = {r["path"]: r["split"] for r in after["records"]}
    assert len(new) > len(old)
    assert {path: new[path] for path in old} == old


def test_every_class_keeps_its_split_shares_and_each_copy_its_original_split(
    tmp_path: Path,
) -> None:
    """Real scans (scikit-learn's digits), skewed: 170 / 130 / 100 scans of three digits, a
    tenth of them filed again resized and re-encoded. Scans of one digit share a layout (their
    hashes are candidates); only the copies are confirmed, each lands in its original's
    split, and every class lands within 2 points of ``ingest.splits`` in every split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    wanted = {0: 170, 1: 130, 2: 100}
    copies: dict[str, str] = {}
    for digit, count in wanted.items():
        scans = digits.images[digits.target == digit][:count]
        for k, pixels in enumerate(scans):
            image = Image.fromarray((pixels * 255 / 16).astype(np.uint8)).resize((64, 64))
            path = Path(f"d{digit}/scan_{k:03d}.png")
            (tmp_path / "src" / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "src" / path).write_bytes(encode(image, "PNG"))
            if k % 10 == 0:
                copy = path.with_name(f"copy_{k:03d}.jpg")
                (tmp_path / "src" / copy).write_bytes(encode(image.resize((48, 48)), "JPEG"))
                copies[str(copy)] = str(path)

    report, index = ingest(tmp_path / "src", tmp_path)

    split = {r["path"]: r["split"] for r in index["records"]}
    assert all(split[copy] == split[original] for copy, original in copies.items())
    assert report["near_duplicates"]["group_count"] == len(copies)
    shares = default_params().ingest.splits.model_dump()
    for label, counts in report["counts"].items():
        total = sum(counts.values())
        assert total >= 100
        for name, share in shares.items():
            assert abs(counts[name] / total - share) <= 0.02, (label, counts)


def test_labels_from_csv(tmp_path: Path) -> None:
    src = tmp_path / "flat"
    src.mkdir()
    rng = np.random.default_rng(2)
    rows = ["path,label"]
    for i in range(6):
        name = f"img_{i}.png"
        (src / name).write_bytes(encode(draw_shape(rng, "cross", (24, 24)), "PNG"))
        rows.append(f"{name},{'odd' if i % 2 else 'even'}")
    rows.append("missing.png,odd")
    (src / "labels.csv").write_text("\n".join(rows) + "\n")
    report, index = ingest(src, tmp_path, labels_csv=str(src / "labels.csv"))
    assert index["classes"] == ["even", "odd"]
    assert report["accepted"] == 6 and report["quarantined"][0]["path"] == "missing.png"
    assert {r["path"]: r["label"] for r in index["records"]}["img_3.png"] == "odd"


def test_missing_source_dir_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ingest(tmp_path / "nowhere", tmp_path)


def test_parallel_ingest_matches_serial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.ingest import stage as ingest_module

    started = []
    real_pool = ingest_module.spawn_pool
    monkeypatch.setattr(ingest_module, "spawn_pool", lambda n: started.append(n) or real_pool(n))
    src = tmp_path / "src"
    generate(src, per_class=70, classes=("circle", "square"), min_size=16, max_size=24)
    serial = run_ingest(
        default_params(ingest={"source_dir": str(src), "workers": 1}).ingest,
        tmp_path / "i1.json",
        tmp_path / "r1.json",
    )
    told: list[tuple[int, int]] = []
    parallel = run_ingest(
        default_params(ingest={"source_dir": str(src), "workers": 2}).ingest,
        tmp_path / "i2.json",
        tmp_path / "r2.json",
        progress=lambda done, total: told.append((done, total)),
    )
    assert started == [2]  # the serial run started none, the parallel one two workers
    assert serial == parallel
    assert (tmp_path / "i1.json").read_bytes() == (tmp_path / "i2.json").read_bytes()
    # A first ingest, every file decoded by the workers, reports its progress as each chunk
    # comes back, as a rerun that reuses every verdict does: not only once it is done.
    total = parallel["files_found"]
    assert parallel["decoded_count"] == total and parallel["reused_count"] == 0
    chunk = ingest_module.CHUNK
    assert told == [(min(n, total), total) for n in range(chunk, total + chunk, chunk)]
    assert len(told) >= 3


def test_demo_dataset_is_byte_identical_across_runs(tmp_path: Path) -> None:
    kwargs = {"per_class": 25, "classes": ("circle", "ring"), "min_size": 16, "max_size": 40}
    generate(tmp_path / "one", **kwargs)  # type: ignore[arg-type]
    generate(tmp_path / "two", **kwargs)  # type: ignore[arg-type]
    one = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in (tmp_path / "one").rglob("*.*")}
    two = {p.relative_to(tmp_path / "two"): p.read_bytes() for p in (tmp_path / "two").rglob("*.*")}
    assert one == two and len(one) == 25 * 2 + 7


# -- input that cannot reach outside, and input that cannot stop the run ---------------------


def test_labels_csv_outside_source_dir_is_refused(tmp_path: Path) -> None:
    # DVC tracks the CSV through the source_dir dependency; one elsewhere could go stale.
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (tmp_path / "labels.csv").write_text("path,label\na/x.png,a\n")
    with pytest.raises(ValueError, match=r"ingest.labels_csv=.*outside ingest.source_dir"):
        ingest(src, tmp_path, labels_csv=str(tmp_path / "labels.csv"))


def test_csv_rows_and_symlinks_that_leave_source_dir_are_quarantined(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    secret = tmp_path / "secret.png"
    secret.write_bytes(encode(draw_shape(rng, "circle", (24, 24)), "PNG"))
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    for i in range(3):
        (src / "a" / f"ok_{i}.png").write_bytes(encode(draw_shape(rng, "square", (24, 24)), "PNG"))
    (src / "a" / "link.png").symlink_to(secret)
    rows = ["path,label", *(f"a/ok_{i}.png,a" for i in range(3))]
    rows += [f"{secret},a", "../secret.png,a", "a/../../secret.png,a", "a/link.png,a"]
    (src / "labels.csv").write_text("\n".join(rows) + "\n")
    report, index = ingest(src, tmp_path, labels_csv=str(src / "labels.csv"))
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert report["accepted"] == 3
    assert sorted(reasons) == sorted(
        [str(secret), "../secret.png", "a/../../secret.png", "a/link.png"]
    )
    assert all(reason.startswith("outside source_dir") for reason in reasons.values())
    assert all(
        r["sha256"] != hashlib.sha256(secret.read_bytes()).hexdigest() for r in index["records"]
    )


def test_symlink_leaving_a_class_folder_is_quarantined(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=3)
    outside = write_image_folder(tmp_path / "outside", per_class=1)
    (src / "red" / "escape.png").symlink_to(outside / "red" / "000.jpg")
    (src / "blue" / "folder_link").symlink_to(outside / "green")
    report, _ = ingest(src, tmp_path)
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons["red/escape.png"].startswith("outside source_dir")
    assert reasons["blue/folder_link"].startswith("outside source_dir")
    assert report["accepted"] == 9


def test_a_folder_checked_out_as_links_into_the_projects_dvc_cache_is_ingested(
    tmp_path: Path,
) -> None:
    # `cache.type symlink`: every file of a DVC-tracked folder is a link into .dvc/cache
    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    src = write_image_folder(project / "photos", per_class=3)
    copied, _ = ingest(src, tmp_path / "copied")
    cache = project / ".dvc" / "cache" / "files" / "md5"
    for number, path in enumerate(sorted(p for p in src.rglob("*") if p.is_file())):
        cached = cache / f"{number:02d}" / "content"
        cached.parent.mkdir(parents=True)
        path.rename(cached)
        path.symlink_to(cached)
    linked, index = ingest(src, tmp_path / "linked")
    assert linked["accepted"] == copied["accepted"] == 9
    assert not linked["quarantined"]
    assert sorted(r["path"] for r in index["records"]) == sorted(
        str(p.relative_to(src)) for p in src.rglob("*") if p.is_symlink()
    )


def test_a_file_rewritten_while_ingest_runs_fails_the_stage_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index of the old content beside a folder of the new would be refused by the shard
    stage: the stage fails instead, and writes nothing."""
    import tasks.ingest.stage

    src = write_image_folder(tmp_path / "src", per_class=2)
    new = (
        write_image_folder(tmp_path / "new", per_class=2, seed=9) / "red" / "001.png"
    ).read_bytes()
    inspect_all = tasks.ingest.stage.inspect_all

    def rewritten_after_reading(*args: object, **kwargs: object) -> object:
        inspected = inspect_all(*args, **kwargs)  # type: ignore[arg-type]
        (src / "red" / "001.png").write_bytes(new)
        return inspected

    monkeypatch.setattr(tasks.ingest.stage, "inspect_all", rewritten_after_reading)
    with pytest.raises(Refused, match=r"changed while ingest read them: red/001\.png"):
        ingest(src, tmp_path)
    assert not (tmp_path / "index.json").exists()
    monkeypatch.undo()
    report, index = ingest(src, tmp_path)  # the next run reads it anew
    assert report["accepted"] == 6
    assert hashlib.sha256(new).hexdigest() in {r["sha256"] for r in index["records"]}


def test_special_files_and_oversized_files_are_quarantined_unread(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    os.mkfifo(src / "red" / "pipe.png")  # reading it would block the stage forever
    big = src / "green" / "huge.png"
    big.write_bytes(b"\x89PNG" + b"\0" * (2 * 2**20))
    report, _ = ingest(src, tmp_path, max_file_mb=1)
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons["red/pipe.png"] == "not a regular file (a FIFO)"
    assert reasons["green/huge.png"].startswith("file too large: 2.0 MB > ingest.max_file_mb")
    assert report["accepted"] == 6


def test_non_utf8_file_name_is_quarantined_not_a_crash(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    raw_name = os.fsencode(src / "red") + b"/caf\xe9.png"
    with open(raw_name, "wb") as handle:
        handle.write((src / "red" / "000.jpg").read_bytes()[:-2] + b"\xff\xd9")
    report, _ = ingest(src, tmp_path)
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons["red/caf\\xe9.png"].startswith("file name is not valid UTF-8")
    # The reports stay valid UTF-8 JSON a strict reader accepts.
    (tmp_path / "ingest.json").read_bytes().decode("utf-8", "strict")
    assert (
        report["files_found"]
        == report["accepted"]
        + report["quarantined_count"]
        + report["duplicate_count"]
        + report["skipped_count"]
    )


def test_hidden_and_stray_entries_are_counted_as_skipped(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    (src / "red" / ".DS_Store").write_bytes(b"junk")
    (src / ".cache").mkdir()
    (src / ".cache" / "x.png").write_bytes((src / "red" / "000.jpg").read_bytes())
    (src / "README.txt").write_text("about these photos")
    (src / "blue" / ".thumbs").mkdir()
    (src / "blue" / ".thumbs" / "t.png").write_bytes(b"x")
    report, _ = ingest(src, tmp_path)
    skipped = {s["path"]: s["reason"] for s in report["skipped"]}
    assert skipped == {
        ".cache": "hidden",
        "README.txt": "not in a class sub-folder",
        "red/.DS_Store": "hidden",
        "blue/.thumbs": "hidden folder",
    }
    assert report["files_found"] == 6 + 4
    assert report["accepted"] + report["skipped_count"] == report["files_found"]


def test_classes_without_an_accepted_image_are_named_with_why(tmp_path: Path) -> None:
    """An empty class folder, or one whose files all fail, is not a class of the model:
    the report says so, class by class, instead of leaving it to be noticed."""
    src = write_image_folder(tmp_path / "src", per_class=2)
    (src / "horse").mkdir()
    (src / "zebra").mkdir()
    (src / "zebra" / "broken.jpg").write_bytes(b"not an image")
    (src / "zebra" / "empty.png").write_bytes(b"")
    report, index = ingest(src, tmp_path)
    assert "horse" not in report["classes"] and "zebra" not in report["classes"]
    assert index["classes"] == report["classes"] and report["classes"]
    assert report["classes_dropped"] == [
        {"class": "horse", "reason": "no files in its folder"},
        {"class": "zebra", "reason": "none of its 2 files accepted (quarantined or duplicates)"},
    ]
    clean, _ = ingest(write_image_folder(tmp_path / "clean", per_class=2), tmp_path / "c")
    assert clean["classes_dropped"] == []


def test_ingest_workers_past_the_cores_are_capped_and_the_log_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`ingest.workers: 64` on 2 cores asked for a pool of one worker a chunk, up to 64."""
    import tasks.ingest.stage

    monkeypatch.setattr("tasks.runtime.processes.usable_cores", lambda: 2, raising=False)
    monkeypatch.setattr(tasks.ingest.stage, "CHUNK", 1)  # a chunk per file: 12 chunks
    asked: list[int] = []

    def threads(workers: int) -> ThreadPoolExecutor:
        asked.append(workers)
        return ThreadPoolExecutor(workers)  # the count asked is what this test is about

    monkeypatch.setattr(tasks.ingest.stage, "spawn_pool", threads)
    src = write_image_folder(tmp_path / "src", per_class=4)
    with caplog.at_level("WARNING", logger="tasks.runtime.processes"):
        report, _ = ingest(src, tmp_path, workers=64)
    assert asked == [2] and report["accepted"] == 12
    assert caplog.messages == [
        "ingest.workers is 64 but this process may use 2 cores: running 2 workers"
    ]


@pytest.mark.parametrize(
    ("limit", "named"),
    [
        ({"min_side": 10_000}, "ingest.min_side=10000"),
        ({"max_pixels": 100}, "ingest.max_pixels=100"),
        ({"max_file_mb": 0.0001}, "ingest.max_file_mb=0.0001"),
    ],
)
def test_a_limit_that_would_empty_the_set_is_refused_before_anything_is_rewritten(
    tmp_path: Path, limit: dict[str, object], named: str
) -> None:
    """`ingest.min_side: 10000` quarantined every image: the shard stage then rebuilt an
    empty set in place of the one in use, which validation failed only afterwards."""
    src = write_image_folder(tmp_path / "src", per_class=4)
    ingest(src, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(SetWouldBeLost) as error:
        ingest(src, tmp_path, **limit)
    assert str(error.value).startswith(
        f"ingest would keep 0 of 12 images: {named} quarantines 12 of them. Nothing was "
        "rewritten (the ingest index and data/shards are as they were); change that limit"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_limit_that_would_drop_a_class_is_refused_naming_it(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=4)  # sides of 20 to 60 px
    (src / "small").mkdir()
    for i, side in enumerate((10, 12)):
        Image.new("RGB", (side, side + 30), (i, 0, 0)).save(src / "small" / f"{i}.png")
    with pytest.raises(
        SetWouldBeLost,
        match=re.escape(
            "ingest would keep no image of class 'small' (2 files): ingest.min_side=16 "
            "quarantines 2 of them. Nothing was rewritten"
        ),
    ):
        ingest(src, tmp_path, min_side=16)
    assert not (tmp_path / "index.json").exists()
    report, _ = ingest(src, tmp_path, min_side=10)  # a limit some of them pass
    assert report["classes"] == ["blue", "green", "red", "small"]


def test_decompression_bomb_guard_stays_on() -> None:
    import tasks.ingest.stage  # noqa: F401  (importing the stage must not switch the guard off)

    assert Image.MAX_IMAGE_PIXELS is not None
    with pytest.raises(ImageRejected, match="decompression-bomb guard"):
        decode_rgb(_png_header_only(30_000, 30_000), max_pixels=10**12, min_side=1)


def flat_csv_source(tmp_path: Path, count: int = 4) -> tuple[Path, list[str]]:
    """A flat folder of ``count`` distinct PNGs; the CSV rows are for the caller to write."""
    src = tmp_path / "flat"
    src.mkdir()
    rng = np.random.default_rng(5)
    names = []
    for i in range(count):
        names.append(f"img_{i}.png")
        (src / names[-1]).write_bytes(encode(draw_shape(rng, "cross", (24, 24)), "PNG"))
    return src, names


def test_labels_csv_as_spreadsheets_save_it_and_errors_that_name_the_line(tmp_path: Path) -> None:
    src, names = flat_csv_source(tmp_path)
    rows = "".join(f"{name},{'odd' if i % 2 else 'even'}\r\n" for i, name in enumerate(names))
    csv_path = src / "labels.csv"
    csv_path.write_bytes("\ufeffpath,label\r\n".encode() + rows.encode())  # Excel's CSV UTF-8
    report, index = ingest(src, tmp_path, labels_csv=str(csv_path))
    assert index["classes"] == ["even", "odd"] and report["accepted"] == len(names)

    csv_path.write_bytes(b"path,label\n\n\nimg_0.png,even\n\nimg_1.png,\n")
    with pytest.raises(ValueError, match=rf"{csv_path}, line 6: empty `path` or `label`"):
        ingest(src, tmp_path, labels_csv=str(csv_path))

    csv_path.write_bytes("path,label\nimg_0.png,café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{csv_path}: not UTF-8 .*ingest.labels_csv"):
        ingest(src, tmp_path, labels_csv=str(csv_path))


def test_labels_csv_rows_that_cannot_be_ingested_are_named_by_line(tmp_path: Path) -> None:
    """A label no shard set can carry used to pass ingest and fail the shard stage after it
    had written shards; a path listed twice was reported as a duplicate of itself; a NUL
    byte in a path crashed ingest naming nothing; a header alone ingested nothing."""
    src, names = flat_csv_source(tmp_path)
    csv_path = src / "labels.csv"
    cases = {
        f'path,label\n{names[0]},a\n{names[1]},"new\nline"\n': r"line 4: label 'new\\nline': "
        "a class name cannot hold a line break",
        f"path,label\n{names[0]},a\n{names[1]},b\n{names[0]},b\n": rf"line 4: '{names[0]}' "
        "is listed already on line 2",
        "path,label\n": "lists no files",
    }
    for text, message in cases.items():
        csv_path.write_text(text)
        with pytest.raises(ValueError, match=rf"{csv_path}[,:] {message}"):
            ingest(src, tmp_path, labels_csv=str(csv_path))
    csv_path.write_text(f"path,label\n{names[0]},a\n{names[1]},b\nimg_\0.png,a\n")
    report, index = ingest(src, tmp_path, labels_csv=str(csv_path))
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons == {"img_\0.png": "file name holds a NUL byte: no file can be called that"}
    assert report["accepted"] == 2 and index["classes"] == ["a", "b"]
    csv_path.unlink()
    csv_path.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"{csv_path}: not a file \(ingest.labels_csv"):
        ingest(src, tmp_path, labels_csv=str(csv_path))


def test_a_labels_csv_path_spelled_another_way_inside_source_dir_is_the_same_file(
    tmp_path: Path,
) -> None:
    """``sub/../img_1.png`` names a file inside source_dir: it was quarantined as outside
    it (and counted as a file the CSV did not list); ``./img_0.png`` beside ``img_0.png``
    was two records of one file."""
    src, names = flat_csv_source(tmp_path)
    (src / "sub").mkdir()
    csv_path = src / "labels.csv"
    csv_path.write_text(
        f"path,label\n./{names[0]},a\nsub/../{names[1]},b\n{names[2]},a\n{names[3]},b\n"
    )
    report, index = ingest(src, tmp_path, labels_csv=str(csv_path))
    assert report["quarantined"] == [] and report["skipped"] == []
    assert sorted(r["path"] for r in index["records"]) == sorted(names)
    csv_path.write_text(f"path,label\n{names[0]},a\n./{names[0]},a\n")
    with pytest.raises(
        ValueError, match=rf"line 3: './{names[0]}' \('{names[0]}'\) is listed already on line 2"
    ):
        ingest(src, tmp_path, labels_csv=str(csv_path))


def test_a_class_spelled_composed_and_decomposed_is_one_class(tmp_path: Path) -> None:
    """``café`` as one code point (NFC) and as ``e`` + a combining accent (NFD, as macOS
    writes names) look alike everywhere: they made two classes of one, in folders and in a
    labels CSV alike."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    for i, folder in enumerate((composed, decomposed, "tea")):
        (src / folder).mkdir(parents=True)
        for j in range(2):
            image = encode(draw_shape(rng, "cross", (24, 24 + 2 * i + j)), "PNG")
            (src / folder / f"{j}.png").write_bytes(image)
    report, index = ingest(src, tmp_path)
    assert index["classes"] == [composed, "tea"] and report["accepted"] == 6
    assert {r["label"] for r in index["records"]} == {composed, "tea"}
    rows = f"{composed}/0.png,{decomposed}\n{decomposed}/0.png,{composed}\ntea/0.png,tea\n"
    (src / "labels.csv").write_text("path,label\n" + rows)
    _, index = ingest(src, tmp_path, labels_csv=str(src / "labels.csv"))
    assert index["classes"] == [composed, "tea"]


def test_files_a_labels_csv_leaves_out_are_accounted_as_skipped(tmp_path: Path) -> None:
    """With a labels CSV, a file of source_dir it did not list was in no count: a folder of
    nine images reported five found."""
    src, names = flat_csv_source(tmp_path)
    for folder, name, data in (
        ("extra", "more.png", (src / names[0]).read_bytes()),
        (".cache", "x.png", b"x"),
        (".kept", "listed.png", (src / names[3]).read_bytes()),
    ):
        (src / folder).mkdir()
        (src / folder / name).write_bytes(data)
    rows = f"{names[0]},a\n{names[1]},b\n.kept/listed.png,b\n"
    (src / "labels.csv").write_text("path,label\n" + rows)
    report, _ = ingest(src, tmp_path, labels_csv=str(src / "labels.csv"))
    assert report["accepted"] == 3 and report["files_found"] == 7
    assert {s["path"]: s["reason"] for s in report["skipped"]} == {
        ".cache": "hidden folder",
        "extra/more.png": "not listed in ingest.labels_csv",
        names[2]: "not listed in ingest.labels_csv",
        names[3]: "not listed in ingest.labels_csv",
    }


def test_a_class_folder_no_shard_set_can_name_is_quarantined_by_name(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    for bad in ("new\nline", "trailing ", "tab\there"):
        (src / bad).mkdir()
        (src / bad / "x.png").write_bytes((src / "red" / "001.png").read_bytes()[:-8])
    report, index = ingest(src, tmp_path)
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons["new\nline/x.png"] == (
        "class folder 'new\\nline': a class name cannot hold a line break or a control "
        "character; rename it"
    )
    assert reasons["trailing /x.png"].endswith("cannot start or end with a space; rename it")
    assert reasons["tab\there/x.png"].startswith("class folder 'tab\\there'")
    assert index["classes"] == ["blue", "green", "red"] and report["accepted"] == 6
    assert {d["class"] for d in report["classes_dropped"]} == {
        "new\nline",
        "trailing ",
        "tab\there",
    }


def test_a_linked_class_folder_is_skipped_not_followed(tmp_path: Path) -> None:
    """A link to a class folder made a second class of the same files: every one of them
    was quarantined as a duplicate with conflicting labels, and both classes were lost."""
    src = write_image_folder(tmp_path / "src", per_class=3)
    (src / "crimson").symlink_to(src / "red", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (src / "outside").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    report, index = ingest(src, tmp_path)
    assert index["classes"] == ["blue", "green", "red"] and report["accepted"] == 9
    skipped = {s["path"]: s["reason"] for s in report["skipped"]}
    assert skipped == {
        f"{name}/": "a link to a folder: a class is a real folder (links are not followed)"
        for name in ("crimson", "outside")
    }
    assert report["quarantined"] == [] and report["files_found"] == 11


def test_a_rerun_that_changes_no_verdict_writes_the_same_report(tmp_path: Path) -> None:
    """Evaluate depends on reports/ingest.json (the model card sums it up). It held how the
    run got its verdicts (decoded, reused, stat-trusted), so any ingest rerun (a param that
    changes no verdict, a file moved out and back) re-evaluated the same model; those counts
    are the run's return and log line, not the report's."""
    src = write_image_folder(tmp_path / "src", per_class=3)
    first, _ = ingest(src, tmp_path)
    written = (tmp_path / "ingest.json").read_bytes()
    second, _ = ingest(src, tmp_path, handoff_mb=1)
    assert (first["decoded_count"], second["reused_count"]) == (9, 9)
    assert (tmp_path / "ingest.json").read_bytes() == written
    assert "reused_count" not in json.loads(written)


def test_a_source_dir_that_is_a_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "photos").write_text("not a folder")
    with pytest.raises(FileNotFoundError, match=r"photos: not a folder \(ingest.source_dir"):
        ingest(tmp_path / "photos", tmp_path)


def test_an_unreadable_folder_is_reported_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    locked = src / "red" / "locked"
    locked.mkdir()
    (locked / "x.png").write_bytes((src / "red" / "001.png").read_bytes())
    scandir = os.scandir

    def refuse_locked(path: str) -> object:  # as chmod 000 does, for a user without root
        if os.fspath(path) == os.fspath(locked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse_locked)
    report, index = ingest(src, tmp_path)
    skipped = {s["path"]: s["reason"] for s in report["skipped"]}
    assert skipped == {"red/locked/": "unreadable folder, its files not listed: Permission denied"}
    assert report["accepted"] == 6 and len(index["records"]) == 6
    assert report["files_found"] == report["accepted"] + report["skipped_count"]


def test_a_dropped_class_with_a_non_utf8_name_stays_valid_json(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    folder = os.fsencode(src) + b"/caf\xe9"
    os.mkdir(folder)
    with open(folder + b"/one.png", "wb") as handle:
        handle.write((src / "red" / "001.png").read_bytes())
    report, _ = ingest(src, tmp_path)
    assert {
        "class": "caf\\xe9",
        "reason": "none of its 1 files accepted (quarantined or duplicates)",
    } in report["classes_dropped"]
    (tmp_path / "ingest.json").read_bytes().decode("utf-8", "strict")


def test_the_check_feeds_the_decoder_the_whole_file_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A JPEG of several 64 KiB blocks is decoded from one piece (a decoder suspended at
    each of Pillow's reads starts its MCU again), a larger file in bounded pieces; the
    check's verdict and hash are those of the chunked decode, and a cut file is refused."""
    from tasks.contracts.near_duplicates import perceptual_hash
    from tasks.ingest.inspection import check_image

    noise = np.random.default_rng(4).integers(0, 256, (600, 800, 3), dtype=np.uint8)
    data = encode(Image.fromarray(noise), "JPEG", quality=95)
    assert len(data) > 4 * 65536
    feeds: list[int] = []
    getdecoder = Image._getdecoder

    class Counting:
        def __init__(self, decoder: object) -> None:
            self.decoder = decoder

        def decode(self, buffer: bytes) -> tuple[int, int]:
            feeds.append(len(buffer))
            return self.decoder.decode(buffer)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.decoder, name)

    monkeypatch.setattr(Image, "_getdecoder", lambda *a, **k: Counting(getdecoder(*a, **k)))
    fmt, width, height, phash, _ = check_image(data, max_pixels=10**7, min_side=8, draft=True)
    assert (fmt, width, height) == ("JPEG", 800, 600)
    assert len(feeds) == 1 and feeds[0] > 4 * 65536
    feeds.clear()  # a file past the block (8 MiB) goes in blocks: one copy of at most that
    monkeypatch.setattr("tasks.ingest.inspection.DECODER_BLOCK", 100_000)
    check_image(data, max_pixels=10**7, min_side=8, draft=True)
    assert len(feeds) > 1 and 100_000 <= max(feeds) < 2 * 100_000  # (+ what the last left)
    monkeypatch.setattr(Image, "_getdecoder", getdecoder)
    chunked = Image.open(io.BytesIO(data))
    chunked.draft(None, (100, 75))
    assert phash == perceptual_hash(chunked.convert("RGB"))
    with pytest.raises(ImageRejected, match="truncated or corrupt"):
        check_image(data[: len(data) * 3 // 4], max_pixels=10**7, min_side=8, draft=True)


def test_label_conflicts_are_one_line_pointing_at_the_report() -> None:
    """One warning a group filled twenty lines of `make run`."""
    from flows.ingest import label_conflicts_line

    groups = [{"labels": ["a", "b"], "split": "train", "paths": ["a/1.png", "b/1.png"]}] * 20
    line = label_conflicts_line({"near_duplicates": {"label_conflicts": groups}})
    assert line is not None and line.startswith("20 group(s) of near-duplicate images")
    assert "reports/ingest.json" in line and "\n" not in line
    assert label_conflicts_line({"near_duplicates": {"label_conflicts": []}}) is None
