"""A rebuild replaces the whole shard set by two directory renames, never file by file.

A rebuild (``shard.mode: rebuild``, `make compact`) writes its set into
:func:`rebuild_folder`, a sibling of the shard folder (same file system, so renames are
atomic), and only a finished set (manifest written last) takes the shard folder's place:
the shard folder becomes :func:`trash_folder`, the rebuild folder becomes the shard folder,
the trash is removed. A rebuild that fails or is killed before that leaves the set it was
replacing untouched; one killed between the two renames is finished by
:func:`finish_swap`, which the shard stage and validation run before anything else (outside
the ``tasks.shard`` package, so validation needs none of the shard stage's code). A killed
rebuild's folder waits for the rerun of its rebuild; a run that appends instead removes it
(:func:`discard_rebuild`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tasks.contracts.manifest import load_manifest


def rebuild_folder(shards_dir: Path) -> Path:
    """Where a rebuild of ``shards_dir`` writes its set (``data/.shards.rebuild``)."""
    shards_dir = Path(shards_dir)
    return shards_dir.with_name(f".{shards_dir.name}.rebuild")


def trash_folder(shards_dir: Path) -> Path:
    """Where the replaced set waits between the two renames (``data/.shards.old``)."""
    shards_dir = Path(shards_dir)
    return shards_dir.with_name(f".{shards_dir.name}.old")


def swap_in(shards_dir: Path) -> None:
    """Put the finished rebuild folder in the shard folder's place; remove the old set."""
    shards_dir = Path(shards_dir)
    trash = trash_folder(shards_dir)
    _remove(trash)  # a killed swap's, whose new set is in place
    if shards_dir.exists():
        os.rename(shards_dir, trash)
    os.rename(rebuild_folder(shards_dir), shards_dir)
    _fsync_folder(shards_dir.parent)  # both renames on disk before the old set goes
    _remove(trash)  # what a kill leaves of it, the next run removes


def finish_swap(shards_dir: Path) -> None:
    """Finish a swap that a kill cut between its renames, then remove a leftover trash.

    With no shard folder, a rebuild folder holding a complete manifest is the finished new
    set and takes its place; failing that, a trash folder is the old set and goes back.
    """
    shards_dir = Path(shards_dir)
    trash = trash_folder(shards_dir)
    if not shards_dir.exists():
        if _complete(rebuild_folder(shards_dir)):
            os.rename(rebuild_folder(shards_dir), shards_dir)
        elif trash.is_dir():
            os.rename(trash, shards_dir)
    if shards_dir.exists():
        _remove(trash)


def discard_rebuild(shards_dir: Path) -> bool:
    """Remove a killed rebuild's folder, which only a rebuild would use; whether there was one."""
    folder = rebuild_folder(shards_dir)
    found = folder.exists() or folder.is_symlink()
    _remove(folder)
    return found


def _remove(path: Path) -> None:
    """Remove the trash: a folder, or the link a linked shard folder was."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest that loads: written last, it means every file is."""
    try:
        load_manifest(folder)
    except (OSError, ValueError):
        return False
    return True


def _fsync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
