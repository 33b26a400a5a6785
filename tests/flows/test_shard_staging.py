"""Dask workers that share no file system with the shard stage: sources and shards travel
through an S3 staging prefix (``shard.staging_url``), and the shards are a local run's."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.contracts.manifest import ShardFile
from tasks.runtime.layout import Layout
from tasks.runtime.params import ShardParams, default_params
from tests.flows.test_shard_runners import REPO, run_flow, shard_bytes
from tests.s3_server import S3Server


def staged_keys(server: S3Server, prefix: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix)  # type: ignore[attr-defined]
    return sorted(item["Key"] for item in listing.get("Contents", []))


@pytest.mark.slow
def test_dask_workers_without_the_source_folder_write_a_local_runs_bytes_through_s3(
    prefect_harness: None, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers run in another folder, and the source folder is moved away once the stage
    has uploaded what the shards need: a worker that opened a local source would fail (the
    same cluster without staging does, naming the file). Through staging the shard folder is
    byte for byte a local run's; the run's shard objects are gone afterwards, the sources
    stay and are not uploaded again; a staged source with other bytes fails the run naming
    its file, and the run's shard objects are gone then too."""
    from distributed import LocalCluster

    import tasks.shard.staging
    from tasks.contracts.index import iter_records
    from tasks.ingest.stage import run_ingest
    from tests.conftest import write_image_folder

    source = write_image_folder(tmp_path / "images", per_class=8)
    splits = {"train": 0.5, "val": 0.25, "test": 0.25}
    ingest = default_params(ingest={"source_dir": str(source), "splits": splits, "workers": 1})
    index = tmp_path / "index.json"
    run_ingest(ingest.ingest, index, tmp_path / "ingest.json")
    records = [record for _, record in iter_records(index)]
    base = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 2}
    ).shard
    local = Layout(tmp_path / "local")
    local_result = run_flow(local, index, base)

    moved = tmp_path / "moved-away"
    uploads: list[tuple[int, int]] = []
    after_upload: list[Callable[[], None]] = []
    real_upload = tasks.shard.staging.upload_sources

    def upload_then_hide_sources(*args: Any, **kwargs: Any) -> tuple[int, int]:
        counts = real_upload(*args, **kwargs)
        uploads.append(counts)
        source.rename(moved)  # from here on, only the staging prefix holds the sources
        for hook in after_upload:
            hook()
        return counts

    fetched: list[str] = []
    real_fetch = tasks.shard.staging.fetch_shard

    def fetch(staging: Any, result: ShardFile, shards_dir: Path, **kwargs: Any) -> None:
        fetched.append(result.file)
        real_fetch(staging, result, shards_dir, **kwargs)

    monkeypatch.setattr(tasks.shard.staging, "upload_sources", upload_then_hide_sources)
    monkeypatch.setattr(tasks.shard.staging, "fetch_shard", fetch)
    # The workers import the project's code (that much they share), nothing else of it: their
    # working and scratch folders are empty folders elsewhere.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    elsewhere = tmp_path / "worker-cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    staging_url = s3_server.url("staging")
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
        processes=True,
        local_directory=str(tmp_path / "worker-scratch"),
    ) as cluster:

        def dask(**update: Any) -> ShardParams:
            return base.model_copy(
                update={"runner": "dask", "dask_address": cluster.scheduler_address, **update}
            )

        # Without staging, a worker opens the source folder, which is not there for it.
        source.rename(moved)
        with pytest.raises(FileNotFoundError, match=re.escape(str(source))):
            run_flow(Layout(tmp_path / "shared-fs"), index, dask())
        moved.rename(source)

        staged = Layout(tmp_path / "staged")
        staged_result = run_flow(staged, index, dask(staging_url=staging_url))
        moved.rename(source)

        assert uploads == [(len(records), len(records))]
        assert staged_result["fingerprint"] == local_result["fingerprint"]
        assert shard_bytes(staged.shards_dir) == shard_bytes(local.shards_dir)
        assert sorted(fetched) == sorted(p.name for p in local.shards_dir.glob("*.tfrecord-*[0-9]"))
        assert int(str(staged_result["written"])) == len(fetched) > 3
        sources = staged_keys(s3_server, "staging/sources/")
        assert sources == sorted(f"staging/sources/{r['sha256']}" for r in records)
        assert staged_keys(s3_server, "staging/shards/") == []

        # A staged source with other bytes than its record's: the run fails naming the file.
        victim = records[0]
        victim_key = f"staging/sources/{victim['sha256']}"

        def corrupt() -> None:
            client = s3_server.client()
            client.put_object(Bucket=s3_server.bucket, Key=victim_key, Body=b"not the image")  # type: ignore[attr-defined]

        after_upload.append(corrupt)
        with pytest.raises(Exception, match=re.escape(f"source {victim['path']}: staged object")):
            run_flow(Layout(tmp_path / "corrupted"), index, dask(staging_url=staging_url))
        moved.rename(source)
    assert uploads[-1] == (0, len(records))  # every source was there already
    assert staged_keys(s3_server, "staging/shards/") == []
    assert victim_key not in staged_keys(s3_server, "staging/sources/")  # uploaded again next run


