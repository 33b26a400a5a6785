"""DVC depends on a listing of ingest.source_dir, never on its bytes: special files and stray
links are listed with their reason (ingest quarantines them), never opened."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tasks.contracts.content import file_sha256
from tasks.ingest.filenames import main
from tasks.ingest.source_check import HashCache, SourceRefused, listing, source_record
from tasks.runtime.params import shipped_params_text
from tests.conftest import write_image_folder

REPO = Path(__file__).resolve().parents[3]


# a FIFO that were opened would block the listing for good: fail instead of hanging the suite
@pytest.mark.timeout(60, method="thread")
def test_special_files_and_stray_links_are_listed_with_their_reason_never_opened(
    tmp_path: Path,
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
    kinds = {Path(e.path).name: e.kind for e in listing(src)}
    assert kinds["pipe.png"] == "a FIFO"
    assert kinds["zero.png"] == "a link to /dev/zero, outside the folder"
    assert kinds["gone.png"] == "a broken link (its target does not exist)"
    assert kinds["loop_a.png"].startswith("a link that cannot be followed")
    assert kinds["passwd.png"] == "a link to /etc/passwd, outside the folder"
    secret = (tmp_path / "secret.txt").resolve()
    assert kinds["secret.png"] == f"a link to {secret}, outside the folder"
    fine = next(e for e in listing(src) if e.path == "blue/fine.jpg")
    assert (fine.kind, fine.target) == ("link", "red/000.jpg")
    assert fine.sha256 == file_sha256(src / "red" / "000.jpg")
    assert kinds["red"] == "dir" and kinds["001.png"] == "file"
    assert main(["check", str(src)]) == 0  # ingest quarantines them: nothing to refuse


def test_the_listing_changes_exactly_when_a_files_content_does(tmp_path: Path) -> None:
    src = write_image_folder(tmp_path / "src", per_class=2)
    hashes = HashCache()
    first = source_record(str(src), hashes)
    image = src / "red" / "001.png"
    assert hashes.seen[str(image.resolve())][1] == file_sha256(image)
    # unchanged: the same listing, from the hashes known under the same stat (none read)
    again = HashCache(known=hashes.seen)
    assert source_record(str(src), again) == first and again.seen == hashes.seen
    stat = image.stat()
    image.write_bytes(bytes(reversed(image.read_bytes())))  # same size, other content
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even under the same mtime
    assert source_record(str(src), HashCache(known=hashes.seen)) != first
    image.write_bytes(bytes(reversed(image.read_bytes())))  # the old bytes, a new mtime
    assert source_record(str(src), HashCache(known=hashes.seen)) == first
    (src / "red" / "new.png").write_bytes(b"x")
    assert source_record(str(src)) != first
    # a name that is not UTF-8 (DVC fails on one in a folder it hashes) is listed, escaped
    with open(os.path.join(os.fsencode(src / "red"), b"caf\xe9.png"), "wb") as handle:
        handle.write(b"y")
    assert "red/caf\\udce9.png" in json.dumps(source_record(str(src)))
    assert source_record(str(tmp_path / "absent"))["missing"] is True


def test_a_source_dir_no_folder_can_be_called_is_refused_naming_the_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "data/x\0"]) == 1
    assert "refused: ingest.source_dir='data/x\\x00' holds a NUL byte" in capsys.readouterr().err
    with pytest.raises(SourceRefused, match=r"ingest\.source_dir"):
        source_record("data/x\0")


def test_no_stage_depends_on_the_source_folder_itself() -> None:
    """DVC hashes a folder dep before any stage runs (and hangs on a FIFO in it): ingest
    depends on the always-rewritten listing instead."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        assert "${ingest.source_dir}" not in stage.get("deps", []), name
    assert stages["source"]["always_changed"] is True
    assert "data/ingest/source_listing.json" in stages["ingest"]["deps"]


def test_links_into_the_projects_own_dvc_cache_are_the_folders_files(tmp_path: Path) -> None:
    # how `dvc checkout` lays out a tracked folder under `cache.type symlink`
    project = tmp_path / "project"
    src = write_image_folder(project / "data" / "photos", per_class=1)
    cached = project / ".dvc" / "cache" / "files" / "md5" / "ab" / "cdef"
    cached.parent.mkdir(parents=True)
    (src / "red" / "000.jpg").rename(cached)
    (src / "red" / "000.jpg").symlink_to(cached)
    other = write_image_folder(tmp_path / "other" / ".dvc" / "cache", per_class=1)
    (src / "red" / "001.jpg").symlink_to(other / "red" / "000.jpg")  # another project's cache
    found = {e.path: e for e in listing(src)}
    # the same entry as the plain file a hardlink or copy cache leaves
    assert (found["red/000.jpg"].kind, found["red/000.jpg"].target) == ("file", "")
    assert found["red/000.jpg"].sha256 == file_sha256(cached)
    assert found["red/001.jpg"].kind.endswith("outside the folder")


def test_a_deployment_run_lists_the_source_before_dvc_judges_ingest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deployment runs ask DVC whether ingest is current, without `dvc repro` running the
    source stage first: the data flow lists the folder and records it itself."""
    from flows import data
    from tasks.ingest.source_check import LISTING

    (tmp_path / "params.yaml").write_text(shipped_params_text())
    write_image_folder(tmp_path / "data" / "demo", per_class=1)
    events: list[tuple[str, str, bool]] = []

    def record(stage: str, root: Path) -> None:
        events.append(("record", stage, (root / LISTING).is_file()))

    def run(name: str, root: Path, step: object, *, dvc_bookkeeping: bool) -> None:
        events.append(("run", name, dvc_bookkeeping))

    monkeypatch.setattr(data, "record_stage", record)
    monkeypatch.setattr(data, "run_stage", run)
    data.data_flow.fn(root=str(tmp_path), stages=["ingest"], dvc_bookkeeping=True)
    assert events == [("record", "source", True), ("run", "ingest", True)]
    listed = json.loads((tmp_path / LISTING).read_text())
    assert listed["source_dir"] == "data/demo" and len(listed["entries"]) == 3 + 3
