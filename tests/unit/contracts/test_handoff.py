"""The decode hand-off: ingest's decodes reused by the shard stage, never another record."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks import images
from tasks.contracts import handoff
from tasks.ingest import stage as ingest
from tasks.ingest.stage import handoff_shares, run_ingest
from tasks.runtime.params import IngestParams, ShardParams, default_params
from tasks.shard import spec
from tasks.shard.stage import shard_stage

CLASSES = ("sea", "wood")

# The tests of the hand-off itself use small images, whose decodes ingest would otherwise not
# keep (their entries cost more than the decodes they save): they keep every decode.
keeps_every_decode = pytest.mark.usefixtures("every_decode_handed_off")


def photo(width: int, height: int, seed: int, *, mode: str = "RGB") -> Image.Image:
    """Smooth colour with noise: JPEG-like content whose DCT scaling is not trivial."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 200 // width, y * 200 // height, (x + y) % 256], axis=-1)
    noisy = base + rng.integers(-30, 31, (height, width, 3))
    image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), mode="RGB")
    return image.convert(mode)


def write_sources(root: Path) -> Path:
    """Per class: photos whose 1/8 draft is the scale a 64 px shard decodes at (hits), one
    rotated by EXIF, a grey one, a small JPEG whose scales differ (a miss), PNGs."""
    for c, label in enumerate(CLASSES):
        folder = root / label
        folder.mkdir(parents=True)
        for i in range(3):
            photo(800 + 8 * i, 600, 10 * c + i).save(folder / f"big{i}.jpg", quality=90)
        exif = Image.Exif()
        exif[images.ORIENTATION_TAG] = 6
        photo(640, 480, 10 * c + 5).save(folder / "turned.jpg", quality=90, exif=exif)
        photo(640, 480, 10 * c + 6, mode="L").save(folder / "grey.jpg", quality=90)
        photo(120, 90, 10 * c + 7).save(folder / "small.jpg", quality=90)
        photo(90, 70, 10 * c + 8, mode="RGBA").save(folder / "alpha.png")
        photo(100, 80, 10 * c + 9).save(folder / "plain.png")
    return root


def ingest_params(source: Path, **changes: object) -> IngestParams:
    values = {
        "source_dir": str(source),
        "splits": {"train": 0.5, "val": 0.25, "test": 0.25},
        "workers": 1,
        **changes,
    }
    return default_params(ingest=values).ingest


def shard_params(size: int) -> ShardParams:
    values = {"image_size": [size, size], "target_shard_mb": 0.05, "workers": 1}
    return default_params(shard=values).shard


def ingest_for(
    size: int, source: Path, index: Path, kept: Path | None, **changes: object
) -> dict[str, object]:
    """Ingest ``source`` keeping the pixels of ``size`` px records (the shard params' target)."""
    target = handoff.Target.of(shard_params(size))
    report = index.with_name(index.stem + "-ingest.json")
    return run_ingest(ingest_params(source, **changes), index, report, handoff=kept, target=target)


def digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.px")) if root.exists() else []


