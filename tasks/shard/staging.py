"""Shards written by Dask workers that share no file system with the stage: source images and
finished shards travel through an S3 staging prefix (``shard.staging_url``).

DVC 3 has no external outputs, so ``data/shards`` stays the stage's tracked output. The stage
uploads the source images its missing shards need, content-addressed by their ingest sha256;
each worker reads a record's bytes from there (checked against that sha256), writes its shards
into a temporary folder of its own, uploads each under this run's prefix and returns its
manifest entry; the stage downloads each shard into the folder it writes (a rebuild's own,
:mod:`tasks.contracts.shard_swap`), checked against that entry, and removes this run's shard objects
when it ends, failed or not. Bytes are those of a local run: the same specs, the same checked
source bytes, the same :func:`write_shard`.

Under the staging URL::

    sources/<sha256>           a source image (kept: the next run uploads only new images)
    shards/<run id>/<file>     a finished shard of one run (removed when that run ends)

The endpoint and credentials are boto3's own environment variables on the stage's machine and
on each worker (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), never
params or task arguments.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.contracts.manifest import ShardFile
from tasks.contracts.shard_store import s3_client, split_url
from tasks.runtime.params import ShardParams
from tasks.shard.spec import ShardRecord, ShardSpec, read_source
from tasks.shard.writing import write_shard

UPLOAD_THREADS = 8  # source uploads in flight: small files are bound by round trips, not bytes
READ_AHEAD = 8  # a worker's source GETs in flight (and sources held), per Dask thread
_CHUNK = 1 << 20  # shards come down in 1 MiB pieces, hashed as they arrive


class StagingError(RuntimeError):
    """A staged source or shard that is missing or holds other bytes than its record says."""


@dataclass(frozen=True)
class Staging:
    """One shard run's place under the staging URL (picklable: it travels to the workers)."""

    url: str  # s3://bucket/prefix
    run_id: str

    @property
    def bucket(self) -> str:
        return split_url(self.url)[0]

    def source_key(self, sha256: str) -> str:
        return f"{split_url(self.url)[1]}sources/{sha256}"

    def run_prefix(self) -> str:
        return f"{split_url(self.url)[1]}shards/{self.run_id}/"

    def shard_key(self, file: str) -> str:
        return self.run_prefix() + file

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


def staging_for(params: ShardParams) -> Staging | None:
    """A fresh run's staging when Dask workers go through object storage, else None."""
    if params.runner != "dask" or not params.staging_url:
        return None
    return Staging(params.staging_url.rstrip("/"), uuid.uuid4().hex)


@contextmanager
def staged_run(params: ShardParams, *, client: Any = None) -> Iterator[Staging | None]:
    """The run's staging (None without one); its shard objects are removed on exit, whether
    the run succeeded or failed (the content-addressed sources stay for the next run)."""
    staging = staging_for(params)
    try:
        yield staging
    finally:
        if staging is not None:
            remove_run(staging, client=client)


def upload_sources(
    staging: Staging, specs: Iterable[ShardSpec], *, client: Any = None
) -> tuple[int, int]:
    """Upload each source image ``specs`` need that the staging prefix does not hold yet,
    read from the stage's source folder and checked against its ingest sha256.

    Streams: records are read from the specs as they go, at most a few uploads wait at a
    time, and only digests (32 bytes each) are kept. Returns (uploaded, needed): distinct
    images uploaded now and needed in all."""
    client = client or s3_client()
    prefix = staging.source_key("")
    present = {_digest(key.removeprefix(prefix)) for key in _keys(client, staging.bucket, prefix)}
    seen: set[bytes] = set()
    uploaded = 0

    def upload(source_dir: str, record: ShardRecord) -> None:
        body = read_source(source_dir, record)  # checked: a changed file is refused by path
        client.put_object(Bucket=staging.bucket, Key=staging.source_key(record.sha256), Body=body)

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        waiting: set[Future[None]] = set()
        for spec in specs:
            for record in spec.records:
                digest = _digest(record.sha256)
                if digest in seen:
                    continue
                seen.add(digest)
                if digest in present:
                    continue
                waiting.add(pool.submit(upload, spec.source_dir, record))
                uploaded += 1
                if len(waiting) >= 4 * UPLOAD_THREADS:
                    done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()  # the first failure stops the upload
        for future in waiting:
            future.result()
    return uploaded, len(seen)


def _digest(sha256: str) -> bytes:
    """A sha256 as its 32 bytes (a hex string costs three times the memory); b"" if not one."""
    try:
        return bytes.fromhex(sha256)
    except ValueError:
        return b""


