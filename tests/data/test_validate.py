"""Validation of real shard sets: a clean set passes, each kind of damage fails its named check."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.contracts.index import load_index, write_index
from tasks.contracts.manifest import (
    MANIFEST_NAME,
    ShardFile,
    ShardManifest,
    build_manifest,
    file_sha256,
)
from tasks.contracts.numpy_reader import iter_split, write_dali_index
from tasks.runtime.params import SplitFractions, default_params
from tasks.shard.stage import shard_stage
from tasks.tfrecord import (
    CorruptRecord,
    _masked_crc,
    _varint,
    decode_example,
    encode_example,
    frame_record,
    open_records,
    read_framed,
    record_offsets,
)
from tasks.validate.stage import ValidationFailed, raise_if_failed, run_validate

# Validation's TensorFlow cross-check runs in this process (tests/conftest.py): these tests
# are about what each check reports. The child itself is tested below with its own entry
# (`run_in_child` of tasks.runtime.processes, the prestarted child), which this leaves alone.
pytestmark = pytest.mark.usefixtures("tf_cross_check_in_process")

ALL_CHECKS = [
    "manifest",
    "files",
    "extra_files",
    "records",
    "tensorflow_parser",
    "coverage",
    "labels",
    "class_counts",
    "leakage",
    "index",
    "near_duplicates",
]


@pytest.fixture(scope="module")
def clean_shards(tiny_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shards_dir = tmp_path_factory.mktemp("clean") / "shards"
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1}
    ).shard
    shard_stage(params, tiny_index, shards_dir)
    return shards_dir


@pytest.fixture
def shards(clean_shards: Path, tmp_path: Path) -> Path:
    """A private copy of the clean shard set, free to damage."""
    return Path(shutil.copytree(clean_shards, tmp_path / "shards"))


def validate(shards_dir: Path, index: Path | None = None) -> dict[str, Any]:
    reports = shards_dir.parent / "reports"
    return run_validate(
        shards_dir, reports / "validation.json", reports / "validation.md", index_path=index
    )


def failed(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"] if not c["passed"]}


def load(shards_dir: Path) -> ShardManifest:
    return ShardManifest.model_validate_json((shards_dir / MANIFEST_NAME).read_text())


def save(shards_dir: Path, manifest: ShardManifest, *, refingerprint: bool) -> None:
    if refingerprint:
        manifest.fingerprint = manifest.compute_fingerprint()
    (shards_dir / MANIFEST_NAME).write_text(manifest.to_json())


def test_clean_set_passes_every_check(shards: Path, tiny_index: Path) -> None:
    report = validate(shards, tiny_index)
    manifest = load(shards)
    assert report["passed"] is True
    assert [c["name"] for c in report["checks"]] == ALL_CHECKS
    assert all(c["passed"] for c in report["checks"])
    assert report["fingerprint"] == manifest.fingerprint
    assert report["num_records"] == {s: i.num_records for s, i in manifest.splits.items()}
    on_disk = json.loads((shards.parent / "reports" / "validation.json").read_text())
    assert on_disk == report
    summary = (shards.parent / "reports" / "validation.md").read_text()
    assert "PASSED" in summary and "| records | pass |" in summary
    raise_if_failed(report)  # no exception


def test_a_split_left_empty_fails_validation_and_names_the_param(tmp_path: Path) -> None:
    """Each image's split is drawn from its content hash: 36 images at 0.98/0.01/0.01 leave
    val and test empty, which training and evaluation cannot use."""
    from tasks.contracts.tf_reader import read_split
    from tasks.ingest.stage import run_ingest
    from tests.conftest import write_image_folder

    source = write_image_folder(tmp_path / "images")
    params = default_params(
        ingest={
            "source_dir": str(source),
            "splits": {"train": 0.98, "val": 0.01, "test": 0.01},
            "workers": 1,
        },
        shard={"image_size": [16, 16], "workers": 1},
    )
    run_ingest(params.ingest, tmp_path / "index.json", tmp_path / "ingest.json")
    manifest = shard_stage(params.shard, tmp_path / "index.json", tmp_path / "shards").manifest
    assert {s: i.num_records for s, i in manifest.splits.items()} == {
        "train": 36,
        "val": 0,
        "test": 0,
    }
    report = validate(tmp_path / "shards")
    assert report["passed"] is False
    assert list(failed(report)) == ["coverage"]
    message = failed(report)["coverage"]["message"]
    assert "split 'val' holds no records; split 'test' holds no records (of 36 images" in message
    assert "ingest.splits" in message
    # Splits are class shares in whole images (tasks.contracts.near_duplicates.Quotas), not
    # a draw per image from its content hash, as the message said.
    assert "a class of fewer images than 1/fraction gives that split none" in message
    assert "content hash" not in message
    with pytest.raises(ValidationFailed, match="coverage"):
        raise_if_failed(report)
    # Read directly, the empty split names itself instead of failing inside tf.data.
    with pytest.raises(ValueError, match=r"shards: split 'val' holds no records"):
        read_split(tmp_path / "shards", "val", batch_size=4, training=False)


def test_a_class_with_no_train_records_fails_validation(tmp_path: Path) -> None:
    from tasks.ingest.stage import run_ingest
    from tests.conftest import write_image_folder

    source = write_image_folder(tmp_path / "images")
    splits = {"train": 0.5, "val": 0.25, "test": 0.25}  # as tiny_index: none empty
    params = default_params(
        ingest={"source_dir": str(source), "splits": splits, "workers": 1},
        shard={"image_size": [16, 16], "workers": 1},
    )
    index = tmp_path / "index.json"
    run_ingest(params.ingest, index, tmp_path / "ingest.json")
    # Keep only the red images that the content hash put outside train.
    in_train = [r["path"] for r in load_index(index)["records"] if r["split"] == "train"]
    removed = [path for path in in_train if path.startswith("red/")]
    assert removed
    for path in removed:
        (source / path).unlink()
    run_ingest(params.ingest, index, tmp_path / "ingest.json")
    shard_stage(params.shard, index, tmp_path / "shards")
    report = validate(tmp_path / "shards")
    assert list(failed(report)) == ["coverage"]
    assert failed(report)["coverage"]["details"]["examples"] == [
        {"split": "train", "class": "red", "records": 0}
    ]
    assert "class 'red' has no train records" in failed(report)["coverage"]["message"]


def test_a_single_class_fails_validation(tiny_dataset: Path, tmp_path: Path) -> None:
    """One class folder used to train a model that always answers it."""
    from tasks.ingest.stage import run_ingest

    for name in ("green", "red"):
        shutil.rmtree(tiny_dataset / name)
    splits = {"train": 0.5, "val": 0.25, "test": 0.25}
    params = default_params(
        ingest={"source_dir": str(tiny_dataset), "splits": splits, "workers": 1},
        shard={"image_size": [16, 16], "workers": 1},
    )
    run_ingest(params.ingest, tmp_path / "index.json", tmp_path / "ingest.json")
    shard_stage(params.shard, tmp_path / "index.json", tmp_path / "shards")
    report = validate(tmp_path / "shards")
    assert list(failed(report)) == ["coverage"]
    assert failed(report)["coverage"]["details"]["examples"] == [{"classes": ["blue"]}]
    assert "1 class(es) ['blue']: a classifier needs two" in failed(report)["coverage"]["message"]


@pytest.mark.parametrize("encoding", ["jpeg", "png"])
def test_encoded_clean_sets_pass(encoding: str, tiny_index: Path, tmp_path: Path) -> None:
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.001, "encoding": encoding, "workers": 1}
    ).shard
    manifest = shard_stage(params, tiny_index, tmp_path / "shards").manifest
    report = validate(tmp_path / "shards", tiny_index)
    assert report["passed"] is True, failed(report)
    records = next(c for c in report["checks"] if c["name"] == "records")
    assert records["details"]["records"] == sum(i.num_records for i in manifest.splits.values())


def test_flipped_byte_names_the_shard_and_record(shards: Path) -> None:
    target = load(shards).split("train").shards[1].file
    data = bytearray((shards / target).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (shards / target).write_bytes(bytes(data))

    report = validate(shards)
    bad = failed(report)
    assert report["passed"] is False
    assert target in bad["files"]["message"]
    corrupt = bad["records"]["details"]["examples"][0]
    assert corrupt["file"] == target and isinstance(corrupt["record_index"], int)
    assert corrupt["error"].startswith("CorruptRecord:") and "CRC mismatch" in corrupt["error"]
    assert "manifest" not in bad and "leakage" not in bad
    summary = (shards.parent / "reports" / "validation.md").read_text()
    assert "| files | **FAIL** |" in summary and target in summary
    with pytest.raises(ValidationFailed, match=rf"files: {target}"):
        raise_if_failed(report)


@pytest.mark.parametrize("where", ["middle", "deflate header"])
def test_flipped_byte_in_gzip_shard_is_located(
    tiny_index: Path, tmp_path: Path, where: str
) -> None:
    """A flip in the deflate stream's own header makes zlib fail (not a CRC): still a named,
    failed check, and the TensorFlow-free reader names the file too."""
    params = default_params(
        shard={
            "image_size": [16, 16],
            "target_shard_mb": 0.002,
            "workers": 1,
            "compression": "gzip",
        }
    ).shard
    manifest = shard_stage(params, tiny_index, tmp_path / "shards").manifest
    target = manifest.split("val").shards[0].file
    data = bytearray((tmp_path / "shards" / target).read_bytes())
    if where == "middle":
        data[len(data) // 2] ^= 0xFF
    else:
        data[12] ^= 0x10  # past the 10-byte GZIP header: the first deflate block's header
    (tmp_path / "shards" / target).write_bytes(bytes(data))
    bad = failed(validate(tmp_path / "shards"))
    assert bad["records"]["details"]["examples"][0]["file"] == target
    assert target in bad["files"]["message"]
    with pytest.raises(CorruptRecord, match=target):
        list(iter_split(tmp_path / "shards", "val"))


def test_truncated_shard_fails_files_and_records(shards: Path) -> None:
    target = load(shards).split("test").shards[0].file
    data = (shards / target).read_bytes()
    (shards / target).write_bytes(data[: len(data) - 10])
    bad = failed(validate(shards))
    assert "size" in bad["files"]["message"] and target in bad["files"]["message"]
    assert bad["records"]["details"]["examples"][0]["file"] == target


def test_hand_edited_counts_fail_manifest_and_class_counts(shards: Path) -> None:
    manifest = load(shards)
    counts = manifest.splits["train"].class_counts
    first, second = list(counts)[:2]
    counts[first] += 1
    counts[second] -= 1  # totals still add up: only the fingerprint and the data disagree
    save(shards, manifest, refingerprint=False)

    report = validate(shards)
    bad = failed(report)
    assert set(bad) == {"manifest", "class_counts"}
    assert "fingerprint" in bad["manifest"]["message"]
    assert f"train/{first}" in bad["class_counts"]["message"]
    with pytest.raises(ValidationFailed, match=r"manifest: .*class_counts: "):
        raise_if_failed(report)


def test_shard_count_off_by_one_fails_records(shards: Path) -> None:
    manifest = load(shards)
    shard = manifest.splits["val"].shards[0]
    manifest.splits["val"].shards[0] = shard.model_copy(
        update={"num_records": shard.num_records + 1}
    )
    manifest.splits["val"].num_records += 1
    first_class = manifest.classes[0]
    manifest.splits["val"].class_counts[first_class] += 1
    save(shards, manifest, refingerprint=True)  # self-consistent manifest, wrong about the data

    bad = failed(validate(shards))
    assert "records" in bad and "manifest" not in bad
    assert shard.file in bad["records"]["message"]


def test_split_leak_fails_leakage(shards: Path, tiny_index: Path) -> None:
    manifest = load(shards)
    leaked = manifest.splits["train"].shards[0]
    copy_name = "test.tfrecord-leaked"
    shutil.copyfile(shards / leaked.file, shards / copy_name)
    shutil.copyfile(shards / f"{leaked.file}.idx", shards / f"{copy_name}.idx")  # its framing
    splits = manifest.splits
    splits["test"].shards.append(
        ShardFile(
            file=copy_name,
            num_records=leaked.num_records,
            bytes=leaked.bytes,
            sha256=file_sha256(shards / copy_name),
        )
    )
    splits["test"].num_records += leaked.num_records
    splits["test"].class_counts = {
        name: splits["test"].class_counts[name] + _count(shards, leaked.file, i)
        for i, name in enumerate(manifest.classes)
    }
    rebuilt = build_manifest(
        manifest.record_schema,
        manifest.classes,
        "none",
        splits,
        resize=manifest.resize,
        draft_decode=manifest.draft_decode,
        preprocessing_version=manifest.preprocessing_version,
    )
    save(shards, rebuilt, refingerprint=False)
    (shards / "records.json").unlink()  # a manifest without generations lists no record list

    report = validate(shards)
    assert set(failed(report)) == {"leakage"}
    leak = failed(report)["leakage"]
    assert leak["details"]["leaks"] == leaked.num_records
    assert "leak across splits test/train" in {e["problem"] for e in leak["details"]["examples"]}
    assert "index" in failed(validate(shards, tiny_index))  # extra records vs the index
    with pytest.raises(ValidationFailed, match="leakage: "):
        raise_if_failed(report)


def _count(shards: Path, file: str, label: int) -> int:
    """Records of one class in one shard, read independently of the validator."""
    import tensorflow as tf

    schema = load(shards).record_schema
    ds = tf.data.TFRecordDataset(str(shards / file)).map(schema.parse_single)
    return sum(int(f["label"]) == label for f in ds)


def test_labels_out_of_range_are_reported(shards: Path) -> None:
    manifest = load(shards)
    dropped = manifest.classes[-1]
    for info in manifest.splits.values():
        del info.class_counts[dropped]
    truncated = build_manifest(
        manifest.record_schema,
        manifest.classes[:-1],
        "none",
        manifest.splits,
        resize=manifest.resize,
        draft_decode=manifest.draft_decode,
        preprocessing_version=manifest.preprocessing_version,
    )
    save(shards, truncated, refingerprint=False)
    bad = failed(validate(shards))
    assert "labels" in bad
    example = bad["labels"]["details"]["examples"][0]
    assert example["label"] == 2 and example["file"].endswith(tuple("012345678"))


def test_index_mismatch_names_the_record(shards: Path, tiny_index: Path, tmp_path: Path) -> None:
    index = load_index(tiny_index)
    record = next(r for r in index["records"] if r["split"] == "train")
    record["split"] = "val"
    edited = tmp_path / "index.json"
    write_index(edited, index)
    bad = failed(validate(shards, edited))
    assert set(bad) == {"index"}
    assert bad["index"]["details"]["examples"][0]["path"] == record["path"]


def test_missing_shard_and_missing_manifest(shards: Path) -> None:
    target = load(shards).split("train").shards[0].file
    (shards / target).unlink()
    bad = failed(validate(shards))
    assert f"{target}: missing" in bad["files"]["message"] and "records" in bad

    (shards / MANIFEST_NAME).unlink()
    report = validate(shards)  # a report, not an exception
    assert report["passed"] is False and set(failed(report)) == {"manifest"}
    with pytest.raises(ValidationFailed, match=r"manifest: .*no manifest"):
        raise_if_failed(report)


def test_files_the_manifest_does_not_list_fail_by_name(shards: Path, tiny_index: Path) -> None:
    """A shard copied in from another set, a stray generation folder or any other file: no
    record of the set accounts for them, yet they would be versioned and globbed with it."""
    train = load(shards).split("train").shards
    shutil.copy(shards / train[0].file, shards / "train.tfrecord-00099-of-00100")
    (shards / "gen-00007").mkdir()
    (shards / "gen-00007" / "records.json").write_text("[]")
    (shards / "notes.txt").write_text("kept here by hand")
    (shards / "more").symlink_to(shards.parent, target_is_directory=True)  # never followed
    report = validate(shards, tiny_index)
    assert report["passed"] is False and set(failed(report)) == {"extra_files"}
    check = failed(report)["extra_files"]
    assert check["details"]["examples"] == [
        "gen-00007/records.json",
        "more",
        "notes.txt",
        "train.tfrecord-00099-of-00100",
    ]
    assert "train.tfrecord-00099-of-00100" in check["message"] and "notes.txt" in check["message"]
    with pytest.raises(ValidationFailed, match=r"extra_files: .*does not account for"):
        raise_if_failed(report)


def test_an_appended_set_passes_with_every_generations_own_files(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    """Generation folders, their record lists and plan records are the set's own; TFDS files
    are not (several generations): left over from generation 0, they fail."""
    from tasks.ingest.stage import run_ingest
    from tests.unit.shard.test_append import add_images

    source = tiny_dataset  # a private folder: images are added to it
    splits = {"train": 0.5, "val": 0.25, "test": 0.25}
    ingest = default_params(
        ingest={"source_dir": str(source), "splits": splits, "workers": 1}
    ).ingest
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1}
    ).shard
    index, shards = tmp_path / "index.jsonl", tmp_path / "shards"
    run_ingest(ingest, index, tmp_path / "ingest.json")
    shard_stage(params, index, shards)
    tfds_file = (shards / "features.json").read_bytes()
    add_images(source, sorted(p.name for p in source.iterdir())[0], 4, seed=5)
    run_ingest(ingest, index, tmp_path / "ingest.json")
    shard_stage(params.model_copy(update={"mode": "append"}), index, shards)
    assert (shards / "gen-00001" / ".plan.json").exists()
    report = validate(shards, index)
    assert report["passed"] is True, failed(report)
    (shards / "features.json").write_bytes(tfds_file)
    assert failed(validate(shards, index))["extra_files"]["details"]["examples"] == [
        "features.json"
    ]


def _rewrite_with_long_images(shards: Path, target: str, positions: set[int] | None) -> int:
    """Rewrite one raw shard, doubling the image bytes of the records at ``positions``.

    ``None`` doubles every record: then each batch decodes to twice as many images as it
    has labels, which a batched reshape(-1) lets through. The manifest is updated (size,
    sha256, fingerprint) so only the record contents are wrong. Returns the shard's records.
    """
    import tensorflow as tf

    manifest = load(shards)
    schema = manifest.record_schema
    records = []
    for position, serialized in enumerate(tf.data.TFRecordDataset(str(shards / target))):
        features = tf.io.parse_single_example(serialized, schema.parse_spec())
        image = features["image"].numpy()
        if positions is None or position in positions:
            image = image + image
        records.append(
            schema.serialize(
                image,
                int(features["label"]),
                features["content_hash"].numpy().decode(),
                features["source"].numpy().decode(),
            )
        )
    with tf.io.TFRecordWriter(str(shards / target)) as writer:
        for record in records:
            writer.write(record)
    for info in manifest.splits.values():
        for i, shard in enumerate(info.shards):
            if shard.file == target:
                info.shards[i] = shard.model_copy(
                    update={
                        "bytes": (shards / target).stat().st_size,
                        "sha256": file_sha256(shards / target),
                    }
                )
    save(shards, manifest, refingerprint=True)
    framing = record_offsets(shards / target)  # the rewritten shard's DALI index, as written
    write_dali_index(shards / f"{target}.idx", [at for at, _ in framing], sum(framing[-1]))
    return len(records)


@pytest.mark.parametrize("doubled", ["every record", "last record"])
def test_raw_record_of_twice_the_length_names_shard_and_record(shards: Path, doubled: str) -> None:
    shard = max(load(shards).split("train").shards, key=lambda s: s.num_records)
    target, num_records = shard.file, shard.num_records
    assert num_records >= 2  # so "last record" is not also the first
    positions = None if doubled == "every record" else {num_records - 1}
    _rewrite_with_long_images(shards, target, positions)

    report = validate(shards)
    bad = failed(report)
    assert "records" in bad and not {"manifest", "files", "leakage"} & set(bad)
    error = bad["records"]["details"]["examples"][0]
    assert error["file"] == target
    assert error["record_index"] == (0 if positions is None else num_records - 1)
    assert "1536 bytes" in error["error"] and "wants 768" in error["error"]
    with pytest.raises(ValidationFailed, match=rf"{target} record {error['record_index']}"):
        raise_if_failed(report)


def test_tensorflow_cross_check_fails_when_the_parsers_disagree(shards: Path) -> None:
    """The cross-check compares for real: a sample TensorFlow read differently fails it."""
    from concurrent.futures import Future

    from tasks.validate.stage import cross_check_with_tensorflow, read_shards

    manifest = load(shards)
    contents = read_shards(manifest, shards)
    target = next(t for t in contents if t.sample)
    agreeing: Future[dict[str, object]] = Future()
    agreeing.set_result({t.file: [list(row) for row in t.sample] for t in contents})
    assert cross_check_with_tensorflow(agreeing, contents)["passed"] is True

    # A sampled shard TensorFlow did not report on fails too (it compared nothing).
    silent: Future[dict[str, object]] = Future()
    silent.set_result({t.file: [list(row) for row in t.sample] for t in contents if t != target})
    result = cross_check_with_tensorflow(silent, contents)
    assert result["passed"] is False and target.file in result["message"]

    rows = [list(row) for row in target.sample]
    rows[0][1] = "f" * 64  # TensorFlow saw another content hash in record 0
    disagreeing: Future[dict[str, object]] = Future()
    disagreeing.set_result({target.file: rows})
    result = cross_check_with_tensorflow(disagreeing, contents)
    assert result["passed"] is False
    example = result["details"]["examples"][0]
    assert example["file"] == target.file and example["record_index"] == 0


def _tensorflow_sample_and_keras(*args: object) -> tuple[dict[str, object], list[str]]:
    """The cross-check child's work, and which of Keras and its imports it loaded."""
    import sys

    from tasks.validate.tf_cross_check import tensorflow_sample

    sampled = tensorflow_sample(*args)  # type: ignore[arg-type]
    return sampled, [m for m in ("keras", "sklearn", "matplotlib") if m in sys.modules]


