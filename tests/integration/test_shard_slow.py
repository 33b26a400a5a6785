"""The shard stage: resize policies, deterministic plans and bytes, resume, reading back."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tasks.contracts.index import load_index, write_index
from tasks.contracts.manifest import MANIFEST_NAME, file_sha256, load_manifest
from tasks.contracts.tf_reader import read_split
from tasks.images import resize_image
from tasks.ingest.stage import run_ingest
from tasks.runtime.params import default_params
from tasks.schema import HASH_KEY, LABEL_KEY
from tasks.shard.planning import plan_shards
from tasks.shard.stage import shard_stage
from tasks.shard.writing import write_shard
from tests.conftest import tiny_params, write_image_folder
from tests.shard_helpers import SIZE, TINY, digests, params

pytestmark = pytest.mark.slow

# -- resize ----------------------------------------------------------------------------------


def bands(width: int, height: int) -> Image.Image:
    """Three vertical bands: red | green | blue."""
    pixels = np.zeros((height, width, 3), np.uint8)
    third = width // 3
    pixels[:, :third, 0] = 255
    pixels[:, third : 2 * third, 1] = 255
    pixels[:, 2 * third :, 2] = 255
    return Image.fromarray(pixels, mode="RGB")


@pytest.mark.parametrize("policy", ["pad", "crop", "stretch"])
@pytest.mark.parametrize("source", [(90, 30), (30, 90), (7, 7), (200, 201)])
def test_resize_gives_target_shape(policy: str, source: tuple[int, int]) -> None:
    out = resize_image(bands(*source), (12, 20), policy)
    assert out.shape == (12, 20, 3) and out.dtype == np.uint8


def test_pad_letterboxes_wide_image_on_black() -> None:
    white = Image.new("RGB", (40, 10), (255, 255, 255))
    out = resize_image(white, (16, 16), "pad")
    assert out[:6].max() == 0 and out[-6:].max() == 0  # 16x4 image centred: 6 black rows each side
    assert out[6:10].min() == 255


def test_crop_keeps_the_centre_of_a_wide_image() -> None:
    out = resize_image(bands(90, 30), (16, 16), "crop")  # centre 30x30 is the green band
    assert out[..., 1].min() > 200 and out[..., 0].max() < 50 and out[..., 2].max() < 50


def test_stretch_keeps_every_band() -> None:
    out = resize_image(bands(90, 30), (16, 16), "stretch")
    assert out[:, 0, 0].min() > 200 and out[:, 8, 1].min() > 200 and out[:, -1, 2].min() > 200
    assert out.min(axis=(0, 1)).max() < 255  # no black border, no constant image
    assert not (out == 0).all(axis=-1).any()


# -- plan ------------------------------------------------------------------------------------


def test_plan_is_deterministic_and_covers_every_record(tiny_index: Path) -> None:
    index = load_index(tiny_index)
    first, second = list(plan_shards(params(), tiny_index)), list(plan_shards(params(), tiny_index))
    assert first == second
    planned = sorted(r.sha256 for spec in first for r in spec.records)
    assert planned == sorted(r["sha256"] for r in index["records"])
    for split in ("train", "val", "test"):
        specs = [s for s in first if s.split == split]
        assert len(specs) > 1, f"{split}: expected several shards at {TINY} MiB"
        assert [s.file for s in specs] == [
            f"{split}.tfrecord-{i:05d}-of-{len(specs):05d}" for i in range(len(specs))
        ]
        sizes = [len(s.records) for s in specs]
        assert max(sizes) - min(sizes) <= 1  # evenly cut
    assert pickle.loads(pickle.dumps(first[0])) == first[0]  # can ship to other processes


def test_plan_order_follows_the_seed(tiny_index: Path) -> None:
    order = [r.sha256 for s in plan_shards(params(seed=1), tiny_index) for r in s.records]
    other = [r.sha256 for s in plan_shards(params(seed=2), tiny_index) for r in s.records]
    assert sorted(order) == sorted(other) and order != other


def test_large_target_gives_one_shard_per_split(tiny_index: Path) -> None:
    specs = plan_shards(params(target_shard_mb=16.0), tiny_index)
    assert [(s.split, s.num_shards) for s in specs] == [("train", 1), ("val", 1), ("test", 1)]


def test_encoded_plans_are_deterministic(tiny_index: Path) -> None:
    index = load_index(tiny_index)
    for encoding in ("jpeg", "png"):
        specs = list(plan_shards(params(encoding=encoding, target_shard_mb=0.001), tiny_index))
        assert specs == list(
            plan_shards(params(encoding=encoding, target_shard_mb=0.001), tiny_index)
        )
        assert sum(len(s.records) for s in specs) == len(index["records"])


# -- writing ---------------------------------------------------------------------------------


def test_manifest_matches_index_and_files(tiny_index: Path, tmp_path: Path) -> None:
    index = load_index(tiny_index)
    manifest = shard_stage(params(), tiny_index, tmp_path).manifest
    assert load_manifest(tmp_path) == manifest
    assert manifest.classes == index["classes"]
    for split, info in manifest.splits.items():
        in_split = [r for r in index["records"] if r["split"] == split]
        assert info.num_records == len(in_split)
        expected = {c: sum(r["label"] == c for r in in_split) for c in index["classes"]}
        assert info.class_counts == expected
        for shard in info.shards:
            assert (tmp_path / shard.file).stat().st_size == shard.bytes
    names = {s.file for info in manifest.splits.values() for s in info.shards}
    assert {p.name for p in tmp_path.glob("*.tfrecord-*[0-9]")} == names


def test_shards_are_byte_identical_across_runs(tiny_index: Path, tmp_path: Path) -> None:
    """Across workers too: tests/flows/test_shard_runners.py runs the flow at 2 workers."""
    shard_stage(params(), tiny_index, tmp_path / "a")
    shard_stage(params(), tiny_index, tmp_path / "b")
    a = digests(tmp_path / "a")
    assert MANIFEST_NAME in a and len(a) > 5
    assert digests(tmp_path / "b") == a


def test_gzip_shards_are_deterministic_and_readable(tiny_index: Path, tmp_path: Path) -> None:
    manifest = shard_stage(params(compression="gzip"), tiny_index, tmp_path / "a").manifest
    shard_stage(params(compression="gzip"), tiny_index, tmp_path / "b")
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    shard = tmp_path / "a" / manifest.split("train").shards[0].file
    header = shard.read_bytes()[:10]
    assert header[:2] == b"\x1f\x8b" and header[4:8] == b"\0\0\0\0"  # gzip, no mtime stamped
    total = sum(
        int(b.shape[0])
        for b, _ in read_split(tmp_path / "a", "train", batch_size=4, training=False)
    )
    assert total == manifest.split("train").num_records


def test_write_shard_is_idempotent(tiny_index: Path, tmp_path: Path) -> None:
    spec = plan_shards(params(), tiny_index)[0]
    first = write_shard(spec, tmp_path)
    second = write_shard(spec, tmp_path)
    assert first == second and first.num_records == len(spec.records)
    assert [p.name for p in tmp_path.iterdir()] == [spec.file]  # no temporary left


def test_changed_plan_removes_stale_shards(tiny_index: Path, tmp_path: Path) -> None:
    shard_stage(params(), tiny_index, tmp_path)
    (tmp_path / f".{'x'}.tmp-1").write_bytes(b"junk")
    manifest = shard_stage(params(target_shard_mb=16.0), tiny_index, tmp_path).manifest
    names = {s.file for info in manifest.splits.values() for s in info.shards}
    assert {p.name for p in tmp_path.glob("*.tfrecord-*[0-9]")} == names
    assert len(names) == 3 and not list(tmp_path.glob(".*.tmp-*"))


def test_changed_source_fails_naming_the_file(tiny_index: Path, tmp_path: Path) -> None:
    index = load_index(tiny_index)
    record = index["records"][0]
    index["records"][0] = {**record, "sha256": "0" * 64}
    index_path = tmp_path / "index.json"
    write_index(index_path, index)
    with pytest.raises(ValueError, match=record["path"]):
        shard_stage(params(target_shard_mb=16.0), index_path, tmp_path / "shards")


def test_a_source_removed_since_ingest_is_named_with_the_fix(tmp_path: Path) -> None:
    """It was a bare FileNotFoundError from deep in a worker, where a changed file already
    said what had happened and what to do. The rebuild fails before it replaces anything:
    the set already there stays as it was."""
    source = write_image_folder(tmp_path / "images", per_class=4)
    index_path, shards = tmp_path / "index.json", tmp_path / "shards"
    run_ingest(tiny_params(source).ingest, index_path, tmp_path / "ingest.json")
    shard_stage(params(), index_path, shards)
    before = digests(shards)
    (source / "red" / "001.png").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"red/001\.png: no such file here: removed since ingest \(rerun ingest\)",
    ):
        shard_stage(params(target_shard_mb=16.0), index_path, shards)
    assert digests(shards) == before


def test_a_class_name_no_shard_set_can_carry_fails_before_any_shard(
    tiny_index: Path, tmp_path: Path
) -> None:
    """An index naming such a class (from ingest code that accepted it) failed at the TFDS
    files, after every shard was written over the last set and before its manifest."""
    index = load_index(tiny_index)
    renamed = {"red": "r\ned"}
    index["classes"] = [renamed.get(c, c) for c in index["classes"]]
    index["records"] = [
        {**r, "label": renamed.get(r["label"], r["label"])} for r in index["records"]
    ]
    index_path = tmp_path / "index.json"
    write_index(index_path, index)
    shards = tmp_path / "shards"
    with pytest.raises(
        ValueError, match=r"index\.json: class 'r\\ned': .*line break.*rerun ingest"
    ):
        shard_stage(params(), index_path, shards)
    assert not list(shards.glob("*.tfrecord*"))


# -- reading back ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written_shards(tiny_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shards_dir = tmp_path_factory.mktemp("written_shards")
    shard_stage(params(), tiny_index, shards_dir)
    return shards_dir


def test_read_split_training_has_static_batches(written_shards: Path) -> None:
    n = load_manifest(written_shards).split("train").num_records
    ds = read_split(written_shards, "train", batch_size=4, training=True, seed=0)
    images, labels = ds.element_spec
    assert images.shape.as_list() == [4, *SIZE, 3] and images.dtype == tf.uint8
    assert labels.shape.as_list() == [4] and labels.dtype == tf.int32
    assert int(ds.cardinality()) == n // 4
    assert sum(1 for _ in ds) == n // 4


def test_read_split_eval_yields_every_record_once(tiny_index: Path, written_shards: Path) -> None:
    index = load_index(tiny_index)
    for split in ("train", "val", "test"):
        expected = {r["sha256"]: r["label_index"] for r in index["records"] if r["split"] == split}
        ds = read_split(written_shards, split, batch_size=3, training=False, with_metadata=True)
        assert ds.element_spec["image"].shape.as_list() == [None, *SIZE, 3]
        assert int(ds.cardinality()) == math.ceil(len(expected) / 3)
        seen: list[tuple[str, int]] = []
        for batch in ds:
            hashes = [h.decode() for h in batch[HASH_KEY].numpy()]
            seen.extend(zip(hashes, batch[LABEL_KEY].numpy().tolist(), strict=True))
        assert len(seen) == len(expected)
        assert dict(seen) == expected


def test_damaged_shard_is_rewritten_not_reused(tiny_index: Path, tmp_path: Path) -> None:
    """Same plan, but a shard changed after the manifest recorded it: rewrite that shard."""
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1}
    ).shard
    shards_dir = tmp_path / "shards"
    first = shard_stage(params, tiny_index, shards_dir).manifest
    victim = shards_dir / first.splits["train"].shards[0].file
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    second = shard_stage(params, tiny_index, shards_dir).manifest
    assert second.fingerprint == first.fingerprint
    assert file_sha256(victim) == first.splits["train"].shards[0].sha256


# -- shards follow the code that makes them --------------------------------------------------


def test_changed_resize_filter_reshards_everything(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same index, same params, other pixels code: a new fingerprint and no shard kept."""
    from tasks import images

    shards_dir = tmp_path / "shards"
    first = shard_stage(params(), tiny_index, shards_dir).manifest
    old_version = first.preprocessing_version
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards_dir.glob("*.tfrecord-*[0-9]")}
    monkeypatch.setattr(images, "RESAMPLE", Image.Resampling.NEAREST)
    second = shard_stage(params(), tiny_index, shards_dir).manifest
    assert second.preprocessing_version != old_version
    assert second.fingerprint != first.fingerprint
    rewritten = {p.name: p.stat().st_mtime_ns for p in shards_dir.glob("*.tfrecord-*[0-9]")}
    assert rewritten.keys() == mtimes.keys()
    assert all(rewritten[name] != mtimes[name] for name in mtimes)
    manifest = json.loads((shards_dir / MANIFEST_NAME).read_text())
    assert manifest["preprocessing_version"] == images.preprocessing_version()
    assert manifest["resize"] == "pad"


