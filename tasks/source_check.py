"""What DVC cannot hash under ``ingest.source_dir``, found before `dvc repro` runs.

DVC hashes the source folder (a dependency of ingest and shard) before any stage runs: a FIFO
hangs it with the workspace lock held, a link to ``/dev/zero`` hangs ``dvc status``, a broken
link or a link loop fails with DVC's own errno naming no key, and a link that leads out of the
folder is read to hash it. Ingest quarantines each of these, but under DVC the run never gets
that far, so `make run` checks the folder first (``python -m tasks.filenames check``) and
refuses naming each file and ``ingest.source_dir``. Nothing outside the folder is read: links
are resolved, never opened.

A link into the project's own DVC cache is the folder's file: that is how a DVC-tracked folder
is checked out under ``cache.type symlink`` (or ``hardlink``, which needs no link at all).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tasks.content import file_kind
from tasks.refusals import Refused

KEY = "ingest.source_dir"
SHOWN = 20  # problems listed in the refusal; the count says how many more


class SourceRefused(Refused):
    """``ingest.source_dir`` holds what DVC cannot hash, or cannot be a folder's path."""


@dataclass(frozen=True)
class SourceProblem:
    path: str  # as found under the folder
    reason: str


def dvc_cache(folder: str | Path) -> str | None:
    """The real path of the DVC cache of the project holding ``folder`` (its nearest
    enclosing folder with a ``.dvc``), or None outside a DVC project."""
    here = Path(folder).resolve()
    for parent in (here, *here.parents):
        if (parent / ".dvc").is_dir():
            return os.fspath((parent / ".dvc" / "cache").resolve())
    return None


def inside(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip("/") + "/")


def _link_problem(path: str, roots: tuple[str, ...]) -> str | None:
    """Why the link ``path`` is one DVC cannot hash, or None; its target is never opened."""
    try:
        real = os.fspath(Path(path).resolve(strict=True))
    except FileNotFoundError:
        return "a broken link (its target does not exist)"
    except (OSError, RuntimeError) as error:  # a loop, a folder it may not enter
        return f"a link that cannot be followed ({error.__class__.__name__}: {error})"
    if not any(inside(real, root) for root in roots):
        return f"a link to {real}, outside the folder"
    mode = os.stat(real).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return f"a link to {file_kind(mode)}"
    return None


def _entry_problem(path: str, roots: tuple[str, ...]) -> str | None:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return _link_problem(path, roots)
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return file_kind(mode)


def find_problems(folder: str | Path) -> list[SourceProblem]:
    """Every entry under ``folder`` DVC cannot hash: special files (FIFO, socket, device),
    broken links, link loops, links out of the folder (other than into the project's DVC
    cache), and folders that cannot be listed. Links to folders are not walked into."""
    top = os.fspath(folder)
    roots = (os.fspath(Path(top).resolve()), *filter(None, [dvc_cache(top)]))
    found: list[SourceProblem] = []

    def unreadable(error: OSError) -> None:
        found.append(SourceProblem(os.fspath(error.filename), f"cannot be listed: {error}"))

    for current, dirs, files in os.walk(top, onerror=unreadable):
        for name in sorted([*dirs, *files]):
            path = os.path.join(current, name)
            try:
                reason = _entry_problem(path, roots)
            except OSError as error:
                reason = f"cannot be read: {error}"
            if reason:
                found.append(SourceProblem(path, reason))
    return found


def refuse_unnamable(source_dir: str) -> None:
    """Refuse a ``source_dir`` no folder can be called (DVC: "embedded null byte")."""
    if "\0" in source_dir:
        raise SourceRefused(
            f"{KEY}={source_dir!r} holds a NUL byte: no folder can be called that",
            fix=f"set {KEY} in params.yaml to the folder's path",
        )


def check_source(source_dir: str) -> None:
    """Refuse (:class:`SourceRefused`) a ``source_dir`` DVC cannot hash; a missing folder
    passes (ingest reports it)."""
    refuse_unnamable(source_dir)
    if not os.path.isdir(source_dir):
        return
    problems = find_problems(source_dir)
    if not problems:
        return
    lines = [f"  {p.path}: {p.reason}" for p in problems[:SHOWN]]
    if len(problems) > SHOWN:
        lines.append(f"  ... and {len(problems) - SHOWN} more")
    count = f"{len(problems)} entr{'y' if len(problems) == 1 else 'ies'}"
    raise SourceRefused(
        f"{KEY}={source_dir!r} holds {count} that `dvc repro` would hang or fail on, or read "
        "outside the folder to hash (special files, and links that lead to no file inside "
        "it):\n" + "\n".join(lines),
        fix=f"remove or replace them, or point {KEY} in params.yaml at another folder",
    )