def test_the_cross_check_child_reads_with_tensorflow_and_never_loads_keras(
    shards: Path,
) -> None:
    """TensorFlow's parser in a fresh process agrees with the schema reader on every sampled
    record, and that process never imports Keras (1.5 s of its import, unused)."""
    from tasks.runtime.processes import run_in_child
    from tasks.validate.stage import CROSS_CHECK_PER_SHARD, read_shards

    manifest = load(shards)
    contents = read_shards(manifest, shards)
    files = [t.file for t in contents]
    sampled, loaded = run_in_child(
        _tensorflow_sample_and_keras,
        dict(manifest.schema_),
        manifest.compression_type,
        str(shards),
        files,
        CROSS_CHECK_PER_SHARD,
    ).result(timeout=300)
    assert loaded == []
    assert sampled == {t.file: [list(row) for row in t.sample] for t in contents}
    assert all(len(t.sample) == min(CROSS_CHECK_PER_SHARD, len(t.labels)) for t in contents)


def test_a_prestarted_cross_check_child_takes_the_job(shards: Path, tmp_path: Path) -> None:
    """`python -m flows.launch.validate` starts the cross-check's child before it imports the flow;
    the validation that follows sends its job there, once, and TensorFlow still reads."""
    from tasks.runtime import latency
    from tasks.validate.stage import run_validate, tf_cross_check

    tf_cross_check.prestart()
    child = latency._standing_by.get(tf_cross_check.tensorflow_without_keras)
    assert child is not None
    report = run_validate(shards, tmp_path / "v.json", tmp_path / "v.md")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["passed"] and checks["tensorflow_parser"]["details"]["records"] > 0
    assert tf_cross_check.standby() is None  # taken by that validation
    assert not child._process.is_alive()  # type: ignore[attr-defined]


def test_a_near_duplicate_pair_across_splits_fails_and_a_rebuild_fixes_it(tmp_path: Path) -> None:
    """A set built before near-duplicate placement (hash splits only): validation names the
    pair that straddles, and the rebuild after the next ingest passes."""
    import hashlib
    import io

    from bench.near_duplicates import sample_photo
    from tasks.ingest.stage import run_ingest
    from tests.conftest import write_image_folder

    def assign_split(content_hash: str, fractions: SplitFractions, seed: int) -> str:
        """How such a set was split: a seeded hash of each file's content alone."""
        key = hashlib.sha256(f"{seed}:{content_hash}".encode()).digest()
        u = int.from_bytes(key[:8], "big") / 2**64
        return "train" if u < fractions.train else "val" if u < 1 - fractions.test else "test"

    source = write_image_folder(tmp_path / "images")
    params = default_params(
        ingest={
            "source_dir": str(source),
            "workers": 1,
            "splits": {"train": 0.5, "val": 0.25, "test": 0.25},
        }
    )
    fractions, seed = params.ingest.splits, params.ingest.seed
    image = sample_photo("astronaut").resize((96, 96))
    original, copy = io.BytesIO(), io.BytesIO()
    image.save(original, format="PNG")
    first = assign_split(hashlib.sha256(original.getvalue()).hexdigest(), fractions, seed)
    for quality in range(50, 95):  # a re-encoded copy whose own hash split is another one
        copy = io.BytesIO()
        image.save(copy, format="JPEG", quality=quality)
        if assign_split(hashlib.sha256(copy.getvalue()).hexdigest(), fractions, seed) != first:
            break
    (source / "red" / "photo.png").write_bytes(original.getvalue())
    (source / "red" / "photo_copy.jpg").write_bytes(copy.getvalue())
    index_path = tmp_path / "ingest" / "index.json"
    run_ingest(params.ingest, index_path, tmp_path / "ingest.json")
    # What the index of a set built before this feature held: hash splits, no placement.
    old = load_index(index_path)
    for record in old["records"]:
        record["split"] = assign_split(record["sha256"], fractions, seed)
        del record["phash"], record["thumb"]
    write_index(index_path, {**old, "placement": None})
    shard_params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1}
    ).shard
    shards_dir = tmp_path / "shards"
    shard_stage(shard_params, index_path, shards_dir)
    assert "near_duplicates" in failed(validate(shards_dir, index_path))  # no hashes to check

    run_ingest(params.ingest, index_path, tmp_path / "ingest.json")  # places afresh
    bad = failed(validate(shards_dir, index_path))["near_duplicates"]
    (pair,) = bad["details"]["examples"]
    assert sorted(pair["paths"]) == ["red/photo.png", "red/photo_copy.jpg"]
    assert "rebuild" in bad["message"]

    shard_stage(shard_params, index_path, shards_dir)  # shard.mode: rebuild
    report = validate(shards_dir, index_path)
    assert report["passed"] is True, failed(report)


def test_a_dali_index_off_its_shards_framing_fails_the_files_check(
    shards: Path, tiny_index: Path
) -> None:
    """Each uncompressed shard's `<file>.idx` must name its records' framing exactly; a
    missing or shifted one fails validation naming it, the shard itself still checks out."""
    first, second = load(shards).split("train").shards[:2]
    shifted = shards / f"{first.file}.idx"
    lines = shifted.read_text().splitlines()
    offset, size = map(int, lines[0].split())
    shifted.write_text("\n".join([f"{offset + 1} {size}", *lines[1:]]) + "\n")
    (shards / f"{second.file}.idx").unlink()
    report = validate(shards, tiny_index)
    assert set(failed(report)) == {"files"}
    message = failed(report)["files"]["message"]
    assert f"{first.file}.idx: DALI index does not match" in message
    assert f"{second.file}.idx: DALI index unreadable or missing" in message


def _rewrite_shard(shards: Path, target: str, craft: Callable[[int, bytes], bytes]) -> None:
    """Rewrite one shard, each record framed (valid CRCs) from ``craft(position, record)``
    (framed bytes), the manifest updated (size, sha256, fingerprint) so only the records
    are wrong."""
    with open_records(shards / target) as handle:
        frames = list(iter(lambda: read_framed(handle), None))
    (shards / target).write_bytes(
        b"".join(craft(position, data) for position, data in enumerate(frames))  # type: ignore[arg-type]
    )
    manifest = load(shards)
    for info in manifest.splits.values():
        for i, shard in enumerate(info.shards):
            if shard.file == target:
                update = {
                    "bytes": (shards / target).stat().st_size,
                    "sha256": file_sha256(shards / target),
                }
                info.shards[i] = shard.model_copy(update=update)
    save(shards, manifest, refingerprint=True)
    try:  # the DALI index of its framing, as the shard stage writes it
        framing = record_offsets(shards / target)
    except CorruptRecord:
        return
    write_dali_index(shards / f"{target}.idx", [at for at, _ in framing], sum(framing[-1]))


