"""The bench's orchestration passes, each in processes of its own copy (the fast tests:
tests/unit/bench/test_bench.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench.images import CLASSES, generate_images, list_images
from tests.unit.bench.test_bench import REPO_ROOT

pytestmark = pytest.mark.slow


FAKE_DVC = """
import subprocess, sys, time
print("Running stage 'ingest':", flush=True)
# A stage process that outlives DVC and keeps the output stream open, as a hung stage does.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
time.sleep(120)
"""


def test_both_orchestration_passes_run_their_own_copys_compiled_code(tmp_path: Path) -> None:
    """The direct pass imports the code of its copy, as every stage of a `dvc repro` pass
    imports its copy's, and each copy starts with its bytecode, as a checkout has after its
    first run; neither side compiles what the other finds compiled."""
    from importlib.util import cache_from_source

    from bench.orchestration import _run_direct, copy_repo

    images = tmp_path / "images"
    (images / "circle").mkdir(parents=True)
    root = copy_repo(REPO_ROOT, tmp_path / "direct", images=images, overrides={})
    for module in (
        "tasks/ingest/stage.py",
        "tasks/shard/stage.py",
        "flows/train.py",
        "bench/stats.py",
    ):
        assert Path(cache_from_source(str(root / module))).is_file(), module
    seconds = _run_direct(root, [])  # raises when the pass ran other code than its copy's
    assert seconds["total"] >= seconds["(imports and exit)"] > 0


def test_generate_images_same_bytes_whatever_the_workers(tmp_path: Path) -> None:
    one = generate_images(tmp_path / "one", 12, min_size=16, max_size=24, workers=1)
    # Small chunks so the spawned pool really splits the work.
    again = generate_images(tmp_path / "again", 12, min_size=16, max_size=24, workers=2, chunk=5)
    files = [p.relative_to(one) for p, _ in list_images(one)]
    assert len(files) == 12
    assert {label for _, label in list_images(one)} == set(range(len(CLASSES)))
    for rel in files:
        assert (one / rel).read_bytes() == (again / rel).read_bytes()


def test_progressive_photos_are_the_same_pictures_as_progressive_jpegs(tmp_path: Path) -> None:
    """The photo bench's progressive set: the same picture and size as the baseline, saved
    progressive (what the data side's figure compares), and its data side is measured on
    both, photo by photo."""
    import io

    from PIL import Image

    from bench.photos import draw_photo, generate_photos, photo_files, progressive_data_side

    label, baseline = draw_photo(3, 96, 64)
    same_label, progressive = draw_photo(3, 96, 64, progressive=True)
    assert label == same_label
    with Image.open(io.BytesIO(baseline)) as one, Image.open(io.BytesIO(progressive)) as two:
        assert (one.size, two.size) == ((96, 64), (96, 64))
        assert not one.info.get("progressive") and two.info.get("progressive")
        difference = np.abs(np.asarray(one, np.int16) - np.asarray(two, np.int16))
        assert difference.mean() < 2  # the same picture: only the scan order differs
    folders = [
        generate_photos(tmp_path / kind, 3, 96, 64, workers=1, progressive=kind == "progressive")
        for kind in ("baseline", "progressive")
    ]
    base_files, progressive_files = (photo_files(f) for f in folders)
    with Image.open(progressive_files[0]) as image:
        assert image.info.get("progressive")
    result = progressive_data_side(base_files, progressive_files, 32)
    assert result["photos"] == 3
    assert result["ratio"] == pytest.approx(result["progressive_ms"] / result["baseline_ms"])
    with pytest.raises(ValueError, match="2 baseline and 3 progressive"):
        progressive_data_side(base_files[:2], progressive_files, 32)


def test_a_bench_copy_never_touches_the_folder_the_working_copys_params_name(
    tmp_path: Path,
) -> None:
    """A working copy whose params.yaml named its own photos by an absolute path lost them
    to the orchestration section: its copy emptied ``dest / source_dir``, which for an
    absolute ``source_dir`` is the user's folder itself, and linked the bench images in."""
    from bench.orchestration import COPY_SOURCE, copy_repo
    from tasks.runtime.params import load_params, shipped_params_text

    photos = tmp_path / "my photos"
    for label in ("cat", "dog"):
        (photos / label).mkdir(parents=True)
        (photos / label / "1.jpg").write_bytes(label.encode())
    before = sorted((p.relative_to(photos), p.read_bytes()) for p in photos.rglob("*.jpg"))
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text(
        shipped_params_text().replace("source_dir: data/demo", f"source_dir: {photos}", 1)
    )
    assert load_params(repo / "params.yaml").ingest.source_dir == str(photos)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    images = tmp_path / "images"
    (images / "circle").mkdir(parents=True)
    (images / "circle" / "0.jpg").write_bytes(b"bench")

    copy = copy_repo(repo, tmp_path / "copy", images=images, overrides={})

    assert sorted((p.relative_to(photos), p.read_bytes()) for p in photos.rglob("*.jpg")) == before
    assert load_params(copy / "params.yaml").ingest.source_dir == COPY_SOURCE
    assert (copy / COPY_SOURCE / "circle" / "0.jpg").read_bytes() == b"bench"


def test_a_hung_dvc_repro_is_killed_with_its_stages_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestration bench reads `dvc repro`'s output as it streams; a hung run (its
    stage holding the stream open) is killed, process group and all, at the timeout, and
    what it printed is kept with the second each line came, to tell where it hung."""
    import time

    import psutil

    from bench.orchestration import _run_dvc_repro

    fake = tmp_path / "fake" / "dvc"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_DVC)
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    # the writes before a pass (its fresh copy) reach the disk before it is timed
    synced: list[int] = []
    monkeypatch.setattr("bench.orchestration.os.sync", lambda: synced.append(len(synced)))
    before = {p.pid for p in psutil.process_iter()}
    start = time.perf_counter()
    transcript = tmp_path / "dvc-repro-pass-1.log"
    with pytest.raises(TimeoutError, match="ran past 3 s and was killed"):
        _run_dvc_repro("evaluate", tmp_path, timeout=3, transcript=transcript)
    assert synced == [0]
    assert time.perf_counter() - start < 30
    at, line = transcript.read_text().split(maxsplit=1)
    assert 0 < float(at) < 3 and line == "Running stage 'ingest':\n"
    time.sleep(0.5)
    left = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and "time.sleep(120)" in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []
