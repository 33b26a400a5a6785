"""Shards read straight from a real S3 server (moto) through the bounded, checked cache."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.contracts.manifest import MANIFEST_NAME, load_manifest
from tasks.contracts.shard_blocks import BLOCKS_NAME, write_block_list
from tasks.contracts.shard_store import (
    CACHE_DIR,
    ShardStore,
    ShardStoreError,
    publish,
)
from tasks.contracts.tf_reader import read_split, shard_records
from tests.conftest import tf_op_determinism
from tests.s3_server import S3Server


def published(tiny_shards: Path, s3_server: S3Server, **options: Any) -> ShardStore:
    url = s3_server.url("sets", "tiny")
    publish(tiny_shards / "data" / "shards", url)
    return ShardStore(url, tiny_shards, **{"max_bytes": 1 << 30, "prefetch": 2, **options})


def hashes(ds: Any) -> list[bytes]:
    return [h for batch in ds for h in batch["content_hash"].numpy().tolist()]


@pytest.fixture(params=[False, True], ids=["op-nondeterministic", "op-deterministic"])
def op_determinism(request: pytest.FixtureRequest) -> Iterator[bool]:
    """TensorFlow's op determinism off, then on (training's default, set process-wide by
    ``tasks.train.stage.seed_everything``)."""
    with tf_op_determinism(request.param):
        yield request.param


@pytest.mark.parametrize("split", ["train", "test"])
def test_store_read_gives_the_local_records_in_the_local_order(
    tiny_shards: Path, s3_server: S3Server, split: str, op_determinism: bool
) -> None:
    store = published(tiny_shards, s3_server)
    shards_dir = tiny_shards / "data" / "shards"
    for training in (False, True):
        options = {"batch_size": 4, "training": training, "seed": 7}
        local = read_split(shards_dir, split, **options)
        remote = read_split(tiny_shards / "elsewhere", split, store=store, **options)
        for (li, ll), (ri, rl) in zip(local, remote, strict=True):
            np.testing.assert_array_equal(li.numpy(), ri.numpy())
            np.testing.assert_array_equal(ll.numpy(), rl.numpy())
    local_meta = read_split(shards_dir, split, batch_size=4, training=False, with_metadata=True)
    remote_meta = read_split(
        shards_dir, split, batch_size=4, training=False, with_metadata=True, store=store
    )
    assert hashes(remote_meta) == hashes(local_meta)
    # read from the cache inside the repository, never from the local shard folder
    assert {p.name for p in (tiny_shards / CACHE_DIR).iterdir()} >= {
        s.sha256 for s in load_manifest(shards_dir).split(split).shards
    }


# Small blocks, so that a tiny shard (a few KiB) is fetched as several.
SMALL_BLOCK = 1024


def published_in_blocks(root: Path, s3_server: S3Server, **options: Any) -> ShardStore:
    """``root``'s shards published with a block list of :data:`SMALL_BLOCK` blocks."""
    shards_dir = root / "data" / "shards"
    write_block_list(load_manifest(shards_dir), shards_dir, block_size=SMALL_BLOCK)
    return published(root, s3_server, **options)


