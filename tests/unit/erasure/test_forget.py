"""Forgetting an image: the plan, the shard rewrite that keeps every other shard's bytes,
and a rerun after a kill that completes the job."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tasks.contracts.content import file_sha256
from tasks.contracts.exclusions import add_excluded, load_excluded
from tasks.contracts.handoff import Target
from tasks.contracts.index import load_index
from tasks.contracts.manifest import MEMBERSHIP_NAME, load_manifest, stream_records
from tasks.contracts.membership import Membership
from tasks.contracts.numpy_reader import iter_split
from tasks.contracts.shard_blocks import BLOCK_SIZE, BLOCKS_NAME, block_entries, block_list_text
from tasks.erasure.forget import (
    ForgetRefused,
    affected_shards,
    filter_shard,
    plan_forget,
    remove_sources,
    rewrite_index,
    rewrite_shards,
    scrub_files,
)
from tasks.erasure.identity import Forgotten
from tasks.erasure.lineage import UnknownImage
from tasks.ingest.stage import run_ingest, signatures_path
from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.tfrecord import open_records, read_framed
from tests.unit.erasure.test_lineage import DISTANCE, layout_project
from tests.unit.shard.test_append import ingest_params

Built = tuple[Layout, Path, str, str]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """A shard set holding ``red/001.png`` and a resized copy of it (its near-duplicate),
    its byte-identical copy ``red/001_copy.png`` left out as a duplicate; a pristine copy of
    the project is kept for each test to start from."""
    root = tmp_path_factory.mktemp("forget")
    project, layout = layout_project(root)
    original = project.source / "red" / "001.png"
    shutil.copy2(original, project.source / "red" / "001_copy.png")
    with Image.open(original) as image:
        image.resize((image.width * 2, image.height * 2), Image.Resampling.NEAREST).save(
            project.source / "red" / "001-large.png"
        )
    project.update("rebuild")
    copy = file_sha256(project.source / "red" / "001-large.png")
    return layout, project.source, file_sha256(original), copy


@pytest.fixture
def fresh(built: Built, tmp_path: Path) -> Built:
    layout, source, sha, copy = built
    shutil.copytree(layout.root, tmp_path / "p", symlinks=True)
    return Layout(tmp_path / "p"), tmp_path / "p" / source.relative_to(layout.root), sha, copy


def digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.tfrecord-*[0-9]"))
    }


def frames(path: Path) -> list[bytes]:
    with open_records(path) as handle:
        return list(iter(lambda: read_framed(handle), None))  # type: ignore[arg-type]


def test_the_plan_takes_the_near_duplicate_group_unless_exact(fresh: Built) -> None:
    layout, source, sha, copy = fresh
    group = plan_forget(
        ["red/001.png"], layout=layout, source_dir=source, distance=DISTANCE, exact=False
    )
    assert group.asked == [sha] and set(group.hashes) == {sha, copy}
    # the byte-identical copy too: ingest filed it as a duplicate, it holds the same bytes
    assert group.sources == ["red/001-large.png", "red/001.png", "red/001_copy.png"]
    exact = plan_forget([sha], layout=layout, source_dir=source, distance=DISTANCE, exact=True)
    assert exact.hashes == [sha] and exact.sources == ["red/001.png", "red/001_copy.png"]


def test_forget_rewrites_only_the_shards_that_held_the_images(fresh: Built) -> None:
    layout, source, sha, _ = fresh
    shards = layout.shards_dir
    before, old = digests(shards), load_manifest(shards)
    plan = plan_forget([sha], layout=layout, source_dir=source, distance=DISTANCE, exact=False)
    hit = affected_shards(shards, plan.hashes)
    old_frames = {file: frames(shards / file) for file in hit}
    assert remove_sources(source, plan, root=layout.root) == sorted(plan.sources)
    assert not (source / "red" / "001.png").exists()
    assert rewrite_index(layout.index, set(plan.hashes)) == 2
    diff_path = layout.root / "reports" / "shard_changes.json"
    manifest = rewrite_shards(shards, set(plan.hashes), diff_path=diff_path)
    diff = json.loads(diff_path.read_text())
    assert (diff["mode"], diff["removed_total"], diff["added_total"]) == ("forget", 2, 0)
    assert "001" not in diff_path.read_text() + diff_path.with_suffix(".md").read_text()
    assert sorted(p.name for p in shards.iterdir() if "spill" in p.name) == []

    after = digests(shards)
    assert {f for f in before if before[f] != after[f]} == set(hit)  # the others: same bytes
    for file in hit:  # the other records of a rewritten shard: the same bytes, in order
        kept = frames(shards / file)
        assert all(frame in old_frames[file] for frame in kept)
        assert not any(h.encode() in frame for frame in kept for h in plan.hashes)
    assert manifest.fingerprint != old.fingerprint
    assert load_manifest(shards) == manifest  # its own fingerprint checks out
    assert manifest.total_records == old.total_records - 2
    listed = [r["sha256"] for _, r in stream_records(shards, manifest)]  # sha256 checked
    assert len(listed) == manifest.total_records and not set(listed) & set(plan.hashes)
    read = sum(1 for split in manifest.splits for _ in iter_split(shards, split))
    assert read == manifest.total_records  # the offset index matches the rewritten files
    fresh_list = block_list_text(manifest.fingerprint, block_entries(manifest, shards), BLOCK_SIZE)
    assert (shards / BLOCKS_NAME).read_text() == fresh_list  # so does the block list
    with Membership(shards / MEMBERSHIP_NAME) as membership:
        assert membership.fingerprint == manifest.fingerprint
        assert membership.find(sha) == [] and membership.count == manifest.total_records
    assert not {r["sha256"] for r in load_index(layout.index)["records"]} & set(plan.hashes)


def test_a_rerun_after_a_kill_midway_ends_where_an_uninterrupted_run_does(
    fresh: Built, tmp_path: Path
) -> None:
    layout, source, sha, _ = fresh
    other = tmp_path / "uninterrupted"
    shutil.copytree(layout.shards_dir, other)
    plan = plan_forget([sha], layout=layout, source_dir=source, distance=DISTANCE, exact=False)
    whole = rewrite_shards(other, set(plan.hashes))
    manifest = load_manifest(layout.shards_dir)
    for file in affected_shards(layout.shards_dir, plan.hashes)[:1]:  # killed after one file
        filter_shard(layout.shards_dir / file, set(plan.hashes), manifest)
    resumed = rewrite_shards(layout.shards_dir, set(plan.hashes))
    assert resumed == whole
    assert rewrite_shards(layout.shards_dir, set(plan.hashes)) == whole  # done: a no-op
    assert digests(layout.shards_dir) == digests(other)


def test_scrub_removes_every_file_holding_the_image_by_identity_and_reports_the_rest(
    fresh: Built, tmp_path: Path
) -> None:
    layout, source, sha, _ = fresh
    plan = plan_forget([sha], layout=layout, source_dir=source, distance=DISTANCE, exact=True)
    forgotten = Forgotten.of(plan.hashes, plan.sources, source_dir=source, root=layout.root)
    data = (source / "red" / "001.png").read_bytes()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "object-a").write_bytes(data)  # the source file
    (cache / "object-b").write_text(f'[{{"relpath": "{plan.sources[0]}"}}]')  # a listing of it
    (cache / f"{sha}.png").write_bytes(b"re-encoded")  # named by its hash
    (cache / "object-d").write_text("nothing of it")
    (cache / "object-e").write_text(f"misclassified: {plan.sources[0]}")  # text: reported
    needed = cache / "ab" / ("c" * 30)  # an object the working tree's dvc.lock needs
    needed.parent.mkdir()
    needed.write_bytes(data)
    (cache / "empty").write_bytes(b"")
    scrubbed = scrub_files([cache], forgotten, current={"ab" + "c" * 30})
    assert {Path(p).name for p in scrubbed.removed} == {"object-a", "object-b", f"{sha}.png"}
    assert {Path(p).name for p in scrubbed.mentioning} == {"object-e"}
    assert sorted(p.name for p in cache.iterdir()) == ["ab", "empty", "object-d", "object-e"]
    assert needed.read_bytes() == data


def test_an_empty_file_or_content_the_project_keeps_is_no_erasable_identity(
    fresh: Built,
) -> None:
    """Its hash is every empty file's (a lock's, a marker's): forget refuses it, saying the
    file was quarantined, never a record."""
    layout, source, _, _ = fresh
    (source / "red" / "empty.png").write_bytes(b"")
    (layout.root / ".shardflow").mkdir(exist_ok=True)
    (layout.root / ".shardflow" / "workspace.lock").write_text("held by shardflow run")
    (source / "red" / "lock.png").write_text("held by shardflow run")
    with contextlib.chdir(layout.root):
        run_ingest(ingest_params(source), layout.index, layout.ingest_report)
    for name, what in (("empty.png", "an empty file's"), ("lock.png", "a file the project keeps")):
        with pytest.raises(ForgetRefused, match=what) as refused:
            plan_forget(
                [f"red/{name}"], layout=layout, source_dir=source, distance=DISTANCE, exact=True
            )
        assert "quarantined by ingest, never a record" in str(refused.value)


@pytest.mark.parametrize(
    "image",
    ["red/never-seen.png", "9" * 64, "x" * 300 + ".png", "red/" + "é" * 200, "bad\x00name"],
)
def test_an_image_the_project_never_saw_is_refused_as_unknown(fresh: Built, image: str) -> None:
    layout, source, _, _ = fresh
    (source / "red" / "never-seen.png").write_bytes(b"\x89PNG added after ingest")
    with pytest.raises(UnknownImage, match="unknown image"):
        plan_forget([image], layout=layout, source_dir=source, distance=DISTANCE, exact=True)


def test_a_source_the_project_may_not_write_keeps_the_image_out_by_the_exclusion_list(
    fresh: Built, tmp_path: Path
) -> None:
    """A source folder outside the project (or read-only) keeps its file; the exclusion
    list keeps it out of every later ingest, which counts it and names it nowhere."""
    layout, source, sha, _ = fresh
    outside = tmp_path / "shared-photos"
    shutil.move(source, outside)
    plan = plan_forget([sha], layout=layout, source_dir=outside, distance=DISTANCE, exact=True)
    assert add_excluded(layout.excluded, plan.hashes)
    assert remove_sources(outside, plan, root=layout.root) == []
    assert (outside / "red" / "001.png").is_file()  # a rebuild reads it again:

    handoff = layout.root / ".shardflow" / "handoff"
    target = Target.of(default_params(shard={"image_size": [16, 16]}).shard)
    excluded = load_excluded(layout.excluded)
    report = run_ingest(
        ingest_params(outside),
        layout.index,
        layout.ingest_report,
        handoff=handoff,
        target=target,
        excluded=excluded,
    )
    assert report["excluded_count"] == 2  # the image and its byte-identical copy
    assert sha not in {r["sha256"] for r in load_index(layout.index)["records"]}
    written = [layout.index, layout.ingest_report, signatures_path(layout.index)]
    assert not [p for p in written if "red/001" in p.read_text().replace("red/001-", "")]
    assert [p for p in handoff.rglob("*") if sha in p.name] == []
    assert json.loads(layout.excluded.read_text()) == {"sha256": [sha]}