def _label_repeated_after_the_source(record: bytes) -> bytes:
    """The record with its label written again after its last entry: a wrong label first
    (where the fast raw reader looks), the true one last (what protobuf keeps)."""
    features = decode_example(record)
    true_label = int(features["label"])
    wrong = encode_example({**features, "label": (true_label + 1) % 3})
    head = 1
    while wrong[head] & 0x80:  # the outer length's varint
        head += 1
    entries = wrong[head + 1 :] + encode_example({"label": true_label})[2:]
    return b"\x0a" + _varint(len(entries)) + entries


def test_a_record_a_fast_reader_would_read_differently_fails_naming_shard_and_record(
    shards: Path,
) -> None:
    """Valid CRCs, a matching fingerprint, every label check passing (the last label entry
    is the true one): the layout itself fails validation."""
    target = load(shards).split("train").shards[0].file

    def craft(position: int, data: bytes) -> bytes:
        return frame_record(_label_repeated_after_the_source(data) if position == 1 else data)

    _rewrite_shard(shards, target, craft)
    bad = failed(validate(shards))
    assert "records" in bad and not {"manifest", "files", "labels", "leakage"} & set(bad)
    error = bad["records"]["details"]["examples"][0]
    assert (error["file"], error["record_index"]) == (target, 1)
    assert "a feature repeated" in error["error"]


def test_a_declared_length_past_the_files_end_is_refused_before_tensorflow_reads_it(
    shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A length field of 2**40 (its CRC valid) would crash TensorFlow's reader: the records
    check names the shard and record, and the cross-check never hands the file to it."""
    from tasks.validate import stage

    target = load(shards).split("val").shards[0].file
    size = struct.pack("<Q", 2**40)

    def craft(position: int, data: bytes) -> bytes:
        framed = frame_record(data)
        return size + _masked_crc(size) + framed[12:] if position == 1 else framed

    _rewrite_shard(shards, target, craft)
    asked: list[str] = []
    real = stage.start_cross_check

    def spy(manifest: Any, shards_dir: Path, files: list[str]) -> Any:
        asked.extend(files)
        return real(manifest, shards_dir, files)

    monkeypatch.setattr(stage, "start_cross_check", spy)
    bad = failed(validate(shards))
    error = bad["records"]["details"]["examples"][0]
    assert (error["file"], error["record_index"]) == (target, 1)
    assert "CorruptRecord" in error["error"] and str(2**40) in error["error"]
    assert asked and target not in asked
