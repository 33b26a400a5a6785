"""Shards read straight from object storage, through a bounded local cache.

A shard set published under an ``s3://bucket/prefix/`` (the shard directory's files under the
same relative names, ``blocks.json`` and ``manifest.json`` beside them) is read without
copying the whole set first: each shard is streamed in one GET and checked block by block
(:mod:`tasks.contracts.shard_blocks`), each block's sha256 against the block list as it
arrives, before it is written; the shard is handed to the reader as a local file only once
all its blocks passed. A bad block stops the download and is refused naming the shard, the
block and its byte range. A fresh shard is not hashed whole
again: every block of it was checked, against a list whose entry carries the manifest's size
and sha256 of that shard. The reader's tf.data pipeline is the local one, reading local
files; it names the next shards ahead of need and the store fetches them on threads of its
own (``prefetch`` shards at a time), so the gate checks each shard as it arrives, not the
whole set up front.

The block list is read once per store, with the manifest, and checked against it: a list
that does not describe the manifest's shards is refused naming it. A set published before
block lists (none in the store) is read as it was then, each shard in one GET checked by its
whole sha256, and one log line says so.

The cache lives in the repository (``.shardflow/shard_cache/``), holds files named by their
sha256, and never holds more than ``max_bytes``: room for a shard is made (least recently
used first) before its download starts. A cached shard read again is hashed again.

TensorFlow 2.21 has no ``s3://`` file system (tensorflow-io does not load on it), so the
download is boto3's; the endpoint and credentials are boto3's own environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), never a file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tasks.contracts.manifest import MANIFEST_NAME, ShardFile, ShardManifest, parse_manifest
from tasks.contracts.shard_blocks import (
    BLOCK_SIZE,
    BLOCKS_NAME,
    BlockList,
    BlockListError,
    ShardBlocks,
    block_entries,
    block_list_text,
    check_block_list,
    parse_block_list,
)
from tasks.runtime.params import ParamsError

if TYPE_CHECKING:
    from tasks.runtime.params import StorageParams

# Where a run's shards live when they are not in data/shards (an s3:// URL). Where data
# lives never changes what is computed, so it is an environment setting beside the endpoint
# and credentials, not a train.* param that would retrain.
SHARDS_URL_ENV = "SHARDFLOW_SHARDS_URL"
CACHE_DIR = Path(".shardflow") / "shard_cache"
# Downloads are read, hashed and written in 1 MiB pieces: memory stays bounded per shard.
SHARD_READ_CHUNK = 1 << 20

log = logging.getLogger(__name__)


class ShardStoreError(RuntimeError):
    """A shard that could not be fetched, or that arrived with other bytes than the manifest's."""


class _NoSuchObject(ShardStoreError):
    """The key is not in the store."""


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix may be empty)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{url!r}: not an s3://bucket/prefix URL")
    prefix = parsed.path.strip("/")
    return parsed.netloc, f"{prefix}/" if prefix else ""


def s3_client() -> Any:
    """A boto3 S3 client configured by the environment only (endpoint, keys, region)."""
    import boto3
    from botocore.config import Config

    # One connection per prefetching thread at least (urllib3's pool default is 10).
    return boto3.client("s3", config=Config(max_pool_connections=32))


