"""Training reads each epoch in a global order, record by record at its offset.

Every epoch is a permutation of the whole split, the op and the stock path read the same
bytes in the same order, a read resumed at a step reads what an uninterrupted one read there,
and the replicas' slices make up the same global batches for any number of workers.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tasks.contracts import raw_slice
from tasks.contracts.manifest import load_manifest
from tasks.contracts.numpy_reader import write_record_index
from tasks.contracts.tf_reader import read_split
from tasks.runtime.params import default_params
from tasks.shard.stage import shard_stage
from tasks.tfrecord import decode_example, open_records, read_framed
from tests.tiny_shards import write_tiny_shards


def hashes(dataset: tf.data.Dataset) -> list[list[bytes]]:
    """The content hashes of each batch, in order."""
    return [batch["content_hash"].numpy().tolist() for batch in dataset]


def epoch(shards: Path, *, seed: int = 5, batch_size: int = 8, **options: object) -> list:
    return hashes(
        read_split(
            shards,
            "train",
            batch_size=batch_size,
            training=True,
            seed=seed,
            with_metadata=True,
            **options,  # type: ignore[arg-type]
        )
    )


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    shards = write_tiny_shards(tmp_path, size=8, shards_per_split=3)
    write_record_index(load_manifest(shards), shards)  # the shard stage's offsets.json
    return shards


def test_each_epoch_is_a_new_permutation_of_the_split_in_whole_batches(shards: Path) -> None:
    every = Counter(
        h
        for batch in read_split(shards, "train", batch_size=4, training=False, with_metadata=True)
        for h in batch["content_hash"].numpy().tolist()
    )
    first, second = epoch(shards, seed=1, batch_size=10), epoch(shards, seed=2, batch_size=10)
    for batches in (first, second):
        assert [len(b) for b in batches] == [10] * 7  # 72 records: 7 whole batches
        read = [h for b in batches for h in b]
        assert len(set(read)) == 70 and set(read) <= set(every)
    assert first != second


def test_the_op_and_the_stock_path_read_the_same_bytes_in_the_same_order(shards: Path) -> None:
    if raw_slice.loaded_op() is None:
        pytest.fail("the positional-read op did not build here; the comparison needs both paths")
    read = functools.partial(read_split, shards, "train", batch_size=8, training=True, seed=3)
    with_op = [(x.numpy(), y.numpy()) for x, y in read()]
    with raw_slice.stock_ops():
        stock = [(x.numpy(), y.numpy()) for x, y in read()]
    assert len(with_op) == len(stock) == 9
    for (x1, y1), (x2, y2) in zip(with_op, stock, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_a_read_started_at_a_step_reads_what_the_whole_epoch_read_from_there(shards: Path) -> None:
    whole = epoch(shards)
    assert epoch(shards, first_step=4) == whole[4:]
    assert epoch(shards, first_step=tf.constant(4, tf.int64)) == whole[4:]
    # the buffered order (GZIP shards) replays its seeded epoch and drops the steps done
    buffered = epoch(shards, order="buffered")
    assert len(buffered) == len(whole) and buffered != whole
    assert epoch(shards, order="buffered", first_step=4) == buffered[4:]


def test_a_gzip_set_resumed_at_a_step_replays_its_epoch_and_drops_the_steps_done(
    tiny_index: Path, tmp_path: Path
) -> None:
    """GZIP shards cannot be entered at an offset: the global order falls back to the
    buffered one, and a read started at a step yields what the whole epoch yielded there."""
    shards = tmp_path / "gzip"
    params = {"image_size": (16, 16), "target_shard_mb": 0.002, "workers": 1}
    shard_stage(default_params(shard={**params, "compression": "gzip"}).shard, tiny_index, shards)
    assert load_manifest(shards).compression == "gzip"
    whole = epoch(shards, batch_size=2)
    assert len(whole) >= 4 and all(len(batch) == 2 for batch in whole)
    assert epoch(shards, batch_size=2, first_step=3) == whole[3:]
    assert epoch(shards, batch_size=2, seed=6) != whole


@pytest.mark.parametrize("workers", [2, 4])
def test_any_number_of_workers_reads_the_same_global_batches(shards: Path, workers: int) -> None:
    whole = epoch(shards)
    slices = [epoch(shards, replicas=(w, 1, workers)) for w in range(workers)]
    joined = [[h for s in slices for h in s[step]] for step in range(len(whole))]
    assert joined == whole
    # one worker with two replicas yields both of its slices of each global batch in turn
    both = epoch(shards, replicas=(0, 2, 2))
    assert [both[2 * i] + both[2 * i + 1] for i in range(len(whole))] == whole


def test_an_offset_index_of_other_shards_is_refused_naming_it(shards: Path) -> None:
    index = shards / "offsets.json"
    index.write_text(index.read_text().replace('"fingerprint":"', '"fingerprint":"0', 1))
    with pytest.raises(
        ValueError,
        match=r"offsets.json: indexes shard set .* \(stale index\); rerun the shard stage",
    ):
        epoch(shards)


@pytest.mark.parametrize(
    ("stock", "with_metadata"),
    [(False, True), (False, False), (True, True)],
    ids=["op", "op into the batch", "stock"],
)
def test_a_damaged_record_fails_the_read_naming_the_file_and_byte(
    shards: Path, stock: bool, with_metadata: bool
) -> None:
    manifest = load_manifest(shards)
    shard = shards / manifest.split("train").shards[0].file
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # inside the first record's data
    shard.write_bytes(bytes(data))
    if not stock and raw_slice.loaded_op() is None:
        pytest.fail("the positional-read op did not build here")
    with (
        raw_slice.stock_ops() if stock else contextlib.nullcontext(),
        pytest.raises(
            tf.errors.OpError, match=rf"{shard.name} at byte 0: the data's CRC does not match"
        ),
    ):
        list(
            read_split(
                shards,
                "train",
                batch_size=72 // 8 * 8,
                training=True,
                seed=5,
                with_metadata=with_metadata,
            )
        )


def test_a_split_of_many_files_mixes_them_in_every_batch(tmp_path: Path) -> None:
    """On a set of 40 files, a 64-record batch of the global order holds on average the
    distinct files 64 uniform draws would, F(1 - (1 - 1/F)^64), within 5%; the buffered
    order (files interleaved 8 at a time, then a record buffer) holds far fewer where its
    buffer is a tenth of the split, as the 64 MiB buffer is of a 224x224 raw split of 4,400
    records (it holds 436): its records move only among their files' neighbours."""
    files = 40
    shards = write_tiny_shards(
        tmp_path, size=4, per_class={"train": 320, "val": 2, "test": 2}, shards_per_split=files
    )
    file_of = {}
    for number, shard in enumerate(load_manifest(shards).split("train").shards):
        with open_records(shards / shard.file) as handle:
            while (data := read_framed(handle)) is not None:
                file_of[decode_example(data)["content_hash"]] = number
    expected = files * (1 - (1 - 1 / files) ** 64)

    def mean_distinct_files(order: str) -> float:
        counts = [
            len({file_of[h] for h in batch})
            for seed in range(3)
            for batch in epoch(shards, seed=seed, batch_size=64, order=order, shuffle_buffer=96)
        ]
        return float(np.mean(counts))

    assert abs(mean_distinct_files("global") / expected - 1) <= 0.05
    assert mean_distinct_files("buffered") < 0.8 * expected