def test_preprocessing_version_names_the_pixel_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    import PIL

    from tasks import images

    before = images.preprocessing_version()
    monkeypatch.setattr(PIL, "__version__", "0.0.1-other")
    assert images.preprocessing_version() != before


def test_preprocessing_version_is_probed_once_per_process_and_filter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shards reuse the probe's result; a filter swapped at run time is probed afresh."""
    from tasks import images

    probes: list[int] = []
    real = images._probe_images
    monkeypatch.setattr(images, "_probe_images", lambda: probes.append(1) or real())
    images._preprocessing_version.cache_clear()
    first = images.preprocessing_version()
    assert images.preprocessing_version() == first and len(probes) == 1
    monkeypatch.setattr(images, "RESAMPLE", Image.Resampling.NEAREST)
    assert images.preprocessing_version() != first and len(probes) == 2


def test_only_a_local_rebuild_with_workers_prestarts_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tasks.shard import workers as shard

    started: list[int] = []
    monkeypatch.setattr(shard, "prestart_pool", lambda n, warm: started.append(n))
    monkeypatch.setattr(
        "tasks.runtime.processes.usable_cores", lambda: 4, raising=False
    )  # whatever runs the test
    base = params().model_copy(update={"workers": 2})
    for update in ({"workers": 1}, {"mode": "append"}, {"runner": "dask"}):
        shard.prestart_workers(base.model_copy(update=update))
    assert started == []
    shard.prestart_workers(
        shard.run_params(base.model_copy(update={"mode": "append"}), compact=True)
    )
    shard.prestart_workers(base)
    assert started == [2, 2]


