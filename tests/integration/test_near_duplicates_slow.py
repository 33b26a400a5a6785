"""Near duplicates on real photos and through the stages: the demo data, the default distance on
edited photos, an append and a compaction (the grouping itself:
tests/unit/contracts/test_near_duplicates.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.near_duplicates import look_alike_hashes as look_alikes
from bench.near_duplicates import measure_confirmation, measure_threshold
from tasks.contracts.near_duplicates import Item, near_components, place, straddling_pairs
from tasks.ingest.demo_data import generate
from tasks.ingest.stage import run_ingest
from tasks.runtime.params import default_params
from tests.unit.contracts.test_near_duplicates import DISTANCE, EVEN, GREY, jpeg, photo, sha, write

pytestmark = pytest.mark.slow


def test_the_default_distance_groups_light_edits_and_separates_other_photos() -> None:
    """The measurement behind ``ingest.near_duplicate_distance`` (also ``python -m bench
    --only near_duplicates``): scikit-image's photos through ingest's own decode."""
    measured = measure_threshold()
    assert measured["max_light_edit_bits"] <= DISTANCE
    assert measured["min_other_position_bits"] > DISTANCE
    assert measured["min_different_photo_bits"] > DISTANCE


def test_the_demo_data_has_no_near_duplicates(tmp_path: Path) -> None:
    generate(tmp_path / "demo")
    params = default_params(ingest={"source_dir": str(tmp_path / "demo"), "workers": 1})
    report = run_ingest(params.ingest, tmp_path / "index.json", tmp_path / "ingest.json")
    assert report["accepted"] > 2900
    assert report["near_duplicates"]["groups"] == []


def test_the_second_check_confirms_planted_copies_and_refuses_look_alikes() -> None:
    """A slice of the images that ship with the packages (scikit-learn's digits and sample
    photos, scikit-image's photos, glyphs in Matplotlib's fonts), through ingest's own
    check: at least 95% of the planted copies (resized, re-encoded, cropped, with and
    without alpha) are near, at most 5% of the distinct pairs the hash makes candidates."""
    measured = measure_confirmation(DISTANCE, scale=6)

    candidates = sum(s["candidate_pairs"] for s in measured["sources"].values())
    assert candidates >= 100  # the hash alone would join that many distinct pictures
    assert measured["copies_confirmed_share"] >= 0.95
    assert measured["distinct_confirmed_share"] <= 0.05


def splits_in_shards(shards_dir: Path) -> dict[str, str]:
    """content hash -> the split whose shards hold it, read back from every shard file."""
    from tests.unit.shard.test_append import records_by_file

    return {
        digest: Path(file).name.split(".")[0]
        for file, rows in records_by_file(shards_dir).items()
        for digest, _ in rows
    }


def test_an_append_keeps_every_placement_and_compaction_keeps_every_split(tmp_path: Path) -> None:
    """A near-duplicate appended beside a sharded photo joins its split (the append is not
    refused as a move), and `make compact` (a rebuild of the index) keeps every split."""
    from tests.unit.shard.test_append import Project

    project = Project(tmp_path)
    image = photo("rocket")
    original = jpeg(image, 95)
    write(project.source / "red" / "rocket.jpg", original)
    project.update("rebuild")
    placed = splits_in_shards(project.shards)[sha(original)]
    copy = next(
        data for quality in range(40, 95) if sha(data := jpeg(image, quality)) < sha(original)
    )
    write(project.source / "red" / "rocket_copy.jpg", copy)

    project.update("append")
    appended = splits_in_shards(project.shards)
    assert appended[sha(original)] == appended[sha(copy)] == placed

    project.shard("rebuild")  # what `make compact` runs
    assert splits_in_shards(project.shards) == appended


def test_the_first_near_duplicate_a_run_finds_loads_no_more_code() -> None:
    """Grouping is plain NumPy: a run whose photos include a near pair imports nothing the
    index module had not (SciPy's graph package took 0.4 s of CPU the first time, a fixed
    cost that the data side's per-photo figure counted as photos)."""
    import subprocess
    import sys

    script = (
        "import sys, numpy as np\n"
        "from tasks.contracts.near_duplicates import near_components\n"
        "before = set(sys.modules)\n"
        "groups = near_components(np.array([5, 7, 2**64 - 1], dtype=np.uint64), 3)\n"
        "assert groups.tolist() == [0, 0, 2], groups\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_look_alike_images_group_in_bounded_memory() -> None:
    """6,000 hashes all within a few bits of each other (product shots on white, scans) make
    18 million near pairs: grouping them, placing them and re-checking their splits never
    holds those pairs (the all-pairs answer peaked at 1.9 GB)."""
    import tracemalloc

    hexes = [f"{int(h):016x}" for h in look_alikes(6000)]
    items = [Item(f"{k:064x}", f"c/{k}.jpg", "c", hexes[k], GREY) for k in range(len(hexes))]

    tracemalloc.start()
    try:
        placement = place(items, {}, DISTANCE, EVEN, seed=3)
        leaks = straddling_pairs(hexes, ["train"] * len(hexes), DISTANCE, [GREY] * len(hexes))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(placement.groups) == 1 and len(placement.groups[0]["paths"]) == 6000
    assert leaks == []
    assert peak < 600e6


def test_grouping_more_look_alikes_compares_no_more_pairs_per_photo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look-alike set pairs with itself (quadratic pairs), but grouping needs only enough
    of them to join the set: four times the look-alikes must not cost four times the
    comparisons per hash (every pair compared took minutes at 50,000)."""
    compared = [0]
    count_bits = np.bitwise_count

    def counted(values: np.ndarray) -> np.ndarray:
        compared[0] += values.size
        return count_bits(values)

    monkeypatch.setattr(np, "bitwise_count", counted)
    work = {}
    for count in (5_000, 20_000):
        compared[0] = 0
        assert set(near_components(look_alikes(count), DISTANCE).tolist()) == {0}
        work[count] = compared[0]
    assert work[20_000] <= 2 * work[5_000], work
