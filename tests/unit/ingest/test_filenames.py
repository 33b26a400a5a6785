"""File names DVC cannot hash: found, and renamed losslessly on request."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.ingest.filenames import escaped_name, find_invalid, fix, main, original_name


@pytest.mark.parametrize(
    "name",
    [b"caf\xe9.jpg", b"100%\xff.png", b"\xc3\x28x", b"ok-\xe2\x82\xac-\xe2\x82.png", b"%41\x80"],
)
def test_escaping_is_lossless_and_valid_utf8(name: bytes) -> None:
    escaped = escaped_name(name)
    escaped.encode("utf-8")  # always encodable
    assert original_name(escaped) == name


def test_check_names_the_files_and_fix_renames_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "red").mkdir()
    bad_dir = os.fsencode(tmp_path) + b"/bl\xe9u"
    os.mkdir(bad_dir)
    with open(bad_dir + b"/ph\xf6to.png", "wb") as handle:
        handle.write(b"pixels")
    (tmp_path / "red" / "fine %.png").write_bytes(b"x")
    assert main(["check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "bl\\xe9u/ph\\xf6to.png" in err and "python -m tasks.ingest.filenames fix" in err
    moves = fix(tmp_path)
    assert len(moves) == 2 and not find_invalid(tmp_path)
    assert (tmp_path / "bl%E9u" / "ph%F6to.png").read_bytes() == b"pixels"
    assert (tmp_path / "red" / "fine %.png").exists()  # valid names are never touched
    assert original_name("ph%F6to.png") == b"ph\xf6to.png"
    assert main(["check", str(tmp_path)]) == 0