def staged_source_reader(staging: Staging, client: Any) -> Callable[[ShardRecord], bytes]:
    """Reads a record's source from the staging prefix by its sha256; bytes with another
    sha256 are refused naming the file (and the object removed, so the next run uploads it
    again)."""

    def read(record: ShardRecord) -> bytes:
        key = staging.source_key(record.sha256)
        data = _get(client, staging, key, f"source {record.path}").read()
        got = hashlib.sha256(data).hexdigest()
        if got != record.sha256:
            client.delete_object(Bucket=staging.bucket, Key=key)
            raise StagingError(
                f"source {record.path}: staged object {staging.where(key)} has sha256 "
                f"{got[:12]}, the index says {record.sha256[:12]}; the object was removed: "
                "rerun the shard stage to upload it again"
            )
        return data

    return read


def write_staged_batch(specs: list[ShardSpec], staging: Staging) -> list[ShardFile]:
    """On a worker: write each shard from staged sources into a temporary folder of its own,
    upload it under the run's prefix, and return its manifest entry (never touching the
    stage's source or shard folders)."""
    client = s3_client()
    read = staged_source_reader(staging, client)
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="shardflow-staged-") as tmp,
        ThreadPoolExecutor(READ_AHEAD) as pool,
    ):
        for spec in specs:
            result = write_shard(spec, Path(tmp), read_ahead(read, spec.records, pool))
            path = Path(tmp) / spec.file
            client.upload_file(str(path), staging.bucket, staging.shard_key(spec.file))
            path.unlink()
            results.append(result)
    return results


def read_ahead(
    read: Callable[[ShardRecord], bytes], records: Iterable[ShardRecord], pool: Executor
) -> Callable[[ShardRecord], bytes]:
    """``read`` for records asked for in the order of ``records``, each fetched in ``pool``
    up to :data:`READ_AHEAD` records before it is asked for: a GET's round trip (tens of
    milliseconds on S3, hundreds of records a shard) overlaps the decoding of the ones
    before it instead of adding to it."""
    upcoming = iter(records)
    fetching: deque[tuple[ShardRecord, Future[bytes]]] = deque()

    def next_record(record: ShardRecord) -> bytes:
        while len(fetching) < READ_AHEAD and (ahead := next(upcoming, None)) is not None:
            fetching.append((ahead, pool.submit(read, ahead)))
        if not fetching or fetching[0][0] is not record:
            raise RuntimeError(f"source {record.path}: asked for out of the shard's order")
        return fetching.popleft()[1].result()

    return next_record


def fetch_shard(staging: Staging, result: ShardFile, folder: Path, *, client: Any = None) -> None:
    """Download a worker's shard into ``folder`` (temp file, fsync, rename), its size and
    sha256 checked against the entry the worker returned."""
    client = client or s3_client()
    key = staging.shard_key(result.file)
    final = Path(folder) / result.file
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        digest, size = hashlib.sha256(), 0
        with tmp.open("wb") as out, _get(client, staging, key, f"shard {result.file}") as body:
            while block := body.read(_CHUNK):
                size += len(block)
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if size != result.bytes or digest.hexdigest() != result.sha256:
            raise StagingError(
                f"shard {result.file}: staged object {staging.where(key)} has {size} bytes with "
                f"sha256 {digest.hexdigest()[:12]}, its worker wrote {result.bytes} bytes with "
                f"sha256 {result.sha256[:12]}; rerun the shard stage"
            )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def remove_run(staging: Staging, *, client: Any = None) -> int:
    """Delete every object under the run's shard prefix; returns how many."""
    client = client or s3_client()
    keys = list(_keys(client, staging.bucket, staging.run_prefix()))
    for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
        chunk = [{"Key": key} for key in keys[start : start + 1000]]
        client.delete_objects(Bucket=staging.bucket, Delete={"Objects": chunk, "Quiet": True})
    return len(keys)


def _keys(client: Any, bucket: str, prefix: str) -> Iterator[str]:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            yield str(item["Key"])


def _get(client: Any, staging: Staging, key: str, what: str) -> Any:
    from botocore.exceptions import ClientError

    try:
        return client.get_object(Bucket=staging.bucket, Key=key)["Body"]
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound"):
            raise StagingError(f"{what}: no staged object {staging.where(key)}") from error
        raise StagingError(f"{what}: {staging.where(key)}: {error}") from error
