"""What ``shardflow forget`` removes outside the working tree: objects in S3-compatible
storage (the project's DVC remotes on S3, Dask staging, a published shard set) and the
Prefect server's flow-run logs and artifacts that name a forgotten image.

An object is matched as a local file is, by identity (:func:`tasks.erasure.identity.holds`):
a forgotten source file, a copy named by its hash, records or JSON that carry a forgotten
hash or path whole. Every object under a prefix is read: DVC names objects by their md5, so
only what they are tells which held an image; an object the working tree's ``dvc.lock``
needs is never removed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.contracts.shard_store import split_url
from tasks.erasure.identity import Forgotten, holds
from tasks.erasure.lost_revisions import object_id


@dataclass(frozen=True)
class Bucket:
    """An ``s3://bucket/prefix`` and the client that reaches it."""

    url: str
    client: Any

    def object_keys(self) -> Iterator[str]:
        bucket, prefix = split_url(self.url)
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                yield str(item["Key"])


def scrub_bucket(
    store: Bucket, forgotten: Forgotten, *, current: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Delete every object under the prefix that holds a forgotten image by identity, but
    the DVC objects in ``current``; their ``s3://`` URLs."""
    bucket, _ = split_url(store.url)
    removed = []
    for key in store.object_keys():
        if object_id(key) in current:
            continue
        data = store.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        if data and holds(key.rsplit("/", 1)[-1], data, forgotten):
            store.client.delete_object(Bucket=bucket, Key=key)
            removed.append(f"s3://{bucket}/{key}")
    return sorted(removed)


def dvc_s3_remotes(dvc_dir: Path) -> list[Bucket]:
    """The project's DVC remotes on S3, each with a boto3 client made from the remote's own
    config (``endpointurl``, region, profile, keys: ``.dvc/config`` and ``config.local``);
    what a remote leaves unset comes from boto3's environment, as for dvc-s3."""
    import boto3
    from dvc.config import Config

    remotes = Config(dvc_dir=str(dvc_dir), validate=False).get("remote", {})
    found = []
    for remote in remotes.values():
        url = str(remote.get("url", ""))
        if not url.startswith("s3://"):
            continue
        session = boto3.session.Session(profile_name=remote.get("profile"))
        client = session.client(
            "s3",
            endpoint_url=remote.get("endpointurl"),
            region_name=remote.get("region"),
            aws_access_key_id=remote.get("access_key_id"),
            aws_secret_access_key=remote.get("secret_access_key"),
            aws_session_token=remote.get("session_token"),
        )
        found.append(Bucket(url, client))
    return found


@dataclass
class PrefectScrub:
    """What was deleted from the Prefect server (ids only: a log line may name the image)."""

    flow_runs: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)


PAGE = 200  # the server's largest page for logs and artifacts


def scrub_prefect(client: Any, forgotten: Forgotten) -> PrefectScrub:
    """Delete the artifacts that name a forgotten image (a hash or a path, whole), and the
    flow runs whose logs do (the API deletes a run's logs only with the run). ``client``: a
    sync Prefect client."""
    done = PrefectScrub()
    artifacts = [  # read whole before any deletion moves the pages
        artifact.id
        for artifact in _pages(client.read_artifacts)
        if forgotten.named_in(f"{artifact.key} {artifact.description} {artifact.data}")
    ]
    for artifact_id in artifacts:
        client.delete_artifact(artifact_id)
        done.artifacts.append(str(artifact_id))
    runs = {
        log.flow_run_id
        for log in _pages(client.read_logs)
        if log.flow_run_id is not None and forgotten.named_in(log.message)
    }
    for run_id in sorted(runs, key=str):
        client.delete_flow_run(run_id)
        done.flow_runs.append(str(run_id))
    return done


def _pages(read: Any) -> Iterator[Any]:
    offset = 0
    while page := read(limit=PAGE, offset=offset):
        yield from page
        offset += len(page)
