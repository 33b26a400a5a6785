"""What every stage names data by, free of any stage: the split names and a file's sha256.

Ingest assigns records to these splits and hashes source files with this; the shard
manifest lists the same splits and checks shards with the same hash, and ingest need not
import the manifest for either.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SPLITS = ("train", "val", "test")


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read ``chunk`` bytes at a time (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
