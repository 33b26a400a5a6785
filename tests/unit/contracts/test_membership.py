"""The membership the shard stage records: where each content hash is, outside the
fingerprint."""

from __future__ import annotations

from pathlib import Path

from tasks.contracts.manifest import MEMBERSHIP_NAME, load_manifest, own_files
from tasks.contracts.membership import (
    Membership,
    archive_membership,
    find_in,
    remove_from_membership,
)
from tasks.schema import HASH_KEY
from tasks.tfrecord import open_records, read_framed
from tests.unit.shard.test_append import Project, add_images


def shard_hashes(shards: Path, file: str) -> list[str]:
    """The content hashes of a shard's records, read from the shard itself."""
    schema = load_manifest(shards).record_schema
    hashes = []
    with open_records(shards / file) as handle:
        while (data := read_framed(handle)) is not None:
            hashes.append(schema.parse(data)[HASH_KEY])
    return hashes


def test_membership_names_each_records_split_generation_shard_and_position(
    tmp_path: Path,
) -> None:
    project = Project(tmp_path)
    project.update("rebuild")
    add_images(project.source, "green", 3, seed=5)
    manifest = project.update("append")
    assert len(manifest.generations) == 2
    assert MEMBERSHIP_NAME in own_files(manifest)  # validation's extra-files check allows it
    split_of = {s.file: split for split, info in manifest.splits.items() for s in info.shards}
    seen = 0
    with Membership(project.shards / MEMBERSHIP_NAME) as membership:
        assert membership.fingerprint == manifest.fingerprint
        assert membership.count == manifest.total_records
        for generation in manifest.generations:
            for file in generation.shards:
                for position, sha in enumerate(shard_hashes(project.shards, file)):
                    (member,) = membership.find(sha)
                    assert (member.shard_file, member.record_index) == (file, position)
                    assert member.split == split_of[file]
                    assert member.generation == generation.number
                    seen += 1
        assert membership.find("0" * 64) == []
        assert membership.find("f" * 64) == []
    assert seen == manifest.total_records


def test_membership_is_outside_the_fingerprint_and_archived_sets_are_searched(
    tmp_path: Path,
) -> None:
    project = Project(tmp_path)
    first = project.update("rebuild")
    archive = tmp_path / "archive"
    archive_membership(project.shards, archive, first.fingerprint)
    (project.shards / MEMBERSHIP_NAME).unlink()
    again = project.shard("rebuild")  # the same plan: every shard kept, the membership rewritten
    assert again.fingerprint == first.fingerprint
    assert (project.shards / MEMBERSHIP_NAME).read_bytes() == (
        archive / f"{first.fingerprint}.bin"
    ).read_bytes()
    add_images(project.source, "red", 1, seed=9)
    second = project.update("rebuild")
    archive_membership(project.shards, archive, second.fingerprint)
    with Membership(project.shards / MEMBERSHIP_NAME) as membership:
        old = next(iter(membership.hashes()))
    with Membership(archive / f"{second.fingerprint}.bin") as membership:
        hashes = list(membership.hashes())
    (new_sha,) = [s for s in hashes if not find_in([archive / f"{first.fingerprint}.bin"], s)]
    paths = sorted(archive.glob("*.bin"))
    assert set(find_in(paths, new_sha)) == {second.fingerprint}
    assert set(find_in(paths, old)) == {first.fingerprint, second.fingerprint}


def test_a_kept_membership_loses_only_the_forgotten_hashes(tmp_path: Path) -> None:
    """After an erasure the copy kept by fingerprint still names its set and every other
    record where it was; the forgotten hashes are gone; a second pass changes nothing."""
    project = Project(tmp_path)
    manifest = project.update("rebuild")
    archive = tmp_path / "archive"
    archive_membership(project.shards, archive, manifest.fingerprint)
    kept = archive / f"{manifest.fingerprint}.bin"
    with Membership(kept) as membership:
        hashes = list(membership.hashes())
        before = {sha: membership.find(sha) for sha in hashes}
    gone = set(hashes[::5])
    assert remove_from_membership(kept, gone)
    assert not remove_from_membership(kept, gone)
    with Membership(kept) as membership:
        assert membership.fingerprint == manifest.fingerprint
        assert membership.count == len(hashes) - len(gone)
        assert all(membership.find(sha) == [] for sha in gone)
        assert all(membership.find(sha) == before[sha] for sha in set(hashes) - gone)