def test_local_shard_workers_past_the_cores_are_capped_and_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`shard.workers: 64` on 2 cores spawned 64 processes taking turns (each with its own
    memory); the shards do not depend on the count, so the run takes 2 and says why."""
    from tasks.shard import workers as shard

    monkeypatch.setattr("tasks.runtime.processes.usable_cores", lambda: 2, raising=False)
    started: list[int] = []
    monkeypatch.setattr(shard, "prestart_pool", lambda n, warm: started.append(n))
    many = params().model_copy(update={"workers": 64})
    with caplog.at_level("WARNING", logger="tasks.runtime.processes"):
        run = shard.run_params(many, compact=False)
        shard.prestart_workers(run)
    assert run.workers == 2 and started == [2]
    assert caplog.messages == [
        "shard.workers is 64 but this process may use 2 cores: running 2 workers"
    ]
    caplog.clear()
    assert shard.run_params(many.model_copy(update={"workers": 2}), compact=True).workers == 2
    dask = many.model_copy(update={"runner": "dask", "dask_address": "tcp://h:8786"})
    assert shard.run_params(dask, compact=False).workers == 64  # the cluster's, not ours
    assert caplog.messages == []


def test_the_stage_commands_prestart_leaves_the_cap_for_its_flow_to_say(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`python -m flows.shard` prestarts the capped workers before its flow starts, and the
    flow says why they are capped (in its run's log too): the terminal said it twice."""
    from tasks.shard import workers as shard

    monkeypatch.setattr("tasks.runtime.processes.usable_cores", lambda: 2, raising=False)
    started: list[int] = []
    monkeypatch.setattr(shard, "prestart_pool", lambda n, warm: started.append(n))
    many = params().model_copy(update={"workers": 64})
    with caplog.at_level("WARNING", logger="tasks.runtime.processes"):
        shard.prestart_stage_workers(many, compact=False)
    assert started == [2] and caplog.messages == []


