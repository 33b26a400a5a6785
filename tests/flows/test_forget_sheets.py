"""Sheets in `shardflow forget`: a dry run draws the images that would go into the per-clone
sheets folder and changes nothing else; a forget removes every sheet drawn from a set that
held the image (group and dry-run sheets, the evaluation's pictures and their DVC objects),
and keeps the sheets of sets that never held it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from flows.forget.orchestration import main
from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import load_forgotten
from tasks.contracts.sheet_source import sheet_images
from tasks.evaluate.sheets import plot_image_sheet
from tasks.ingest.group_sheets import write_group_sheet
from tasks.runtime.layout import Layout
from tests.flows.test_forget_identity import dvc_object, small_project, tree_digests

__all__ = ["small_project"]  # the fixture, shared with the identity tests


def test_a_dry_run_draws_every_image_that_would_go_and_changes_nothing_else(
    small_project: Path, capsys: object
) -> None:
    root, layout = small_project, Layout(small_project)
    gone = {
        file_sha256(root / "images/red/001.png"),
        file_sha256(root / "images/red/001-large.png"),
    }
    (root / "images/red/001_copy.png").unlink()  # drawn from its shard record
    before = tree_digests(root)

    assert main(["images/red/001.png", "--reason", "x", "--dry-run", "--root", str(root)]) == 0

    sheet = layout.sheets / "forget-dry-run.png"
    after = tree_digests(root)
    assert after.pop(sheet.relative_to(root).as_posix()) and after == before
    assert sheet_images(sheet) == gone
    assert "forget-dry-run.png" in capsys.readouterr().out  # type: ignore[attr-defined]


def eval_pictures(root: Path, shown: list[str]) -> dict[str, Path]:
    """plots/eval as evaluate leaves it, drawn by its drawer; its listing and pictures in
    the DVC cache, and a dvc.lock whose evaluate stage read the current shard set (its
    listing and manifest in the cache too)."""
    eval_dir, cache = Layout(root).eval_dir, root / ".dvc" / "cache"
    eval_dir.mkdir(parents=True)
    tiles = [(np.asarray(Image.open(root / p).convert("RGB")), p) for p in shown]
    plot_image_sheet(tiles, "none", eval_dir / "misclassified.png")
    plot_image_sheet(tiles[:1], "none", eval_dir / "label_issues.png")
    (eval_dir / "per_class.json").write_text('[{"class": "red"}]')
    objects = {
        n: dvc_object(cache, (eval_dir / n).read_bytes())
        for n in ("misclassified.png", "label_issues.png", "per_class.json")
    }
    listing = [{"md5": p.parent.name + p.name, "relpath": n} for n, p in sorted(objects.items())]
    dir_object = dvc_object(cache, json.dumps(listing).encode(), suffix=".dir")
    manifest = dvc_object(cache, (root / "data" / "shards" / "manifest.json").read_bytes())
    shard_listing = [{"md5": manifest.parent.name + manifest.name, "relpath": "manifest.json"}]
    read = dvc_object(cache, json.dumps(shard_listing).encode(), suffix=".dir")
    shards = {"path": "data/shards", "md5": read.parent.name + read.name}
    stages = {
        "shard": {"outs": [shards]},
        "evaluate": {
            "deps": [shards],
            "outs": [{"path": "plots/eval", "md5": dir_object.parent.name + dir_object.name}],
        },
    }
    (root / "dvc.lock").write_text(yaml.safe_dump({"stages": stages}))
    return objects


def test_forget_removes_every_sheet_of_a_set_that_held_the_image_and_keeps_the_others(
    small_project: Path,
) -> None:
    root, layout = small_project, Layout(small_project)
    source = root / "images"
    hashes = {p.relative_to(source).as_posix(): file_sha256(p) for p in source.rglob("*.png")}
    labels = {p: p.split("/")[0] for p in hashes}
    groups = layout.sheets / "near-duplicates"
    held_group = {
        "paths": ["red/001.png", "red/001-large.png"],
        "labels": ["red"],
        "split": "train",
    }
    other_group = {"paths": ["green/001.png", "green/002.png"], "labels": ["green"], "split": "val"}
    write_group_sheet(source, held_group, labels, hashes, groups / "near-duplicate-group-1.png")
    write_group_sheet(source, other_group, labels, hashes, groups / "near-duplicate-group-2.png")
    assert main(["images/green/001.png", "--dry-run", "--exact", "--root", str(root)]) == 0
    other_dry_run = layout.sheets / "another-dry-run.png"
    shutil.move(layout.sheets / "forget-dry-run.png", other_dry_run)
    assert main(["images/red/001.png", "--dry-run", "--root", str(root)]) == 0
    objects = eval_pictures(root, ["images/red/001.png", "images/green/001.png"])

    assert main(["images/red/001.png", "--reason", "x", "--root", str(root)]) == 0

    left = sorted(p.relative_to(root).as_posix() for p in layout.sheets.rglob("*.png"))
    assert left == [
        ".shardflow/sheets/another-dry-run.png",
        ".shardflow/sheets/near-duplicates/near-duplicate-group-2.png",
    ]
    assert not (layout.eval_dir / "misclassified.png").exists()
    assert not (layout.eval_dir / "label_issues.png").exists()
    assert not objects["misclassified.png"].exists() and not objects["label_issues.png"].exists()
    assert objects["per_class.json"].exists()  # no picture
    (erasure,) = load_forgotten(layout.forgotten).erasures
    listed = erasure.removed["sheets"]
    assert ".shardflow/sheets/forget-dry-run.png" in listed
    assert "plots/eval/misclassified.png" in listed and len(listed) == 6
    assert not any("sheets" in path for path in erasure.removed["still_mentioning"])
    assert "001" not in layout.forgotten.read_text()


def test_a_resumed_forget_removes_the_pictures_it_found_after_a_retrain_redrew_them(
    small_project: Path,
) -> None:
    """The pictures' objects are taken when the erasure begins: killed after the pipeline
    step redrew ``plots/eval`` from the new set, the resumed forget still removes the old
    objects, and keeps the new pictures and an old object whose bytes they still have."""
    from flows.forget.orchestration import STEP_RUNS, STEPS, forget, parser, start
    from tasks.runtime.params import load_params

    root, layout = small_project, Layout(small_project)
    old = eval_pictures(root, ["images/red/001.png", "images/green/001.png"])
    plot_image_sheet([], "none", layout.eval_dir / "label_issues.png")  # drawn the same again
    old["label_issues.png"] = dvc_object(
        root / ".dvc" / "cache", (layout.eval_dir / "label_issues.png").read_bytes()
    )
    params = load_params(layout.params)
    args = parser().parse_args(["images/red/001.png", "--reason", "x", "--root", str(root)])
    job = start(args, layout, params)
    assert job is not None
    for step in STEPS[: STEPS.index("pipeline") + 1]:
        STEP_RUNS[step](job)
    # what the retrain leaves: pictures of the new set, which dvc.lock says evaluate read
    shutil.rmtree(layout.eval_dir)
    new = eval_pictures(root, ["images/green/001.png"])
    plot_image_sheet([], "none", layout.eval_dir / "label_issues.png")

    resumed = start(parser().parse_args(["--resume", "--root", str(root)]), layout, params)
    assert resumed is not None
    forget(resumed)

    assert not old["misclassified.png"].exists()
    assert (layout.eval_dir / "misclassified.png").exists() and new["misclassified.png"].exists()
    assert (layout.eval_dir / "label_issues.png").exists() and old["label_issues.png"].exists()
