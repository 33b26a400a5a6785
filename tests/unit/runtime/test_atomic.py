"""Atomic writes: the whole file or the old one, and owner-only where a file may hold a secret."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tasks.runtime.atomic import write_text


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_owner_only_write_is_mode_0600_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "profiles.toml"
    previous = os.umask(0o022)
    try:
        write_text(path, 'PREFECT_API_KEY = "secret"\n', owner_only=True)
    finally:
        os.umask(previous)
    assert path.read_text() == 'PREFECT_API_KEY = "secret"\n'
    assert mode(path) == 0o600


def test_an_owner_only_write_over_a_readable_file_and_a_left_sibling_is_0600(
    tmp_path: Path,
) -> None:
    """The file and the temporary sibling a killed writer left were readable by all: the
    rename puts a 0o600 file in place all the same."""
    path = tmp_path / "server.json"
    path.write_text("{}\n")
    path.chmod(0o644)
    left = tmp_path / f".{path.name}.tmp-{os.getpid()}"
    left.write_text("half")
    left.chmod(0o644)
    write_text(path, '{"url": "http://127.0.0.1:4567/api"}\n', owner_only=True)
    assert path.read_text() == '{"url": "http://127.0.0.1:4567/api"}\n'
    assert mode(path) == 0o600
    assert not left.exists()


def test_a_plain_write_keeps_the_umask_mode(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    previous = os.umask(0o022)
    try:
        write_text(path, "{}\n")
    finally:
        os.umask(previous)
    assert mode(path) == 0o644
