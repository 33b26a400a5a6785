"""Atomic file writes: readers never see half a file, and a killed stage never leaves one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_bytes(path: Path, data: bytes, *, owner_only: bool = False) -> None:
    """Write ``data`` to a temporary sibling, fsync it, then rename it over ``path``.
    ``owner_only``: the file is created mode 0o600, never readable by others even for a
    moment (a Prefect profile may hold an API key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb", opener=_owner_only_opener if owner_only else None) as handle:
        if owner_only:  # a sibling a killed writer left keeps its mode through O_CREAT
            os.fchmod(handle.fileno(), 0o600)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _owner_only_opener(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def write_text(path: Path, text: str, *, owner_only: bool = False) -> None:
    """:func:`write_bytes` of ``text`` (UTF-8)."""
    write_bytes(path, text.encode(), owner_only=owner_only)


def write_json(path: Path, data: Any) -> None:
    """Stable JSON (sorted keys, indented) written atomically: same data, same bytes."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
