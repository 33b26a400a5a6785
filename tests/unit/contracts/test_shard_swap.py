"""A rebuild writes its set beside the shard folder and replaces it whole, by two renames:
a rebuild that fails or is killed part way loses nothing, one killed between the renames is
finished by the next run, and a rerun still writes only the shards missing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from tasks.contracts.manifest import ShardFile, load_manifest
from tasks.contracts.shard_changes import SPILL_PREFIX
from tasks.contracts.shard_swap import finish_swap, rebuild_folder, trash_folder
from tasks.shard import stage as stage_module
from tasks.shard.spec import ShardSpec
from tasks.shard.stage import shard_stage
from tasks.shard.writing import write_inline
from tests.shard_helpers import digests, params


class Killed(Exception):
    """Stands for SIGKILL or Ctrl-C: the stage stops where it is."""


def killed_after(count: int) -> Callable[[Iterable[ShardSpec], Path], Iterator[ShardFile]]:
    """A writer that stops the stage once ``count`` shards are finished."""

    def write_many(specs: Iterable[ShardSpec], folder: Path) -> Iterator[ShardFile]:
        for done, result in enumerate(write_inline(specs, folder), start=1):
            yield result
            if done == count:
                raise Killed

    return write_many


def killed_between_renames(shards_dir: Path) -> None:
    """The swap cut after its first rename: the old set moved aside, the new one not in."""
    os.rename(shards_dir, trash_folder(shards_dir))
    raise Killed


def nothing_beside(shards_dir: Path) -> bool:
    return not rebuild_folder(shards_dir).exists() and not trash_folder(shards_dir).exists()


def test_a_rebuild_killed_part_way_leaves_the_set_it_replaces(
    tiny_index: Path, tmp_path: Path
) -> None:
    """It wrote straight into the shard folder: the old manifest and shards were gone from
    the start, and nothing usable was left until `dvc checkout data/shards`."""
    shards = tmp_path / "shards"
    shard_stage(params(), tiny_index, shards)
    before = digests(shards)
    with pytest.raises(Killed):
        shard_stage(params(target_shard_mb=16.0), tiny_index, shards, write_many=killed_after(1))
    assert digests(shards) == before


def test_resume_after_a_kill_completes_identically(tiny_index: Path, tmp_path: Path) -> None:
    """The finished shards of a killed rebuild wait in its own folder; the rerun of the same
    plan writes only the missing ones and ends with an uninterrupted run's bytes."""
    clean = shard_stage(params(), tiny_index, tmp_path / "clean")
    run = tmp_path / "run"
    with pytest.raises(Killed):
        shard_stage(params(), tiny_index, run, write_many=killed_after(2))
    staged = rebuild_folder(run)
    kept = {p.name: p.stat().st_mtime_ns for p in staged.glob("*.tfrecord-*[0-9]")}
    assert len(kept) == 2 and not run.exists()
    (staged / ".train.tfrecord-00000-of-00001.tmp-99999").write_bytes(b"half a shard")
    (staged / f"{SPILL_PREFIX}killed").mkdir()  # the killed run's diff table

    rerun = shard_stage(params(), tiny_index, run)
    assert rerun.manifest == clean.manifest and rerun.written == clean.shards - 2
    assert not list(run.glob(f"{SPILL_PREFIX}*"))
    assert digests(run) == digests(tmp_path / "clean")
    assert {name: (run / name).stat().st_mtime_ns for name in kept} == kept  # reused
    assert nothing_beside(run)


def test_rerunning_a_finished_rebuild_encodes_nothing(tiny_index: Path, tmp_path: Path) -> None:
    """The new set starts empty beside the old one, which already holds every shard of the
    plan: those are linked over, not written again."""
    shards = tmp_path / "shards"
    first = shard_stage(params(), tiny_index, shards)
    inodes = {p.name: p.stat().st_ino for p in shards.glob("*.tfrecord-*[0-9]")}
    again = shard_stage(params(), tiny_index, shards)
    assert first.written == first.shards > 0 and again.written == 0
    assert again.manifest == first.manifest
    assert {p.name: p.stat().st_ino for p in shards.glob("*.tfrecord-*[0-9]")} == inodes
    assert nothing_beside(shards)


def test_a_rebuild_killed_between_the_renames_is_finished_by_the_next_run(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = tmp_path / "shards"
    shard_stage(params(), tiny_index, shards)
    new = shard_stage(params(target_shard_mb=16.0), tiny_index, tmp_path / "new")
    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "swap_in", killed_between_renames)
        with pytest.raises(Killed):
            shard_stage(params(target_shard_mb=16.0), tiny_index, shards)
    assert not shards.exists() and trash_folder(shards).is_dir()

    rerun = shard_stage(params(target_shard_mb=16.0), tiny_index, shards)
    assert rerun.written == 0 and rerun.manifest == new.manifest
    assert digests(shards) == digests(tmp_path / "new")
    assert nothing_beside(shards)


def test_finish_swap_puts_the_finished_set_in_place_and_removes_the_old(
    tiny_index: Path, tmp_path: Path
) -> None:
    shards = tmp_path / "shards"
    new = shard_stage(params(), tiny_index, shards).manifest
    os.rename(shards, rebuild_folder(shards))  # the new set, complete
    trash_folder(shards).mkdir()  # the old set, moved aside
    (trash_folder(shards) / "manifest.json").write_text("{}")
    finish_swap(shards)
    assert load_manifest(shards) == new and nothing_beside(shards)


def test_finish_swap_puts_the_old_set_back_when_the_new_is_not_complete(
    tiny_index: Path, tmp_path: Path
) -> None:
    shards = tmp_path / "shards"
    old = shard_stage(params(), tiny_index, shards).manifest
    os.rename(shards, trash_folder(shards))
    rebuild_folder(shards).mkdir()  # no manifest: a set never finished
    finish_swap(shards)
    assert load_manifest(shards) == old
    assert rebuild_folder(shards).exists() and not trash_folder(shards).exists()


def test_finish_swap_leaves_a_set_in_place_alone(tiny_index: Path, tmp_path: Path) -> None:
    """A rebuild folder beside a set in place is a killed rebuild's, kept for its rerun; a
    trash folder is what a swap killed while removing it left."""
    shards = tmp_path / "shards"
    shard_stage(params(), tiny_index, shards)
    before = digests(shards)
    rebuild_folder(shards).mkdir()
    (rebuild_folder(shards) / "train.tfrecord-00000-of-00001").write_bytes(b"finished")
    trash_folder(shards).mkdir()
    finish_swap(shards)
    assert digests(shards) == before and not trash_folder(shards).exists()
    assert (rebuild_folder(shards) / "train.tfrecord-00000-of-00001").exists()


def test_an_append_removes_a_killed_rebuilds_folder(tiny_index: Path, tmp_path: Path) -> None:
    """A killed rebuild's folder waited, holding its shards' disk, for a rebuild that an
    append never runs: the append removes it and leaves the set it builds on as it was."""
    shards = tmp_path / "shards"
    shard_stage(params(), tiny_index, shards)
    before = digests(shards)
    with pytest.raises(Killed):
        shard_stage(params(target_shard_mb=16.0), tiny_index, shards, write_many=killed_after(1))
    assert list(rebuild_folder(shards).glob("*.tfrecord-*[0-9]"))  # its finished shard, kept
    appended = shard_stage(params(mode="append"), tiny_index, shards)
    assert appended.written == 0 and digests(shards) == before  # nothing new to append
    assert nothing_beside(shards)