def test_worker_with_other_preprocessing_refuses_to_write(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker (another machine, another Pillow) never writes pixels the plan does not name."""
    import dataclasses

    spec = plan_shards(params(), tiny_index)[0]
    stale = dataclasses.replace(spec, preprocessing_version="0" * 16)
    with pytest.raises(RuntimeError, match=f"{spec.file}: this worker's preprocessing version"):
        write_shard(stale, tmp_path)
    assert not list(tmp_path.iterdir())


def test_draft_decode_is_part_of_the_plan(tiny_index: Path) -> None:
    from tasks.shard.planning import plan_hash

    with_draft = plan_shards(params(draft_decode=True), tiny_index)
    without = plan_shards(params(draft_decode=False), tiny_index)
    assert plan_hash(with_draft) != plan_hash(without)


# -- a plan that stays small ------------------------------------------------------------------


def reference_order(index_path: Path, seed: int) -> dict[str, list[str]]:
    """Each split's paths in the documented order: seeded hash, then path (all in memory)."""
    from tasks.shard.planning import order_key

    records = load_index(index_path)["records"]
    return {
        split: [
            r["path"]
            for r in sorted(
                (r for r in records if r["split"] == split),
                key=lambda r: (order_key(seed, r["sha256"]), r["path"]),
            )
        ]
        for split in ("train", "val", "test")
    }


@pytest.mark.parametrize("offset_bits", [None, 62])
def test_streamed_plan_keeps_the_documented_order(
    tiny_index: Path, tmp_path: Path, offset_bits: int | None
) -> None:
    """62 offset bits leave 2 bits of order key: nearly every record ties and is re-sorted."""
    from tasks.contracts.index import read_records_at
    from tasks.shard.planning import scan_index

    index = load_index(tiny_index)
    twin = dict(index["records"][0], path="zz/duplicate.png")  # same content: a full-key tie
    index["records"].append(twin)
    index_path = tmp_path / "index.jsonl"
    write_index(index_path, index)
    scan = scan_index(params(seed=3), index_path, offset_bits=offset_bits)
    mask = (1 << scan.offset_bits) - 1
    planned = {
        split: [r["path"] for r in read_records_at(index_path, (int(v) & mask for v in order))]
        for split, order in scan.order.items()
    }
    assert planned == reference_order(index_path, 3)


def test_an_old_or_truncated_index_names_the_file_and_the_fix(
    tiny_index: Path, tmp_path: Path
) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 2, "records": []}, indent=2))
    with pytest.raises(ValueError, match=r"old\.json: not an ingest index.*rerun the ingest"):
        plan_shards(params(), old)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(tiny_index.read_bytes().splitlines(keepends=True)[:5]))
    with pytest.raises(ValueError, match=r"cut\.jsonl: \d+ records announced, file ends"):
        plan_shards(params(), cut)
