"""What the shard tests share: the tiny shard params and a folder's file digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tasks.runtime.params import ShardParams, default_params

SIZE = (16, 16)
TINY = 0.002  # MiB: about two 16x16 raw records per shard, so every split has several shards


def params(**overrides: object) -> ShardParams:
    values: dict[str, object] = {"image_size": SIZE, "target_shard_mb": TINY, "workers": 1}
    return default_params(shard={**values, **overrides}).shard


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in a folder (hidden plan file and manifest included)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
