"""The git revisions whose data can no longer be checked out once ``shardflow forget`` has
removed DVC objects: the commits and experiment refs whose ``dvc.lock`` names a removed
object, or a directory listing that lists one.

A DVC object is named by its md5 (``files/md5/ab/cdef...`` in a cache or a remote, a
directory listing ending ``.dir``); ``dvc.lock`` names an output by that md5, so a plain
search of each revision's ``dvc.lock`` finds those that lost data.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

EXPERIMENT_REFS = "refs/exps"


@dataclass(frozen=True)
class LostRevisions:
    commits: list[str]  # full commit ids, oldest reachable first as git lists them
    experiments: list[str]  # DVC experiment refs (refs/exps/...) on those commits


def object_id(path: str) -> str | None:
    """The md5 (``.dir`` kept) a cache or remote path stores, else None."""
    parts = path.replace("\\", "/").split("/")
    if len(parts) < 2 or len(parts[-2]) != 2:
        return None
    name = parts[-2] + parts[-1]
    digest = name.removesuffix(".dir")
    if len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return name


def broken_objects(removed: Iterable[str], cache_dir: Path) -> set[str]:
    """The removed objects and the directory listings (still in the cache) that list one:
    a directory whose file is gone cannot be checked out either."""
    broken = set(removed)
    for listing in Path(cache_dir).rglob("*.dir"):
        try:
            entries = json.loads(listing.read_text())
        except (OSError, ValueError):
            continue
        if any(entry.get("md5") in broken for entry in entries if isinstance(entry, dict)):
            broken.add(listing.parent.name + listing.name)
    return broken


def lost_revisions(root: Path, broken: set[str]) -> LostRevisions:
    """Commits and experiment refs of the repository at ``root`` whose ``dvc.lock`` names an
    object of ``broken``; none outside a git repository."""
    if not broken or not (Path(root) / ".git").exists():
        return LostRevisions([], [])
    commits = _git(root, "rev-list", "--all").split()
    locks = _dvc_locks(root, commits)
    digests = {b.removesuffix(".dir") for b in broken}
    lost = [c for c in commits if any(d in locks.get(c, "") for d in digests)]
    refs = _git(root, "for-each-ref", EXPERIMENT_REFS, "--format=%(objectname) %(refname)")
    lost_set = set(lost)
    experiments = sorted(
        ref for line in refs.splitlines() for sha, ref in [line.split(" ", 1)] if sha in lost_set
    )
    return LostRevisions(lost, experiments)


def _dvc_locks(root: Path, commits: list[str]) -> dict[str, str]:
    """Each commit's ``dvc.lock`` text (one ``git cat-file --batch`` for all)."""
    request = "".join(f"{commit}:dvc.lock\n" for commit in commits).encode()
    out = subprocess.run(
        ["git", "cat-file", "--batch"], cwd=root, input=request, capture_output=True, check=True
    ).stdout
    texts, at = {}, 0
    for commit in commits:
        end = out.index(b"\n", at)
        header = out[at:end].split()
        at = end + 1
        if len(header) == 3:  # "<sha> blob <size>"; else "<name> missing"
            size = int(header[2])
            texts[commit] = out[at : at + size].decode(errors="replace")
            at += size + 1
    return texts


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout


def current_objects(root: Path) -> set[str]:
    """The DVC objects the working tree's ``dvc.lock`` needs (each output's and dependency's
    md5, and every file a directory listing in the cache lists): what a scrub never removes,
    whatever bytes they hold."""
    import yaml

    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        return set()
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    needed = {
        str(entry["md5"])
        for stage in stages.values()
        for entry in [*stage.get("deps", []), *stage.get("outs", [])]
        if isinstance(entry, dict) and entry.get("md5")
    }
    for listing in [n for n in needed if n.endswith(".dir")]:
        path = Path(root) / ".dvc" / "cache" / "files" / "md5" / listing[:2] / listing[2:]
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        needed |= {str(e["md5"]) for e in entries if isinstance(e, dict) and e.get("md5")}
    return needed