@pytest.fixture
def counted_decodes(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many full decodes (tasks.images.load_oriented, the step of ingest's and the shard
    stage's) ran since the fixture started."""
    images.preprocessing_version()  # its probe decodes: done before counting
    calls = [0]
    real = images.load_oriented

    def counting(image: Image.Image) -> float:
        calls[0] += 1
        return real(image)

    monkeypatch.setattr(images, "load_oriented", counting)
    return lambda: calls[0]


@pytest.fixture
def counted_resizes(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many resizes (tasks.images.resize_image) the shard stage ran since the fixture
    started (ingest's, made through tasks.contracts.handoff, are not counted)."""
    calls = [0]
    real = images.resize_image

    def counting(image: Image.Image, size: tuple[int, int], policy: str) -> np.ndarray:
        calls[0] += 1
        return real(image, size, policy)

    monkeypatch.setattr(images, "resize_image", counting)
    monkeypatch.setattr(spec, "resize_image", counting, raising=False)
    return lambda: calls[0]


@pytest.fixture
def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The source files the shard stage reads and hashes (tasks.shard.spec.read_checked)."""
    read: list[Path] = []
    real = spec.read_checked

    def counting(path: Path, sha256: str) -> bytes:
        read.append(path)
        return real(path, sha256)

    monkeypatch.setattr(spec, "read_checked", counting)
    return read


def trust_files_written_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written a moment before ingest count as unchanged while their stat is: no
    margin against writes in the tick of the stat (the test writes none)."""
    monkeypatch.setattr(ingest, "RACE_MARGIN_NS", 0)


@keeps_every_decode
@pytest.mark.parametrize(
    ("size", "hits", "trusted", "reads"),
    [(64, 14, False, 16), (64, 14, True, 2), (224, 4, True, 12)],
)
def test_shards_are_byte_identical_with_a_warm_handoff_or_none(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    counted_decodes: Callable[[], int],
    counted_resizes: Callable[[], int],
    counted_reads: list[Path],
    size: int,
    hits: int,
    trusted: bool,
    reads: int,
) -> None:
    """At 64 px the big, turned and grey JPEGs (1/8 both sides) and the PNGs hit, the small
    JPEG (decoded at another scale) is not kept; at 224 px only the PNGs are. Same shard
    bytes either way. A hit is neither decoded nor resized by the shard stage (ingest made
    its pixels); where the stat vouches for it, the stage reads no file either."""
    if trusted:
        trust_files_written_now(monkeypatch)
    source = write_sources(tmp_path / "images")
    kept = tmp_path / ".shardflow" / "handoff"
    index = tmp_path / "index.json"
    report = ingest_for(size, source, index, kept)
    assert report["accepted"] == 16 and len(entries(kept)) == hits
    params = shard_params(size)

    before = counted_decodes()
    shard_stage(params, index, tmp_path / "warm", handoff=kept)
    warm_decodes, warm_reads = counted_decodes() - before, len(counted_reads)
    assert counted_resizes() == 16 - hits
    shard_stage(params, index, tmp_path / "cold")
    cold_decodes = counted_decodes() - before - warm_decodes

    assert digests(tmp_path / "warm") == digests(tmp_path / "cold")
    assert cold_decodes == 16 and len(counted_reads) - warm_reads == 16
    assert warm_decodes == 16 - hits  # each hit is a decode the stage did not do
    assert warm_reads == reads
    assert entries(kept) == [] and not kept.exists()  # used, and the rest removed


@keeps_every_decode
def test_a_file_changed_after_ingest_is_refused_with_a_handoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept decode whose file was rewritten since ingest is not used: the stat no longer
    vouches for the bytes, the file is read and the stage fails naming it, as without."""
    trust_files_written_now(monkeypatch)
    source = write_sources(tmp_path / "images")
    kept = tmp_path / "handoff"
    index = tmp_path / "index.json"
    ingest_for(64, source, index, kept)
    photo(800, 600, 77).save(source / "sea" / "big0.jpg", quality=90)
    with pytest.raises(ValueError, match=r"big0\.jpg: content changed since ingest"):
        shard_stage(shard_params(64), index, tmp_path / "shards", handoff=kept)


@keeps_every_decode
@pytest.mark.parametrize(("size", "policy"), [(48, "pad"), (64, "crop"), (64, "stretch")])
def test_pixels_made_for_other_shard_params_are_never_used(
    tmp_path: Path, counted_decodes: Callable[[], int], size: int, policy: str
) -> None:
    """Ingest made 64 px letterboxed pixels; the shard params changed before the shard stage
    ran (another size, another resize policy): every record is decoded, none of the kept
    pixels is used, and the entries are gone after the stage."""
    source = write_sources(tmp_path / "images")
    kept = tmp_path / "handoff"
    index = tmp_path / "index.json"
    ingest_for(64, source, index, kept)
    assert len(entries(kept)) == 14
    params = shard_params(size).model_copy(update={"resize": policy})

    before = counted_decodes()
    shard_stage(params, index, tmp_path / "warm", handoff=kept)
    assert counted_decodes() - before == 16
    assert not kept.exists()
    shard_stage(params, index, tmp_path / "cold")
    assert digests(tmp_path / "warm") == digests(tmp_path / "cold")


@keeps_every_decode
def test_an_entry_whose_target_was_altered_is_not_used(tmp_path: Path) -> None:
    """The target an entry was made for is under its checksum: letterboxed pixels whose
    policy byte was changed to the shard stage's ``crop`` are decoded instead, never
    encoded as a cropped record."""
    source = write_sources(tmp_path / "images")
    kept = tmp_path / "handoff"
    index = tmp_path / "index.json"
    ingest_for(64, source, index, kept)
    policy_at = len(handoff.MAGIC) + 32 + 4 + 4  # after the sha256, height and width
    for entry in entries(kept):
        data = bytearray(entry.read_bytes())
        assert data[policy_at] == images.RESIZE_POLICIES.index("pad")
        data[policy_at] = images.RESIZE_POLICIES.index("crop")
        entry.write_bytes(bytes(data))
    params = shard_params(64).model_copy(update={"resize": "crop"})

    shard_stage(params, index, tmp_path / "warm", handoff=kept)
    shard_stage(params, index, tmp_path / "cold")
    assert digests(tmp_path / "warm") == digests(tmp_path / "cold")


@keeps_every_decode
def test_a_corrupt_entry_falls_back_to_decoding(tmp_path: Path) -> None:
    """Inverted pixel bytes, a truncated entry, a foreign header, another image's entry under
    this name: each record is decoded instead, and the shards are those of no hand-off."""
    source = write_sources(tmp_path / "images")
    kept = tmp_path / "handoff"
    index = tmp_path / "index.json"
    ingest_for(64, source, index, kept)
    assert len(entries(kept)) == 14

    def entry_of(name: str) -> Path:
        digest = hashlib.sha256((source / name).read_bytes()).hexdigest()
        return handoff.entry_path(entries(kept)[0].parent, digest)

    # wood/alpha.png's pixels are sea/alpha.png's size: only the content hash tells them apart
    names = ("sea/big0.jpg", "sea/big1.jpg", "sea/plain.png", "sea/alpha.png", "wood/alpha.png")
    flipped, truncated, foreign, swapped, other = (entry_of(name) for name in names)
    data = bytearray(flipped.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 600] = bytes(255 - v for v in data[middle : middle + 600])
    flipped.write_bytes(bytes(data))  # same length, header intact: only the checksum tells
    truncated.write_bytes(truncated.read_bytes()[:-3])
    foreign.write_bytes(b"not an entry at all" + foreign.read_bytes()[19:])
    swapped.write_bytes(other.read_bytes())  # a whole entry, of other content
    params = shard_params(64)

    shard_stage(params, index, tmp_path / "warm", handoff=kept)
    shard_stage(params, index, tmp_path / "cold")
    assert digests(tmp_path / "warm") == digests(tmp_path / "cold")


@keeps_every_decode
def test_the_bound_is_respected(tmp_path: Path) -> None:
    """Ingest keeps no more than ``ingest.handoff_mb``; the shares of spawned workers and of
    ingest itself add up to at most the bound."""
    source = write_sources(tmp_path / "images")
    kept = tmp_path / "handoff"
    entry = handoff.Target.of(shard_params(64)).entry_bytes / 2**20  # 64 px: about 12 KB
    bound = round(3.5 * entry, 6)
    ingest_for(64, source, tmp_path / "index.json", kept, handoff_mb=bound)
    held = sum(p.stat().st_size for p in entries(kept))
    assert 0 < held <= bound * 2**20
    assert len(entries(kept)) == 3

    ingest_for(64, source, tmp_path / "index0.json", kept, handoff_mb=0)
    assert entries(kept) == []  # the earlier run's entries went, and none were added

    for budget, chunks, workers in [(1000, [64, 64, 7], 2), (10, [1, 1], 4), (999, [64], 1)]:
        shares = handoff_shares(budget, chunks, True, workers)
        assert len(shares) == len(chunks) + 1 and sum(shares) <= budget
        assert min(shares) >= 0
    assert handoff_shares(1000, [64, 64], False, 2) == [0, 0, 1000]


@keeps_every_decode
def test_the_stage_leaves_no_entry_behind(tmp_path: Path) -> None:
    """After the stage the hand-off is empty: entries it used, entries it had no use for
    (another decoder's folder, content not in the plan), and ingest clears the last run's."""
    source = write_sources(tmp_path / "images")
    kept = tmp_path / "handoff"
    stale = handoff.folder_for(kept, "another-version")
    stale.mkdir(parents=True)
    (stale / f"{'0' * 64}.px").write_bytes(b"x" * 100)
    index = tmp_path / "index.json"
    ingest_for(64, source, index, kept)
    assert not stale.exists()  # ingest starts from an empty hand-off
    stale.mkdir(parents=True)
    (stale / f"{'0' * 64}.px").write_bytes(b"x" * 100)
    unknown = handoff.entry_path(handoff.folder_for(kept, images.preprocessing_version()), "f" * 64)
    unknown.write_bytes(b"y" * 100)

    shard_stage(shard_params(64), index, tmp_path / "shards", handoff=kept)
    assert not kept.exists()


@keeps_every_decode
def test_bad_files_are_quarantined_with_reasons_and_never_handed_off(tmp_path: Path) -> None:
    """A truncated JPEG, a non-image and an empty file are quarantined with their reasons;
    found = accepted + quarantined + duplicates + skipped; only accepted content is kept."""
    source = write_sources(tmp_path / "images")
    whole = io.BytesIO()
    photo(800, 600, 99).save(whole, format="JPEG", quality=90)
    (source / "sea" / "cut.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])
    (source / "sea" / "notes.jpg").write_bytes(b"these are not pixels")
    (source / "wood" / "empty.png").write_bytes(b"")
    (source / "wood" / "again.png").write_bytes((source / "wood" / "plain.png").read_bytes())
    kept = tmp_path / "handoff"
    report = ingest_for(64, source, tmp_path / "index.json", kept)
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert set(reasons) == {"sea/cut.jpg", "sea/notes.jpg", "wood/empty.png"}
    assert "truncated or corrupt" in reasons["sea/cut.jpg"]
    assert "not an image" in reasons["sea/notes.jpg"]
    assert "empty file" in reasons["wood/empty.png"]
    assert report["duplicate_count"] == 1
    accounted = sum(
        report[k] for k in ("accepted", "quarantined_count", "duplicate_count", "skipped_count")
    )
    assert accounted == report["files_found"] == 20
    bad = hashlib.sha256((source / "sea" / "cut.jpg").read_bytes()).hexdigest()
    assert {p.stem for p in entries(kept)} == {
        hashlib.sha256(p.read_bytes()).hexdigest()
        for p in source.rglob("*")
        if p.is_file() and p.stat().st_size and p.name not in ("notes.jpg", "small.jpg")
    } - {bad}


def test_only_decodes_worth_their_entry_are_kept(
    tmp_path: Path, counted_decodes: Callable[[], int]
) -> None:
    """With the cost model as it ships, ingest keeps a camera-sized photo's decode and not a
    thumbnail's or a small PNG's (writing, reading and removing their entries costs more
    than decoding them again); the shards are those of no hand-off either way."""
    source = tmp_path / "images"
    for c, label in enumerate(CLASSES):
        folder = source / label
        folder.mkdir(parents=True)
        photo(1600, 1200, 10 * c).save(folder / "photo.jpg", quality=90)
        photo(120, 90, 10 * c + 1).save(folder / "thumb.jpg", quality=90)
        photo(300, 200, 10 * c + 2).save(folder / "thumb.png")
    kept = tmp_path / "handoff"
    index = tmp_path / "index.json"
    report = ingest_for(64, source, index, kept)
    assert report["accepted"] == 6
    photos = {
        hashlib.sha256((source / label / "photo.jpg").read_bytes()).hexdigest() for label in CLASSES
    }
    assert {p.stem for p in entries(kept)} == photos

    before = counted_decodes()
    shard_stage(shard_params(64), index, tmp_path / "warm", handoff=kept)
    assert counted_decodes() - before == 4  # the thumbnails, decoded again
    shard_stage(shard_params(64), index, tmp_path / "cold")
    assert digests(tmp_path / "warm") == digests(tmp_path / "cold")


def test_a_decode_is_handed_off_where_it_saves_more_than_its_entry_costs() -> None:
    """Camera photos (2 and 12 MP, their 1/8 decodes as entries) are kept, thumbnails are
    not; a larger entry for the same pixels needs more saving."""
    assert handoff.worth_handing_off(4000 * 3000, 500 * 375 * 3)
    assert handoff.worth_handing_off(1600 * 1200, 200 * 150 * 3)
    assert not handoff.worth_handing_off(300 * 200, 300 * 200 * 3)  # a PNG, kept whole
    assert not handoff.worth_handing_off(120 * 90, 120 * 90 * 3)
    pixels = 1000 * 750
    assert handoff.worth_handing_off(pixels, 1000)
    assert not handoff.worth_handing_off(pixels, 2**20)
