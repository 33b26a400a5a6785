"""The ingest index: the contract between ingest (its writer) and shard (its reader).

A module of its own so the shard stage depends on the index format, not on ingest's code:
editing how ingest checks or reports files never reshards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INDEX_VERSION = 2


def load_index(index_path: Path) -> dict[str, Any]:
    if not index_path.exists():
        raise FileNotFoundError(f"{index_path}: no ingest index; run the ingest stage first")
    index: dict[str, Any] = json.loads(index_path.read_text())
    if index.get("version") != INDEX_VERSION:
        raise ValueError(
            f"{index_path}: index version {index.get('version')}, expected {INDEX_VERSION}; "
            "rerun the ingest stage"
        )
    return index
