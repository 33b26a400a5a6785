"""`shardflow forget` chooses what it removes by identity: with numbered file names
(``red/1.png`` ... ``red/11.png``, the same names in every class), forgetting ``red/1.png``
removes the copies and old versions of that image only; what names ``red/11.png`` or
``green/1.png``, the locks, the objects the working tree needs and the current data stay."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from flows.forget.orchestration import main
from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import load_forgotten
from tasks.contracts.manifest import MEMBERSHIP_NAME, load_manifest
from tasks.contracts.membership import Membership
from tasks.runtime.layout import Layout
from tasks.runtime.params import shipped_params_text
from tests.unit.erasure.test_lineage import layout_project, shard_set

CLASSES = ("blue", "green", "red")


def numbered_images(source: Path) -> None:
    """``source/<class>/1.png`` ... ``11.png``: distinct noisy images, names shared across
    classes and each a substring of another (``1.png`` in ``11.png``)."""
    shutil.rmtree(source)
    rng = np.random.default_rng(7)
    for n, label in enumerate(CLASSES):
        (source / label).mkdir(parents=True)
        for i in range(1, 12):
            pixels = rng.integers(0, 256, size=(20, 20 + i, 3), dtype=np.uint8)
            pixels[..., n] = 255
            Image.fromarray(pixels, mode="RGB").save(source / label / f"{i}.png")


def dvc_object(cache: Path, data: bytes, *, suffix: str = "") -> Path:
    digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    path = cache / "files" / "md5" / digest[:2] / (digest[2:] + suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def shard_holding(shards: Path, sha: str) -> str:
    with Membership(shards / MEMBERSHIP_NAME) as membership:
        (member,) = membership.find(sha)
    return member.shard_file


def test_forget_removes_by_identity_never_by_a_name_inside_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, layout = layout_project(tmp_path)
    numbered_images(project.source)
    shard_set(project, layout)
    params = yaml.safe_load(shipped_params_text())
    params["ingest"]["source_dir"] = "images"
    layout.params.write_text(yaml.safe_dump(params))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)

    source, shards = project.source, layout.shards_dir
    gone_sha = file_sha256(source / "red" / "1.png")
    kept_sha = file_sha256(source / "red" / "11.png")
    manifest = load_manifest(shards)
    old_shard = shard_holding(shards, gone_sha)
    kept_shard = shard_holding(shards, kept_sha)
    assert old_shard != kept_shard, "the test needs the two images in different shards"
    records = shards / manifest.generations[0].records_file
    cache = tmp_path / ".dvc" / "cache"
    kept = {
        "a copy of red/11.png": dvc_object(cache, (source / "red" / "11.png").read_bytes()),
        "a copy of green/1.png": dvc_object(cache, (source / "green" / "1.png").read_bytes()),
        "a shard of red/11.png": dvc_object(cache, (shards / kept_shard).read_bytes()),
        "a listing of other images": dvc_object(
            cache,
            b'[{"md5": "0", "relpath": "red/11.png"}, {"relpath": "green/1.png"}]',
            suffix=".dir",
        ),
        "dvc's own empty file": tmp_path / ".dvc" / "tmp" / "btime",
        "the workspace lock": tmp_path / ".shardflow" / "workspace.lock",
        "a report of other images": tmp_path / "reports" / "eval_summary.json",
    }
    gone = {
        "a copy of red/1.png": dvc_object(cache, (source / "red" / "1.png").read_bytes()),
        "the old shard holding it": dvc_object(cache, (shards / old_shard).read_bytes()),
        "the old record list": dvc_object(cache, records.read_bytes()),
        "the old listing of it": dvc_object(
            cache, b'[{"md5": "1", "relpath": "red/1.png"}]', suffix=".dir"
        ),
        "a report naming it": tmp_path / "reports" / "misclassified.json",
    }
    for path in [*kept.values(), *gone.values()]:
        path.parent.mkdir(parents=True, exist_ok=True)
    kept["dvc's own empty file"].write_bytes(b"")
    kept["the workspace lock"].write_bytes(b"")
    kept["a report of other images"].write_text('{"wrong": ["red/11.png", "green/1.png"]}')
    gone["a report naming it"].write_text('{"wrong": ["images/red/1.png"]}')
    # an object the working tree's dvc.lock names: never removed, whatever it holds
    needed = dvc_object(cache, b'[{"md5": "2", "relpath": "red/1.png"}]', suffix=".dir")
    out = {"path": "images", "md5": needed.parent.name + needed.name}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"stages": {"source": {"outs": [out]}}}))
    kept["an object dvc.lock names"] = needed

    code = main(["images/red/1.png", "--reason", "x", "--exact", "--root", str(tmp_path)])

    assert code == 0
    assert not (source / "red" / "1.png").exists()
    assert [name for name, path in kept.items() if not path.exists()] == []
    assert [name for name, path in gone.items() if path.exists()] == []
    assert all((source / label / f"{i}.png").exists() for label in CLASSES for i in range(2, 12))
    new = load_manifest(shards)
    assert new.total_records == manifest.total_records - 1
    assert (shards / kept_shard).read_bytes() == kept["a shard of red/11.png"].read_bytes()
    (erasure,) = load_forgotten(Layout(tmp_path).forgotten).erasures
    assert erasure.state == "done" and erasure.sha256 == [gone_sha]
    # the set the runs used is still known, less the forgotten image: lineage and later
    # erasures find every run that used the others
    with Membership(layout.membership_archive / f"{manifest.fingerprint}.bin") as kept_set:
        assert kept_set.find(gone_sha) == [] and kept_set.find(kept_sha)
        assert kept_set.count == manifest.total_records - 1


def tree_digests(root: Path) -> dict[str, str]:
    """Every file of the project but the workspace lock (a command takes it) and MLflow's."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "mlflow" not in p.name and p.name != "workspace.lock"
    }