def recorded_gets(store: ShardStore) -> list[dict[str, Any]]:
    """Every ``get_object`` call the store makes from now on (its keyword arguments)."""
    calls: list[dict[str, Any]] = []
    real_get = store._client.get_object

    def recorded(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_get(**kwargs)

    store._client.get_object = recorded
    return calls


@pytest.mark.parametrize("listed", [True, False], ids=["by-blocks", "without-block-list"])
def test_a_corrupted_object_is_refused_naming_it_before_any_of_its_records(
    tiny_shards: Path, s3_server: S3Server, listed: bool
) -> None:
    store = published(tiny_shards, s3_server, prefetch=1)
    if not listed:  # a set published before block lists: each shard checked whole
        client: Any = s3_server.client()
        client.delete_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{BLOCKS_NAME}")
    shards_dir = tiny_shards / "data" / "shards"
    bad = load_manifest(shards_dir).split("test").shards[1]
    data = bytearray((shards_dir / bad.file).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    client = s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{bad.file}", Body=bytes(data))
    import tensorflow as tf

    manifest = load_manifest(shards_dir)
    schema = manifest.record_schema
    bad_hashes = {
        schema.parse_batch(tf.reshape(r, [1]), metadata=True)["content_hash"].numpy()[0]
        for r in shard_records(str(shards_dir / bad.file), manifest)
    }
    seen: list[bytes] = []
    ds = read_split(
        shards_dir, "test", batch_size=1, training=False, with_metadata=True, store=store
    )
    with pytest.raises(tf.errors.OpError, match=bad.file):
        for batch in ds:
            seen.extend(batch["content_hash"].numpy().tolist())
    assert len(seen) == manifest.split("test").shards[0].num_records  # the good shard, whole
    assert not bad_hashes & set(seen)
    assert not (tiny_shards / CACHE_DIR / bad.sha256).exists()


def test_the_cache_never_holds_more_than_its_bound(tiny_shards: Path, s3_server: S3Server) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    shards = [s for info in manifest.splits.values() for s in info.shards]
    bound = 3 * max(s.bytes for s in shards)  # (2 x prefetch + 1) shards, the least it takes
    store = published(tiny_shards, s3_server, max_bytes=bound, prefetch=1)
    seen: list[int] = []
    real_get = store._client.get_object

    def watched_get(**kwargs: Any) -> Any:
        seen.append(store.cached_bytes())
        return real_get(**kwargs)

    store._client.get_object = watched_get
    for split in ("train", "val", "test"):
        for _ in read_split(tiny_shards, split, batch_size=4, training=True, seed=1, store=store):
            seen.append(store.cached_bytes())
    assert len(seen) > len(shards)  # every shard downloaded, more than the cache holds at once
    assert max(seen) <= bound
    assert len(list((tiny_shards / CACHE_DIR).iterdir())) < len(shards)  # some were evicted


def test_downloads_run_prefetch_at_a_time_beyond_the_readers_threads(
    tmp_path: Path, s3_server: S3Server, op_determinism: bool
) -> None:
    """A read keeps ``prefetch`` downloads in flight even where that is more than tf.data's
    threads (one per core): no tf.data thread waits on the network. Under op determinism
    too, which switches off a pipeline's prefetch wherever one of its ops is stateful."""
    from tests.tiny_shards import write_tiny_shards

    prefetch = len(os.sched_getaffinity(0)) + 2
    write_tiny_shards(tmp_path, shards_per_split=prefetch + 2)
    store = published(tmp_path, s3_server, prefetch=prefetch)
    store.manifest()
    real_get = store._client.get_object
    in_flight, most = 0, 0
    changed = threading.Condition()

    def held_get(**kwargs: Any) -> Any:
        """Each download waits (3 s at most) until ``prefetch`` of them are in flight."""
        nonlocal in_flight, most
        with changed:
            in_flight += 1
            most = max(most, in_flight)
            changed.notify_all()
            changed.wait_for(lambda: most >= prefetch, timeout=3)
        try:
            return real_get(**kwargs)
        finally:
            with changed:
                in_flight -= 1

    store._client.get_object = held_get
    ds = read_split(tmp_path, "train", batch_size=4, training=False, store=store)
    images = np.concatenate([batch.numpy() for batch, _ in ds])
    local = read_split(tmp_path / "data" / "shards", "train", batch_size=4, training=False)
    assert most == prefetch
    # every record once, in the order a local read gives them
    assert np.array_equal(images, np.concatenate([batch.numpy() for batch, _ in local]))


def test_a_shard_fetched_ahead_and_evicted_before_it_is_read_is_downloaded_again(
    tiny_shards: Path, s3_server: S3Server
) -> None:
    store = published(tiny_shards, s3_server)
    shard = store.manifest().split("train").shards[0]
    real_get = store._client.get_object
    keys: list[str] = []

    def counted_get(**kwargs: Any) -> Any:
        keys.append(kwargs["Key"])
        return real_get(**kwargs)

    store._client.get_object = counted_get
    store.fetch_ahead(shard)
    store.fetch_ahead(shard)  # on its way already: still one download
    store._ahead[shard.sha256].result()
    assert len(keys) == 1
    store.clear()  # evicted (a cold start) before the reader asked for it
    path = store.fetch(shard)
    assert len(keys) == 2
    shards_dir = tiny_shards / "data" / "shards"
    assert path.read_bytes() == (shards_dir / shard.file).read_bytes()


def test_a_missing_object_names_its_key(tiny_shards: Path, s3_server: S3Server) -> None:
    store = published(tiny_shards, s3_server)
    shard = store.manifest().split("val").shards[0]
    client: Any = s3_server.client()
    client.delete_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{shard.file}")
    with pytest.raises(ShardStoreError, match=f"s3://{s3_server.bucket}/sets/tiny/{shard.file}"):
        store.fetch(shard)


def test_a_cache_too_small_for_the_prefetch_is_refused(
    tiny_shards: Path, s3_server: S3Server
) -> None:
    store = published(tiny_shards, s3_server, max_bytes=1000, prefetch=4)
    with pytest.raises(ValueError, match="lower prefetch"):
        store.manifest()


def test_the_gate_refuses_a_store_holding_other_shards(
    tiny_shards: Path, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tasks.contracts.validated_shards import ShardsNotValidated, check_validated_store
    from tests.tiny_shards import write_tiny_shards

    other = write_tiny_shards(tmp_path_factory.mktemp("other"), seed=1, validated=False)
    url = s3_server.url("other")
    publish(other, url)
    store = ShardStore(url, tiny_shards, max_bytes=1 << 30, prefetch=2)
    report = tiny_shards / "reports" / "validation.json"
    with pytest.raises(ShardsNotValidated, match=f"shards at {url} are not the validated ones"):
        check_validated_store(store, report)
    ours = published(tiny_shards, s3_server)
    assert (
        check_validated_store(ours, report).fingerprint
        == load_manifest(tiny_shards / "data" / "shards").fingerprint
    )


@pytest.mark.slow
def test_training_and_evaluation_from_object_storage_compute_what_a_local_run_computes(
    tiny_shards: Path,
    s3_server: S3Server,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SHARDFLOW_SHARDS_URL moves where the stages read, never what they compute: with the
    local shard folder gone, run_train and run_evaluate read the store and write the same
    model bytes and test metrics as a run on the local folder."""
    import json
    import shutil

    from tasks.contracts.shard_store import SHARDS_URL_ENV
    from tasks.evaluate.stage import run_evaluate
    from tasks.runtime.layout import Layout
    from tasks.runtime.params import default_params
    from tasks.train.stage import run_train

    params = default_params(
        train={"epochs": 1, "batch_size": 16, "early_stopping_patience": 0},
        storage={"cache_mb": 1, "prefetch_shards": 1},
    )
    local_root = tmp_path_factory.mktemp("local")
    shutil.copytree(tiny_shards, local_root, dirs_exist_ok=True)
    remote = Layout(tiny_shards)
    local = Layout(local_root)
    url = s3_server.url("validated")
    publish(remote.shards_dir, url)
    shutil.rmtree(remote.shards_dir)  # the store is the only place the shards are

    import keras

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{local_root / 'mlflow.db'}")
    keras.backend.clear_session()  # Keras numbers unnamed layers per process: both start at 0
    run_train(params, local)
    run_evaluate(params, local)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tiny_shards / 'mlflow.db'}")
    monkeypatch.setenv(SHARDS_URL_ENV, url)
    keras.backend.clear_session()
    run_train(params, remote)
    run_evaluate(params, remote)

    assert remote.model_file.read_bytes() == local.model_file.read_bytes()
    assert json.loads(remote.eval_metrics.read_text()) == json.loads(local.eval_metrics.read_text())
    assert remote.test_predictions.read_text() == local.test_predictions.read_text()
    assert not remote.shards_dir.exists()
    assert any((tiny_shards / CACHE_DIR).iterdir())
    # lineage names where the data was read: the train and test inputs point at the store
    from mlflow import MlflowClient

    run_id = json.loads(remote.train_run.read_text())["run_id"]
    inputs = MlflowClient().get_run(run_id).inputs.dataset_inputs
    sources = {json.loads(i.dataset.source)["uri"] for i in inputs}
    assert sources == {url}, sources


@pytest.mark.parametrize("url", ["/data/shards", "s3:///no-bucket", "gs://bucket/shards"])
def test_a_shards_url_that_is_not_s3_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """A refusal names SHARDFLOW_SHARDS_URL and is a ParamsError, which the train and
    evaluate tasks never retry (the same setting fails alike)."""
    from tasks.contracts.shard_store import SHARDS_URL_ENV, open_store
    from tasks.runtime.params import ParamsError, default_params

    monkeypatch.setenv(SHARDS_URL_ENV, url)
    with pytest.raises(ParamsError, match=f"{SHARDS_URL_ENV}='{url}'"):
        open_store(tmp_path, default_params().storage)


def test_a_training_read_fetches_its_whole_split_again_after_the_cache_is_emptied(
    tiny_shards: Path, s3_server: S3Server
) -> None:
    """The global order reaches every shard from the first batch on: each iteration puts
    the split's shards in the cache (checked) before reading, so an emptied cache (an
    eviction, a cold start) reads the same records, never a missing file."""
    store = published(tiny_shards, s3_server)
    ds = read_split(
        tiny_shards / "elsewhere", "train", batch_size=4, training=True, seed=7,
        with_metadata=True, store=store,
    )  # fmt: skip
    first = hashes(ds)
    store.clear()
    assert hashes(ds) == first
    local = read_split(
        tiny_shards / "data" / "shards", "train", batch_size=4, training=True, seed=7,
        with_metadata=True,
    )  # fmt: skip
    assert hashes(local) == first


def test_a_split_larger_than_the_cache_is_refused_naming_the_param(
    tiny_shards: Path, s3_server: S3Server
) -> None:
    store = published(tiny_shards, s3_server)
    needed = sum(s.bytes for s in store.manifest().split("train").shards)
    store.max_bytes = needed - 1
    with pytest.raises(ShardStoreError, match=r"do not fit the shard cache .* storage.cache_mb"):
        read_split(tiny_shards, "train", batch_size=4, training=True, seed=1, store=store)


def test_one_changed_byte_is_refused_naming_its_shard_and_block_before_any_of_its_records(
    tiny_shards: Path, s3_server: S3Server
) -> None:
    """A shard is fetched block by block, each checked against the block list as it
    arrives: one byte changed in the store is refused naming the shard, the block and its
    byte range, and none of that shard's records reaches the reader or the cache."""
    import tensorflow as tf

    store = published_in_blocks(tiny_shards, s3_server, prefetch=1)
    shards_dir = tiny_shards / "data" / "shards"
    manifest = load_manifest(shards_dir)
    bad = manifest.split("test").shards[1]
    data = bytearray((shards_dir / bad.file).read_bytes())
    assert len(data) > 3 * SMALL_BLOCK
    data[2 * SMALL_BLOCK + 5] ^= 0x01  # one bit of one byte of block 2
    client: Any = s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{bad.file}", Body=bytes(data))
    refusal = rf"shard {bad.file} .*block 2 \(bytes 2048-3071\).*republish"
    with pytest.raises(ShardStoreError, match=refusal):
        store.fetch(bad)
    seen: list[bytes] = []
    ds = read_split(
        shards_dir, "test", batch_size=1, training=False, with_metadata=True, store=store
    )
    with pytest.raises(tf.errors.OpError, match=refusal):
        for batch in ds:
            seen.extend(batch["content_hash"].numpy().tolist())
    assert len(seen) == manifest.split("test").shards[0].num_records  # the good shard, whole
    assert not (tiny_shards / CACHE_DIR / bad.sha256).exists()
    assert not list((tiny_shards / CACHE_DIR).glob("*.part"))


def test_a_bad_block_stops_its_shards_download_where_it_lies(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A shard is one GET, checked block by block as it streams in: a bad block is refused
    as soon as it has arrived, the rest of the shard is never read (a whole-shard sha256
    reads every byte first), and a good shard arrives whole from one GET."""
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(tmp_path, per_class={"train": 40, "val": 2, "test": 2}, shards_per_split=1)
    store = published_in_blocks(tmp_path, s3_server, prefetch=1)
    shard = store.manifest().split("train").shards[0]
    assert shard.bytes > 6 * SMALL_BLOCK
    calls = recorded_gets(store)
    real_get = store._client.get_object
    streamed = 0

    def counted_get(**kwargs: Any) -> Any:
        response = real_get(**kwargs)
        body, read = response["Body"], response["Body"].read

        def counted(*args: Any) -> bytes:
            nonlocal streamed
            data: bytes = read(*args)
            streamed += len(data)
            return data

        body.read = counted
        return response

    store._client.get_object = counted_get
    path = store.fetch(shard)
    assert path.read_bytes() == (tmp_path / "data" / "shards" / shard.file).read_bytes()
    assert [sorted(c) for c in calls] == [["Bucket", "Key"]]  # one GET, no ranges
    assert streamed == shard.bytes

    data = bytearray(path.read_bytes())
    data[2 * SMALL_BLOCK + 5] ^= 0x01  # block 2 of many
    client: Any = s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{shard.file}", Body=bytes(data))
    store.clear()
    streamed = 0
    with pytest.raises(ShardStoreError, match=r"block 2 \(bytes 2048-3071\)"):
        store.fetch(shard)
    assert streamed == 3 * SMALL_BLOCK  # blocks 0, 1 and the bad one, nothing after it


@pytest.mark.parametrize("change", ["entry", "other set", "not a list"])
def test_a_block_list_that_disagrees_with_the_manifest_is_refused_naming_it(
    tiny_shards: Path,
    s3_server: S3Server,
    tmp_path_factory: pytest.TempPathFactory,
    change: str,
) -> None:
    import json

    store = published(tiny_shards, s3_server)
    client: Any = s3_server.client()
    key = f"sets/tiny/{BLOCKS_NAME}"
    listed = json.loads(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    shard = load_manifest(tiny_shards / "data" / "shards").split("val").shards[0]
    named = shard.file
    if change == "entry":
        listed["shards"][shard.file]["bytes"] += 1
        text = json.dumps(listed)
    elif change == "other set":
        from tests.tiny_shards import write_tiny_shards

        other = write_tiny_shards(tmp_path_factory.mktemp("other"), seed=1)
        publish(other, s3_server.url("other"))
        text = client.get_object(Bucket=s3_server.bucket, Key=f"other/{BLOCKS_NAME}")["Body"].read()
        named = "another set"
    else:
        text, named = "{}", "not a block list"
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=text)
    gets = recorded_gets(store)
    with pytest.raises(ShardStoreError, match=f"s3://{s3_server.bucket}/{key}: .*{named}"):
        store.manifest()
    with pytest.raises(ShardStoreError, match=f"s3://{s3_server.bucket}/{key}"):
        store.fetch(shard)
    assert not [g for g in gets if g["Key"] == f"sets/tiny/{shard.file}"]  # no shard fetched


def test_a_set_published_without_a_block_list_is_read_whole_with_one_log_line(
    tiny_shards: Path, s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    store = published(tiny_shards, s3_server)
    client: Any = s3_server.client()
    client.delete_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{BLOCKS_NAME}")
    gets = recorded_gets(store)
    shards_dir = tiny_shards / "data" / "shards"
    with caplog.at_level("WARNING", logger="tasks.contracts.shard_store"):
        remote = read_split(shards_dir, "val", batch_size=4, training=False, store=store)
        local = read_split(shards_dir, "val", batch_size=4, training=False)
        for (ri, rl), (li, ll) in zip(remote, local, strict=True):
            np.testing.assert_array_equal(ri.numpy(), li.numpy())
            np.testing.assert_array_equal(rl.numpy(), ll.numpy())
    shards = load_manifest(shards_dir).split("val").shards
    assert sorted(g["Key"] for g in gets if g["Key"] != f"sets/tiny/{MANIFEST_NAME}") == sorted(
        [f"sets/tiny/{BLOCKS_NAME}", *(f"sets/tiny/{s.file}" for s in shards)]
    )
    assert not [g for g in gets if "Range" in g]  # each shard in one GET
    warned = [r.getMessage() for r in caplog.records if BLOCKS_NAME in r.getMessage()]
    assert len(warned) == 1 and "no block list" in warned[0]


def test_publish_uploads_the_block_list_before_the_manifest(
    tiny_shards: Path, s3_server: S3Server
) -> None:
    """The manifest goes last; a folder without blocks.json (written before block lists)
    gets the list the shard stage would write, built from its shards and uploaded only."""
    shards_dir = tiny_shards / "data" / "shards"
    client: Any = s3_server.client()
    keys: list[str] = []
    real_upload, real_put = client.upload_file, client.put_object

    def upload_file(path: str, bucket: str, key: str) -> Any:
        keys.append(key)
        return real_upload(path, bucket, key)

    def put_object(**kwargs: Any) -> Any:
        keys.append(kwargs["Key"])
        return real_put(**kwargs)

    client.upload_file, client.put_object = upload_file, put_object
    assert not (shards_dir / BLOCKS_NAME).exists()
    publish(shards_dir, s3_server.url("sets", "tiny"), client=client)
    # (upload_file calls put_object itself: each key counts where it first appears)
    order = list(dict.fromkeys(keys))
    assert order[-2:] == [f"sets/tiny/{BLOCKS_NAME}", f"sets/tiny/{MANIFEST_NAME}"]
    assert not (shards_dir / BLOCKS_NAME).exists()  # the folder DVC tracks is left as it was
    uploaded = client.get_object(Bucket=s3_server.bucket, Key=f"sets/tiny/{BLOCKS_NAME}")
    write_block_list(load_manifest(shards_dir), shards_dir)
    assert uploaded["Body"].read() == (shards_dir / BLOCKS_NAME).read_bytes()


def test_a_cached_shard_read_again_is_checked_again(tiny_shards: Path, s3_server: S3Server) -> None:
    store = published(tiny_shards, s3_server)
    shard = store.manifest().split("train").shards[0]
    path = store.fetch(shard)
    path.write_bytes(b"not the shard")  # changed on disk after it was checked
    gets = recorded_gets(store)
    again = store.fetch(shard)
    assert again.read_bytes() == (tiny_shards / "data" / "shards" / shard.file).read_bytes()
    assert [g["Key"] for g in gets] == [f"sets/tiny/{shard.file}"]  # fetched anew
