"""The data gate keeps its baseline: a change validation refused stays refused after a kill,
a rebuild (`dvc repro -f shard`), `make compact` or in a fresh clone, until one explicit,
recorded step accepts it, the limits untouched. Each dataset has its own baseline: the first
validated set of one the record has none of becomes it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from flows.cli import accept_data
from tasks.contracts.manifest import ShardFile, load_manifest
from tasks.ingest.demo_data import generate
from tasks.runtime.dataset_identity import dataset_identity
from tasks.runtime.layout import Layout
from tasks.runtime.params import ValidateParams, default_params, shipped_params_text
from tasks.shard.spec import ShardSpec
from tasks.shard.stage import shard_stage
from tasks.shard.workers import run_params
from tasks.shard.writing import write_inline
from tasks.train.stage import ShardsNotValidated, check_validated
from tasks.validate.stage import ValidationFailed, data_gate, raise_if_failed, run_validate
from tests.data.test_data_diff import limits
from tests.unit.shard.test_append import Project, add_images

# What validation reports, not how it runs its TensorFlow cross-check (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cross_check_in_process")

STRICT = limits(max_class_share_shift=0.1, allow_new_classes=False)


class GatedProject(Project):
    """:class:`Project` laid out as the repository is (``data/shards``, ``data/accepted.json``,
    ``reports/``), so the accept-data command finds it by its root."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.layout = Layout(root)
        self.shards = self.layout.shards_dir
        self.name_source("images")

    def name_source(self, folder: str) -> None:
        """Point the project's ``params.yaml`` (the repository's, with its lock timeout) at
        ``folder``: the dataset accept-data accepts for, and the one :meth:`validate` gates."""
        self.source = self.root / folder
        text = shipped_params_text()
        (self.root / "params.yaml").write_text(
            text.replace("source_dir: data/demo ", f"source_dir: {folder} ", 1)
        )

    @property
    def dataset(self) -> str:
        return dataset_identity(str(self.source), None, self.root)

    def validate(self, limits: ValidateParams = STRICT) -> dict[str, Any]:
        return run_validate(
            self.shards,
            self.layout.validation_report,
            self.layout.validation_summary,
            index_path=self.index,
            accepted_path=self.layout.accepted_data,
            diff_path=self.layout.data_diff,
            limits=limits,
            dataset=self.dataset,
        )

    def record(self) -> dict[str, Any]:
        return dict(json.loads(self.layout.accepted_data.read_text()))

    def accepted(self) -> dict[str, Any]:
        """This dataset's accepted version."""
        return dict(self.record()["datasets"][self.dataset])

    def fingerprint(self) -> str:
        return load_manifest(self.shards).fingerprint


def failed(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["message"] for c in report["checks"] if not c["passed"]}


@pytest.fixture
def refused(tmp_path: Path) -> GatedProject:
    """An accepted 3-class set, then a class folder ``blob`` added and rebuilt: refused."""
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]  # the first build becomes the accepted version
    add_images(project.source, "blob", 6, seed=7)
    project.update("rebuild")
    assert_refused(project)
    return project


def assert_refused(project: GatedProject) -> None:
    report = project.validate()
    assert list(failed(report)) == ["data_diff"], failed(report)
    assert "new classes ['blob']" in failed(report)["data_diff"]
    with pytest.raises(ShardsNotValidated, match="data_diff"):
        check_validated(project.shards, project.layout.validation_report)


def test_the_first_build_is_recorded_as_the_accepted_version(tmp_path: Path) -> None:
    project = GatedProject(tmp_path)
    project.update("rebuild")
    report = project.validate()
    assert report["passed"]
    accepted = project.accepted()
    manifest = load_manifest(project.shards)
    assert accepted["fingerprint"] == manifest.fingerprint
    assert accepted["class_counts"] == {
        split: {c: n for c, n in info.class_counts.items() if n}
        for split, info in manifest.splits.items()
    }
    # passed by validation: no who or when, so a clone that rebuilds it gets the same bytes
    assert accepted["acceptance"] == {
        "how": "first build",
        "by": None,
        "at": None,
        "reason": "the first validated shard set of dataset 'images': no version of it "
        "accepted before",
        "previous_fingerprint": None,
    }
    assert project.record()["format"] == 2 and list(project.record()["datasets"]) == ["images"]
    before = project.layout.accepted_data.read_bytes()
    assert project.validate()["passed"]  # the same set again: the record keeps its bytes
    assert project.layout.accepted_data.read_bytes() == before


def test_a_passing_report_reads_the_same_before_and_after_its_set_is_accepted(
    tmp_path: Path,
) -> None:
    """Train and evaluate depend on reports/validation.json. A passing validation makes its
    set the accepted version, so validating the same shards again (a validate param changed)
    reworded the data gate's check ("the accepted data version ...") and retrained on them."""
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]  # the first build becomes the accepted version
    add_images(project.source, "red", 2, seed=9)
    project.update("rebuild")
    assert project.validate()["passed"]  # grown within the limits: accepted now
    first = project.layout.validation_report.read_bytes()
    assert project.validate(limits(max_class_share_shift=0.2, allow_new_classes=False))["passed"]
    assert project.layout.validation_report.read_bytes() == first
    diff = json.loads(project.layout.data_diff.read_text())  # the gate's detail is there
    assert diff["accepted_fingerprint"] == project.fingerprint() and diff["unchanged"]


