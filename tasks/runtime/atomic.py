"""Atomic file writes: readers never see half a file, and a killed stage never leaves one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling, fsync it, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` (UTF-8)."""
    write_bytes(path, text.encode())


def write_json(path: Path, data: Any) -> None:
    """Stable JSON (sorted keys, indented) written atomically: same data, same bytes."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
