"""What DVC cannot hash under ingest.source_dir is refused before `dvc repro`, naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.filenames import main
from tasks.source_check import SourceRefused, check_source, find_problems
from tests.conftest import write_image_folder


# a FIFO that were opened would block the check for good: fail instead of hanging the suite
@pytest.mark.timeout(60, method="thread")
def test_special_files_and_stray_links_are_refused_naming_each_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    (tmp_path / "secret.txt").write_text("outside")
    os.mkfifo(src / "red" / "pipe.png")
    (src / "red" / "zero.png").symlink_to("/dev/zero")
    (src / "green" / "gone.png").symlink_to(src / "green" / "nothing-here.png")
    (src / "green" / "loop_a.png").symlink_to(src / "green" / "loop_b.png")
    (src / "green" / "loop_b.png").symlink_to(src / "green" / "loop_a.png")
    (src / "blue" / "passwd.png").symlink_to("/etc/passwd")
    (src / "blue" / "secret.png").symlink_to(tmp_path / "secret.txt")
    (src / "blue" / "fine.jpg").symlink_to(src / "red" / "000.jpg")  # inside: a file of it
    assert main(["check", str(src)]) == 1
    err = capsys.readouterr().err
    assert "ingest.source_dir" in err and "fix: remove or replace them" in err
    reasons = {Path(p.path).name: p.reason for p in find_problems(src)}
    assert reasons == {
        "pipe.png": "a FIFO",
        "zero.png": "a link to /dev/zero, outside the folder",
        "gone.png": "a broken link (its target does not exist)",
        "loop_a.png": reasons["loop_a.png"],
        "loop_b.png": reasons["loop_b.png"],
        "passwd.png": "a link to /etc/passwd, outside the folder",
        "secret.png": f"a link to {(tmp_path / 'secret.txt').resolve()}, outside the folder",
    }
    assert reasons["loop_a.png"].startswith("a link that cannot be followed")
    for name in reasons:
        assert name in err


def test_a_source_dir_no_folder_can_be_called_is_refused_naming_the_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "data/x\0"]) == 1
    assert "refused: ingest.source_dir='data/x\\x00' holds a NUL byte" in capsys.readouterr().err


def test_links_into_the_projects_own_dvc_cache_are_the_folders_files(tmp_path: Path) -> None:
    # how `dvc checkout` lays out a tracked folder under `cache.type symlink`
    project = tmp_path / "project"
    src = write_image_folder(project / "data" / "photos", per_class=1)
    cached = project / ".dvc" / "cache" / "files" / "md5" / "ab" / "cdef"
    cached.parent.mkdir(parents=True)
    (src / "red" / "000.jpg").rename(cached)
    (src / "red" / "000.jpg").symlink_to(cached)
    check_source(str(src))
    other = write_image_folder(tmp_path / "other" / ".dvc" / "cache", per_class=1)
    (src / "red" / "001.jpg").symlink_to(other / "red" / "000.jpg")  # another project's cache
    with pytest.raises(SourceRefused, match=r"001.jpg: a link to .*, outside the folder"):
        check_source(str(src))