@pytest.fixture
def small_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project whose params, index and shards agree, ``red/001.png`` with a resized copy
    (its near-duplicate) and a byte-identical one; MLflow in a SQLite file beside it."""
    project, layout = layout_project(tmp_path)
    original = project.source / "red" / "001.png"
    shutil.copy2(original, project.source / "red" / "001_copy.png")
    with Image.open(original) as image:
        image.resize((image.width * 2, image.height * 2), Image.Resampling.NEAREST).save(
            project.source / "red" / "001-large.png"
        )
    shard_set(project, layout)
    params = yaml.safe_load(shipped_params_text())
    params["ingest"]["source_dir"] = "images"
    layout.params.write_text(yaml.safe_dump(params))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "image",
    ["images/red/never-seen.png", "0" * 64, "images/" + "x" * 300 + ".png", "red/\u00e9\u00e9.png"],
)
def test_an_image_the_project_never_saw_is_refused_and_nothing_is_rewritten(
    small_project: Path, image: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.cli.lineage import main as lineage

    (small_project / "images" / "red" / "never-seen.png").write_bytes(b"\x89PNG after ingest")
    before = tree_digests(small_project)
    assert main([image, "--reason", "x", "--root", str(small_project)]) == 2
    assert lineage([image, "--root", str(small_project)]) == 2
    err = capsys.readouterr().err
    assert err.count("unknown image") == 2 and "Traceback" not in err
    assert tree_digests(small_project) == before


def test_forget_refuses_shards_params_and_index_that_disagree_changing_nothing(
    small_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Params naming another dataset than the index was read from; then shards built from
    another index: refused before the first step."""
    shutil.copytree(small_project / "images", small_project / "other")
    layout = Layout(small_project)
    params = yaml.safe_load(layout.params.read_text())
    params["ingest"]["source_dir"] = "other"
    layout.params.write_text(yaml.safe_dump(params))
    before = tree_digests(small_project)
    assert main(["other/red/001.png", "--reason", "x", "--root", str(small_project)]) == 2
    assert "describe different datasets" in capsys.readouterr().err
    assert tree_digests(small_project) == before

    params["ingest"]["source_dir"] = "images"
    layout.params.write_text(yaml.safe_dump(params))
    index = layout.index.read_text().splitlines(keepends=True)
    header = json.loads(index[0])
    header["num_records"] -= 1
    dropped = [json.dumps(header, sort_keys=True, separators=(",", ":")) + "\n", *index[2:]]
    layout.index.write_text("".join(dropped))
    before = tree_digests(small_project)
    assert main(["images/red/002.png", "--reason", "x", "--root", str(small_project)]) == 2
    assert "built from another index" in capsys.readouterr().err
    assert tree_digests(small_project) == before
    assert load_forgotten(layout.forgotten).erasures == []


def test_a_dry_run_lists_by_path_every_image_that_would_go_and_changes_nothing(
    small_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = small_project
    named, large = (
        file_sha256(root / "images/red/001.png"),
        file_sha256(root / "images/red/001-large.png"),
    )
    before = tree_digests(root)
    assert main(["images/red/001.png", "--reason", "x", "--dry-run", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "3 image(s) would go; nothing was changed" in out
    assert f"red/001.png ({named}: named)" in out
    assert f"red/001_copy.png ({named}: named)" in out  # the same content
    assert f"red/001-large.png ({large}: a near-duplicate)" in out
    after = tree_digests(root)
    assert after.pop(".shardflow/sheets/forget-dry-run.png")  # their sheet, and nothing else
    assert after == before
    assert not Layout(root).forgotten.exists()


def test_the_index_step_counts_what_it_removed_and_the_report_still_adds_up(
    small_project: Path,
) -> None:
    """Where DVC runs the stages, ingest reruns (the exclusion list applied) before the
    index is rewritten: the records it dropped are still counted, and every file found
    is in one bucket of the new report."""
    from flows.forget.orchestration import parser, start, step_index, step_models, step_sources
    from tasks.runtime.params import load_params

    root, layout = small_project, Layout(small_project)
    (root / ".dvc").mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n")
    args = parser().parse_args(["images/red/001.png", "--reason", "x", "--root", str(root)])
    job = start(args, layout, load_params(layout.params))
    assert job is not None
    for step in (step_models, step_sources, step_index):
        step(job)
    assert job.erasure.removed["ingest_index"] == ["2 record(s)"]  # the image, its resized copy
    report = json.loads(layout.ingest_report.read_text())
    buckets = ("accepted", "quarantined_count", "duplicate_count", "skipped_count")
    assert report["files_found"] == sum(report[b] for b in buckets) + report["excluded_count"]