def test_a_class_that_vanished_is_refused_until_accepted(tmp_path: Path) -> None:
    """A class whose folder went missing (a failed sync) passed when its share was under
    the shift limit: the next model silently stopped knowing it."""
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]
    shutil.rmtree(project.source / "blue")
    project.update("rebuild")
    report = project.validate(limits(max_class_share_shift=1.0, allow_new_classes=True))
    assert list(failed(report)) == ["data_diff"]
    assert "classes removed ['blue']" in failed(report)["data_diff"]
    assert "shardflow accept-data --fingerprint" in failed(report)["data_diff"]


def test_a_set_that_shrank_evenly_is_refused_past_max_record_drop(tmp_path: Path) -> None:
    """Half of every class gone (a half-finished sync) kept every share: the gate passed it
    and the next model trained on half the data."""
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]
    images = {c: sorted((project.source / c).iterdir()) for c in ("red", "green", "blue")}
    for files in images.values():
        files.pop().unlink()  # one of 8 each: -12.5%, within the default limit
    project.update("rebuild")
    assert project.validate()["passed"]
    for files in images.values():
        for path in files[: len(files) // 2]:
            path.unlink()
    project.update("rebuild")
    report = project.validate()
    assert list(failed(report)) == ["data_diff"], failed(report)
    assert "records fell 21 -> 12" in failed(report)["data_diff"]
    assert "validate.max_record_drop=0.25" in failed(report)["data_diff"]
    assert project.validate(limits(max_record_drop=0.5))["passed"]


class Killed(Exception):
    """Stands for SIGKILL: the stage stops between two shards."""


def killed_after_one(specs: Iterable[ShardSpec], shards_dir: Path) -> Iterator[ShardFile]:
    for result in write_inline(specs, shards_dir):
        yield result
        raise Killed


def rerun_after_a_kill(project: GatedProject) -> None:
    """A rebuild killed while it writes shards (beside the refused set, which stays in
    place), then run again (it resumes the same plan)."""
    add_images(project.source, "red", 1, seed=11)  # another plan: its shards are written anew
    project.ingest()
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1, "mode": "rebuild"}
    ).shard
    refused = load_manifest(project.shards)
    with pytest.raises(Killed):
        shard_stage(params, project.index, project.shards, write_many=killed_after_one)
    assert load_manifest(project.shards) == refused
    project.shard("rebuild")


def rerun_shard(project: GatedProject) -> None:
    """`dvc repro -f shard`: the shard stage again over the refused set."""
    project.shard("rebuild")


def compact(project: GatedProject) -> None:
    """`make compact` over a refused append: every generation folded into one."""
    add_images(project.source, "blob", 2, seed=8)
    project.update("append")
    assert len(load_manifest(project.shards).generations) == 2
    assert_refused(project)
    params = default_params(
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1, "mode": "append"}
    ).shard
    shard_stage(run_params(params, compact=True), project.index, project.shards)
    assert len(load_manifest(project.shards).generations) == 1