def test_a_staged_shard_with_other_bytes_than_its_entry_is_refused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The stage keeps a downloaded shard only when its size and sha256 are the ones its
    worker returned; otherwise nothing lands in the shard folder and the error names it."""
    from tasks.contracts.manifest import file_sha256
    from tasks.shard.staging import Staging, StagingError, fetch_shard

    staging = Staging(s3_server.url("staging"), "run-1")
    good = tmp_path / "good.tfrecord-00000-of-00001"
    good.write_bytes(b"shard bytes")
    entry = ShardFile(file=good.name, num_records=1, bytes=11, sha256=file_sha256(good))
    client = s3_server.client()
    client.put_object(
        Bucket=s3_server.bucket, Key=staging.shard_key(good.name), Body=b"shard bytes"
    )  # type: ignore[attr-defined]
    fetch_shard(staging, entry, tmp_path / "shards")
    assert (tmp_path / "shards" / good.name).read_bytes() == b"shard bytes"

    client.put_object(
        Bucket=s3_server.bucket, Key=staging.shard_key(good.name), Body=b"shard bytez"
    )  # type: ignore[attr-defined]
    with pytest.raises(StagingError, match=re.escape(f"shard {good.name}: staged object s3://")):
        fetch_shard(staging, entry, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []

    missing = ShardFile(file="missing.tfrecord", num_records=1, bytes=1, sha256="0" * 64)
    with pytest.raises(StagingError, match=re.escape("shard missing.tfrecord: no staged object")):
        fetch_shard(staging, missing, tmp_path / "other")


def test_staged_runs_remove_their_shard_objects_and_keep_the_sources(
    s3_server: S3Server,
) -> None:
    """On exit, failed or not, a staged run leaves nothing under its own shard prefix; another
    run's shards and the content-addressed sources stay."""
    from tasks.shard.staging import staged_run

    params = default_params(
        shard={"runner": "dask", "dask_address": "tcp://x:8786", "staging_url": s3_server.url("st")}
    ).shard
    client = s3_server.client()

    def put(key: str) -> None:
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"x")  # type: ignore[attr-defined]

    put("st/sources/" + "a" * 64)
    put("st/shards/other-run/train.tfrecord-00000-of-00001")
    with pytest.raises(RuntimeError, match="worker failed"), staged_run(params) as staging:
        assert staging is not None
        put(staging.shard_key("train.tfrecord-00000-of-00001"))
        put(staging.shard_key("gen-00001/val.tfrecord-00000-of-00001"))
        raise RuntimeError("worker failed")
    with staged_run(params) as staging:
        assert staging is not None
        put(staging.shard_key("test.tfrecord-00000-of-00001"))
    assert staged_keys(s3_server, "st/") == [
        "st/shards/other-run/train.tfrecord-00000-of-00001",
        "st/sources/" + "a" * 64,
    ]
    with staged_run(params.model_copy(update={"runner": "local"})) as staging:
        assert staging is None  # local workers read the source folder themselves


def test_sources_go_up_once_each_and_a_file_changed_since_ingest_is_refused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Each needed source is uploaded once (a second run finds them all there) and read back
    by sha256; a source file whose bytes changed since ingest is refused naming its path,
    and a source the prefix lacks is an error naming the file."""
    from tasks.ingest.stage import run_ingest
    from tasks.shard.planning import plan_shards
    from tasks.shard.staging import Staging, StagingError, staged_source_reader, upload_sources
    from tests.conftest import write_image_folder

    source = write_image_folder(tmp_path / "images", per_class=3)
    splits = {"train": 0.5, "val": 0.25, "test": 0.25}
    ingest = default_params(ingest={"source_dir": str(source), "splits": splits, "workers": 1})
    run_ingest(ingest.ingest, tmp_path / "index.json", tmp_path / "ingest.json")
    params = default_params(shard={"image_size": [16, 16], "target_shard_mb": 0.002}).shard
    plan = plan_shards(params, tmp_path / "index.json")
    records = [record for spec in plan for record in spec.records]
    staging = Staging(s3_server.url("st"), "run-1")

    assert upload_sources(staging, plan) == (len(records), len(records)) == (9, 9)
    assert upload_sources(staging, plan) == (0, 9)
    read = staged_source_reader(staging, s3_server.client())
    assert read(records[0]) == (source / records[0].path).read_bytes()

    changed = records[1]
    s3_server.client().delete_object(  # type: ignore[attr-defined]
        Bucket=s3_server.bucket, Key=staging.source_key(changed.sha256)
    )
    with pytest.raises(StagingError, match=re.escape(f"source {changed.path}: no staged object")):
        read(changed)
    (source / changed.path).write_bytes(b"edited after ingest")
    with pytest.raises(ValueError, match=re.escape(f"{source / changed.path}: content changed")):
        upload_sources(staging, plan)


def test_a_worker_fetches_the_next_sources_while_it_decodes_one() -> None:
    """Sources come back in the shard's order, each fetch sent up to READ_AHEAD records
    before it is asked for (never more), so S3 round trips overlap decoding; a record asked
    for out of order is refused."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from tasks.shard.spec import ShardRecord
    from tasks.shard.staging import READ_AHEAD, read_ahead

    records = [ShardRecord(f"c/{i}.png", 0, f"{i:064x}") for i in range(3 * READ_AHEAD)]
    sent: list[str] = []

    class Counting(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            sent.append(args[0].path)
            return super().submit(fn, *args, **kwargs)

    with Counting(READ_AHEAD) as pool:
        next_source = read_ahead(lambda record: record.path.encode(), records, pool)
        got = []
        for n, record in enumerate(records):
            got.append(next_source(record))
            assert len(sent) == min(len(records), n + READ_AHEAD)
        assert got == [r.path.encode() for r in records]
        assert sent == [r.path for r in records]

        other = read_ahead(lambda record: b"", records, pool)
        with pytest.raises(RuntimeError, match=re.escape("source c/1.png: asked for out of")):
            other(records[1])