class ShardStore:
    """A shard set under an ``s3://`` prefix, read through a bounded LRU cache in the repo.

    ``manifest()`` fetches and checks the manifest; ``fetch(shard)`` returns a local path to
    the shard's verified bytes (downloading it when it is not cached). ``fetch_ahead(shard)``
    starts that download on the store's own ``prefetch`` threads and returns at once, so a
    reader names the shards it will read next and ``fetch`` then waits only for the rest.
    """

    def __init__(
        self,
        url: str,
        root: str | Path,
        *,
        max_bytes: int,
        prefetch: int,
        client: Any = None,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch}: must be at least 1")
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self.cache_dir = Path(root) / CACHE_DIR
        self.max_bytes = max_bytes
        self.prefetch = prefetch
        self._client = client or s3_client()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, oldest first
        self._reserved = 0  # bytes of downloads in flight
        self._manifest: ShardManifest | None = None
        self._blocks: BlockList | None = None  # None with the manifest: a set without a list
        self._manifest_lock = threading.Lock()
        # Downloads started ahead, by sha256. They run on threads of their own: a download
        # waiting on the network in a tf.data map held one of tf.data's threads (as many as
        # cores), so 2 cores downloaded 2 shards at a time and parsed nothing meanwhile.
        self._ahead: dict[str, Future[Path]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._adopt_existing()

    # -- public -----------------------------------------------------------------------------

    def manifest(self) -> ShardManifest:
        """The set's manifest, read from the store (its fingerprint checked), and with it
        the set's block list (checked against it; see :meth:`block_list`)."""
        with self._manifest_lock:
            if self._manifest is None:
                manifest = self._read_manifest()
                self._blocks = self._read_block_list(manifest)
                self._manifest = manifest
            return self._manifest

    def block_list(self) -> BlockList | None:
        """The set's block list, read once with the manifest; None for a set published
        without one (its shards are fetched whole, each checked by its sha256)."""
        self.manifest()
        return self._blocks

    def fetch(self, shard: ShardFile) -> Path:
        """A local path holding exactly ``shard``'s bytes (sha256 checked), else an error
        naming the shard. A cached copy is re-hashed too: nothing unchecked reaches a model;
        a download started by ``fetch_ahead`` was checked block by block as it arrived."""
        with self._lock:
            ahead = self._ahead.pop(shard.sha256, None)
        if ahead is not None:
            path = ahead.result()  # its error (a refused or missing shard) is raised here
            with self._lock:
                if shard.sha256 in self._entries:  # not evicted since it arrived
                    self._entries.move_to_end(shard.sha256)
                    return path
        path = self.cache_dir / shard.sha256
        with self._lock:
            cached = shard.sha256 in self._entries
            if cached:
                self._entries.move_to_end(shard.sha256)
        if cached and _sha256_of(path) == shard.sha256:
            return path
        return self._download(shard, path)

    def fetch_ahead(self, shard: ShardFile) -> None:
        """Start downloading ``shard`` (at most ``prefetch`` downloads at a time) unless it is
        cached or on its way; ``fetch(shard)`` takes the result."""
        with self._lock:
            if shard.sha256 in self._entries:
                return
            started = self._ahead.get(shard.sha256)
            if started is not None and not started.done():
                return  # a finished one that is not cached failed or was evicted: again
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.prefetch, thread_name_prefix="shard-fetch")
            path = self.cache_dir / shard.sha256
            self._ahead[shard.sha256] = self._pool.submit(self._download, shard, path)

    def fetch_all(self, shards: Sequence[ShardFile]) -> list[Path]:
        """Local verified paths of every one of ``shards``, their downloads run side by side:
        a read in a global order needs every shard of its split from its first batch on, so
        the cache must hold them all (an error naming the bound where it cannot)."""
        needed = sum(shard.bytes for shard in shards)
        if needed > self.max_bytes:
            raise ShardStoreError(
                f"the {len(shards)} shards of a split ({needed} bytes, {self.url}) do not fit "
                f"the shard cache of {self.max_bytes} bytes; raise storage.cache_mb above "
                f"{-(-needed // 2**20)}"
            )
        for shard in shards:
            self.fetch_ahead(shard)
        return [self.fetch(shard) for shard in shards]

    def clear(self) -> None:
        """Empty the cache (a cold start): the next read downloads every shard again."""
        with self._lock:
            for sha256 in list(self._entries):
                (self.cache_dir / sha256).unlink(missing_ok=True)
            self._entries.clear()

    def cached_bytes(self) -> int:
        """Bytes the cache directory holds now (files on disk, downloads in flight included)."""
        return sum(p.stat().st_size for p in self.cache_dir.iterdir() if p.is_file())

    # -- internals --------------------------------------------------------------------------

    def _read_manifest(self) -> ShardManifest:
        key = self.prefix + MANIFEST_NAME
        body = self._get(key)
        with body:
            manifest = parse_manifest(body.read().decode(), where=f"s3://{self.bucket}/{key}")
        largest = max((s.bytes for i in manifest.splits.values() for s in i.shards), default=0)
        # Shards downloaded ahead and not yet opened stay cached: room for the ones in
        # flight, the ones waiting to be read and the one being read.
        needed = (2 * self.prefetch + 1) * largest
        if self.max_bytes < needed:
            raise ValueError(
                f"shard cache of {self.max_bytes} bytes cannot hold {2 * self.prefetch + 1} "
                f"shards of up to {largest} bytes ({self.url}); raise the cache bound to "
                f"{needed} bytes or lower prefetch"
            )
        return manifest

    def _read_block_list(self, manifest: ShardManifest) -> BlockList | None:
        """The store's ``blocks.json``, checked against ``manifest`` (refused naming it
        where it does not describe those shards); None, with one log line, where absent."""
        key = self.prefix + BLOCKS_NAME
        where = f"s3://{self.bucket}/{key}"
        try:
            body = self._get(key)
            with body:
                text = body.read().decode()
        except _NoSuchObject:
            log.warning(
                "%s: no block list; each shard of %s is fetched whole and checked by its sha256 "
                "(republish the shard set to fetch them by blocks)",
                where,
                self.url,
            )
            return None
        try:
            return check_block_list(parse_block_list(text, where=where), manifest, where=where)
        except BlockListError as error:
            raise ShardStoreError(str(error)) from error

    def _download(self, shard: ShardFile, path: Path) -> Path:
        """Fetch ``shard`` into the cache at ``path``: by blocks where the set has a block
        list, else whole; a part file until every byte is checked."""
        listed = self.block_list()
        self._reserve(shard.sha256, shard.bytes)
        part = path.with_name(f"{path.name}.{threading.get_ident()}.part")
        try:
            if listed is None:  # a set published before block lists
                self._fetch_whole(shard, part)
            else:
                self._fetch_blocks(shard, self._entry(listed, shard), listed.block_size, part)
            os.replace(part, path)
        except BaseException:
            part.unlink(missing_ok=True)
            with self._lock:
                self._reserved -= shard.bytes
            raise
        with self._lock:
            self._reserved -= shard.bytes
            self._entries[shard.sha256] = shard.bytes
        return path

    def _entry(self, listed: BlockList, shard: ShardFile) -> ShardBlocks:
        """``shard``'s entry in the store's list (checked against the store's manifest): a
        shard of another manifest is refused, its bytes are not the store's."""
        entry = listed.shards.get(shard.file)
        if entry is None or (entry.bytes, entry.sha256) != (shard.bytes, shard.sha256):
            raise ShardStoreError(
                f"shard {shard.file} ({shard.bytes} bytes, sha256 {shard.sha256[:12]}) is not "
                f"in the set at {self.url} (its {BLOCKS_NAME} lists it otherwise or not at "
                "all): read the manifest published there, or republish the shard set"
            )
        return entry

    def _fetch_blocks(
        self, shard: ShardFile, entry: ShardBlocks, block_size: int, part: Path
    ) -> None:
        """``shard`` in one GET, streamed into ``part`` a block at a time, each block's sha256
        checked against the list before it is written: the first bad block stops the
        download and is refused naming its number and byte range. One GET a shard, not one a
        block: ranged GETs read the train split at 0.39 of the server's bare whole-object
        reads, whole streams at 0.70 (moto behind the bench's 90 MB/s link, same run)."""
        key = self.prefix + shard.file
        body = self._get(key)  # boto3's stream (entered, it would be urllib3's, unchecked)
        with body, part.open("wb") as out:
            for number in range(len(entry.blocks)):
                first, last = entry.span(number, block_size)
                data = _read_up_to(body, last - first + 1)
                got = hashlib.sha256(data).hexdigest()
                if len(data) != last - first + 1 or got != entry.blocks[number]:
                    short = len(data) != last - first + 1
                    self._refuse_block(shard, entry, number, block_size, short, data, got)
                out.write(data)
            if body.read(1):  # a longer object never fills the cache past its bound
                raise ShardStoreError(
                    f"shard {shard.file} (s3://{self.bucket}/{key}) holds more than the "
                    f"{shard.bytes} bytes the manifest says: refused before any of its records "
                    "were read; republish the shard set"
                )

    def _refuse_block(
        self,
        shard: ShardFile,
        entry: ShardBlocks,
        number: int,
        block_size: int,
        short: bool,
        data: bytes,
        got: str,
    ) -> None:
        first, last = entry.span(number, block_size)
        what = f"{len(data)} bytes" if short else f"sha256 {got[:12]}"
        raise ShardStoreError(
            f"shard {shard.file} (s3://{self.bucket}/{self.prefix}{shard.file}): block {number} "
            f"(bytes {first}-{last}) has {what}, {BLOCKS_NAME} says {last - first + 1} bytes "
            f"with sha256 {entry.blocks[number][:12]} (the manifest: {shard.bytes} bytes): "
            "refused before any of its records were read; republish the shard set"
        )

    def _fetch_whole(self, shard: ShardFile, part: Path) -> None:
        """One GET of the whole shard (a set without a block list), its sha256 checked as
        it streams into ``part``."""
        key = self.prefix + shard.file
        where = f"s3://{self.bucket}/{key}"
        digest, size = hashlib.sha256(), 0
        body = self._get(key)
        with part.open("wb") as out, body:
            while block := body.read(SHARD_READ_CHUNK):
                size += len(block)
                if size > shard.bytes:  # a bigger object never fills the cache past its bound
                    break
                digest.update(block)
                out.write(block)
        if size != shard.bytes or digest.hexdigest() != shard.sha256:
            got = (
                f"sha256 {digest.hexdigest()[:12]}"
                if size == shard.bytes
                else f"{size} bytes"
                if size < shard.bytes
                else f"more than {shard.bytes} bytes"
            )
            raise ShardStoreError(
                f"shard {shard.file} ({where}) has {got}, the manifest says "
                f"{shard.bytes} bytes with sha256 {shard.sha256[:12]}: refused before any of "
                f"its records were read; republish the shard set"
            )

    def _reserve(self, sha256: str, size: int) -> None:
        """Make room for ``size`` bytes, evicting the least recently used shards."""
        with self._lock:
            self._entries.pop(sha256, None)
            while self._entries and self._total() + self._reserved + size > self.max_bytes:
                old, _ = self._entries.popitem(last=False)
                (self.cache_dir / old).unlink(missing_ok=True)
            if self._total() + self._reserved + size > self.max_bytes:
                raise ShardStoreError(
                    f"shard cache {self.cache_dir} is full with downloads in flight "
                    f"({self._reserved} bytes); raise its bound above {self.max_bytes} bytes"
                )
            self._reserved += size  # counted from now; an entry once the bytes are checked

    def _total(self) -> int:
        return sum(self._entries.values())

    def _get(self, key: str) -> Any:
        """The body of ``key`` (a stream), boto3's errors turned into ones that name it."""
        from botocore.exceptions import ClientError

        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise _NoSuchObject(
                    f"s3://{self.bucket}/{key}: no such object; publish the shard set there "
                    f"(python -m tasks.contracts.shard_store publish data/shards {self.url})"
                ) from error
            raise ShardStoreError(f"s3://{self.bucket}/{key}: {error}") from error

    def _adopt_existing(self) -> None:
        """Count what an earlier run left in the cache (oldest first), dropping torn parts."""
        files = sorted(
            (p for p in self.cache_dir.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime
        )
        for path in files:
            if path.suffix == ".part":
                path.unlink(missing_ok=True)
            else:
                self._entries[path.name] = path.stat().st_size
        with self._lock:
            while self._entries and self._total() > self.max_bytes:
                old, _ = self._entries.popitem(last=False)
                (self.cache_dir / old).unlink(missing_ok=True)


def _read_up_to(body: Any, size: int) -> bytes:
    """``size`` bytes of the stream ``body``, fewer only where it ends first."""
    pieces, got = [], 0
    while got < size and (piece := body.read(size - got)):
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


def _sha256_of(path: Path) -> str | None:
    try:
        with path.open("rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except FileNotFoundError:  # evicted between the check and the read
        return None


def publish(shards_dir: str | Path, url: str, *, client: Any = None) -> int:
    """Upload a shard directory's shards, block list and manifest to ``url``; the manifest
    goes last, so a reader never sees a manifest whose shards are not all there. The folder's
    ``blocks.json`` is checked against its manifest (refused naming it where it does not
    describe those shards); a folder without one (written before block lists) gets one built
    from its shards, uploaded and never written there. Returns files uploaded."""
    from tasks.contracts.manifest import load_manifest

    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    listed = _block_list_text(shards_dir, manifest)
    bucket, prefix = split_url(url)
    client = client or s3_client()
    files = [s.file for info in manifest.splits.values() for s in info.shards]
    for name in files:
        client.upload_file(str(shards_dir / name), bucket, prefix + name)
    client.put_object(Bucket=bucket, Key=prefix + BLOCKS_NAME, Body=listed.encode())
    client.upload_file(str(shards_dir / MANIFEST_NAME), bucket, prefix + MANIFEST_NAME)
    return len(files) + 2


def _block_list_text(shards_dir: Path, manifest: ShardManifest) -> str:
    """The folder's ``blocks.json``, checked against ``manifest``, or one built from its
    shards where it has none."""
    path = shards_dir / BLOCKS_NAME
    if not path.exists():
        return block_list_text(
            manifest.fingerprint, block_entries(manifest, shards_dir), BLOCK_SIZE
        )
    text = path.read_text()
    check_block_list(parse_block_list(text, where=str(path)), manifest, where=str(path))
    return text


def shards_url() -> str | None:
    """The ``s3://`` URL a run reads its shards from, or None for the local shard folder."""
    return os.environ.get(SHARDS_URL_ENV) or None


def open_store(root: str | Path, storage: StorageParams) -> ShardStore | None:
    """The store ``SHARDFLOW_SHARDS_URL`` names (cache under ``root``), or None when unset."""
    url = shards_url()
    if url is None:
        return None
    try:
        split_url(url)
    except ValueError as error:  # a setting to change, not I/O to retry
        raise ParamsError(f"{SHARDS_URL_ENV}={url!r}: not an s3://bucket/prefix URL") from error
    max_bytes = int(storage.cache_mb * 2**20)
    return ShardStore(url, root, max_bytes=max_bytes, prefetch=storage.prefetch_shards)


def local_path_fetcher(store: ShardStore, manifest: ShardManifest) -> Callable[[bytes], bytes]:
    """Map a shard's name (bytes, as tf.data passes it) to its verified local path."""
    by_name = _shards_by_name(manifest)

    def fetch(name: bytes) -> bytes:
        return str(store.fetch(by_name[name.decode()])).encode()

    return fetch


def _shards_by_name(manifest: ShardManifest) -> dict[str, ShardFile]:
    return {s.file: s for info in manifest.splits.values() for s in info.shards}


def download_starter(store: ShardStore, manifest: ShardManifest) -> Callable[[bytes], bytes]:
    """Map a shard's name to itself, its download started (``ShardStore.fetch_ahead``)."""
    by_name = _shards_by_name(manifest)

    def start(name: bytes) -> bytes:
        store.fetch_ahead(by_name[name.decode()])
        return name

    return start


if (
    __name__ == "__main__"
):  # python -m tasks.contracts.shard_store publish data/shards s3://bucket/prefix
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "publish":
        sys.exit(
            "usage: python -m tasks.contracts.shard_store publish SHARDS_DIR s3://bucket/prefix"
        )
    print(f"{publish(sys.argv[2], sys.argv[3])} files uploaded to {sys.argv[3]}")