def fresh_clone(project: GatedProject) -> None:
    """A clone: the git-tracked files (the accepted record) and the sources, no shards, no
    index, no reports."""
    for path in (project.shards, project.index, project.root / "reports"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    project.update("rebuild")


@pytest.mark.parametrize("action", [rerun_after_a_kill, rerun_shard, compact, fresh_clone])
def test_a_refused_change_stays_refused(refused: GatedProject, action: Any) -> None:
    baseline = refused.accepted()
    action(refused)
    assert_refused(refused)
    assert refused.accepted() == baseline
    diff = json.loads(refused.layout.data_diff.read_text())
    assert diff["accepted_fingerprint"] == baseline["fingerprint"]
    assert diff["new_classes"] == ["blob"]
    assert diff["counts"]["train"]["blob"]["before"] == 0


def test_accept_data_lets_the_change_pass_and_records_it(
    refused: GatedProject, capsys: pytest.CaptureFixture[str]
) -> None:
    previous = refused.accepted()["fingerprint"]
    fingerprint = refused.fingerprint()
    with pytest.raises(ValidationFailed) as refusal:
        raise_if_failed(refused.validate())
    message = str(refusal.value)
    command = f"shardflow accept-data --fingerprint {fingerprint[:12]}"
    assert command in message and "rerun the shard stage" not in message

    argv = ["--root", str(refused.root), "--fingerprint", fingerprint[:12]]
    assert accept_data.main([*argv, "--reason", "blob is a real class", "--by", "ana"]) == 0
    assert fingerprint[:12] in capsys.readouterr().out
    accepted = refused.accepted()
    assert accepted["fingerprint"] == fingerprint
    assert accepted["acceptance"] | {"at": None} == {
        "how": "accepted",
        "by": "ana",
        "at": None,
        "reason": "blob is a real class",
        "previous_fingerprint": previous,
    }
    assert datetime.fromisoformat(accepted["acceptance"]["at"]).tzinfo is not None
    report = refused.validate()  # the same strict limits
    assert report["passed"], failed(report)
    check_validated(refused.shards, refused.layout.validation_report)
    assert refused.accepted() == accepted  # passing validation keeps who accepted it and why

    # from now on the gate compares against the accepted set: the class is no longer new
    add_images(refused.source, "blob", 1, seed=9)
    refused.update("rebuild")
    assert refused.validate()["passed"]
    assert refused.accepted()["acceptance"]["how"] == "validation passed"
    assert refused.accepted()["acceptance"]["previous_fingerprint"] == fingerprint


def test_accept_data_refuses_what_it_cannot_name(
    refused: GatedProject, capsys: pytest.CaptureFixture[str]
) -> None:
    before = refused.layout.accepted_data.read_bytes()
    root = ["--root", str(refused.root)]
    other = "0123456789ab"
    assert accept_data.main([*root, "--fingerprint", other, "--reason", "x"]) == 2
    assert "not 0123456789ab" in capsys.readouterr().err
    short = refused.fingerprint()[:4]
    assert accept_data.main([*root, "--fingerprint", short, "--reason", "x"]) == 2
    assert accept_data.main([*root, "--fingerprint", refused.fingerprint(), "--reason", " "]) == 2
    assert refused.layout.accepted_data.read_bytes() == before
    assert_refused(refused)


def test_another_dataset_starts_its_own_baseline_and_switching_back_gates_against_the_first(
    tmp_path: Path,
) -> None:
    """The shipped demo baseline refused every adopter's first run as drift: another
    dataset is not a change of this one. Its first validated set becomes its baseline, the
    first dataset's stays, and switching back compares with it."""
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]
    first = project.accepted()
    generate(tmp_path / "photos", per_class=8, min_size=24, max_size=40, broken=False)
    project.name_source("photos")
    project.update("rebuild")
    report = project.validate()  # STRICT: as a change of "images" it was refused
    assert report["passed"], failed(report)
    assert project.record()["datasets"]["images"] == first
    photos = project.accepted()
    assert photos["fingerprint"] == project.fingerprint()
    assert photos["acceptance"]["reason"] == data_gate.first_version_reason("photos")
    diff = json.loads(project.layout.data_diff.read_text())
    assert diff["dataset"] == "photos" and diff["accepted_fingerprint"] is None

    add_images(tmp_path / "images", "blob", 6, seed=7)  # "images" changed meanwhile
    project.name_source("images")
    project.update("rebuild")
    message = failed(project.validate())["data_diff"]
    assert "new classes ['blob']" in message and first["fingerprint"][:12] in message
    assert project.record()["datasets"]["photos"] == photos


def test_a_format_1_record_is_read_as_the_named_datasets_and_rewritten_as_format_2(
    tmp_path: Path,
) -> None:
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]
    version = project.accepted()
    project.layout.accepted_data.write_text(json.dumps({**version, "format": 1}))
    add_images(project.source, "blob", 6, seed=7)
    project.update("rebuild")
    assert "new classes ['blob']" in failed(project.validate())["data_diff"]  # still gated
    add_images(project.source, "red", 1, seed=3)
    shutil.rmtree(project.source / "blob")
    project.update("rebuild")
    assert project.validate()["passed"]
    assert project.record()["format"] == 2
    assert project.accepted()["acceptance"]["previous_fingerprint"] == version["fingerprint"]


def test_a_change_within_the_limits_moves_the_baseline(tmp_path: Path) -> None:
    project = GatedProject(tmp_path)
    project.update("rebuild")
    assert project.validate()["passed"]
    first = project.fingerprint()
    add_images(project.source, "red", 1, seed=3)
    project.update("rebuild")
    assert project.validate()["passed"]
    accepted = project.accepted()
    assert accepted["fingerprint"] == project.fingerprint() != first
    assert accepted["acceptance"]["how"] == "validation passed"
    assert accepted["acceptance"]["previous_fingerprint"] == first
    diff = json.loads(project.layout.data_diff.read_text())
    assert diff["records"]["after"] == diff["records"]["before"] + 1
    assert "accepted `" in project.layout.data_diff.with_suffix(".md").read_text()


def test_an_unreadable_accepted_record_fails_validation_by_name(tmp_path: Path) -> None:
    project = GatedProject(tmp_path)
    project.update("rebuild")
    project.layout.accepted_data.parent.mkdir(parents=True, exist_ok=True)
    project.layout.accepted_data.write_text('{"fingerprint": ')
    report = project.validate()
    assert list(failed(report)) == ["data_diff"]
    assert str(project.layout.accepted_data) in failed(report)["data_diff"]
    assert project.layout.accepted_data.read_text() == '{"fingerprint": '  # never overwritten
    data_gate.accept(
        project.shards,
        project.layout.accepted_data,
        dataset=project.dataset,
        fingerprint=project.fingerprint(),
        reason="the record was damaged",
    )
    assert project.validate()["passed"]
