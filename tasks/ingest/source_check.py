"""The source folder as `dvc repro` sees it: a listing, never the folder's bytes.

Were ``ingest.source_dir`` itself a DVC dependency, DVC would hash it before any stage runs: a
FIFO hangs that with the workspace lock held, a link to ``/dev/zero`` hangs ``dvc status``, a
broken link or a link loop fails with DVC's own errno naming no key, and a link out of the
folder is read to hash it. Ingest quarantines each of these with its reason, so the ``source``
stage (``always_changed``, ``python -m tasks.ingest.source_check``) writes :data:`LISTING` instead:
every entry's name and kind, a regular file's sha256 (a link's: its target's, resolved inside
the folder), and what is wrong with the rest, which is never opened. Ingest depends on the
listing, so DVC reruns it exactly when an entry's content changed, on any clone: the listing
holds no times. A file whose stat (size, times, inode) is the one it was hashed under is not
read again (:data:`HASHES`, this machine's, as DVC keeps its own).

A link into the project's own DVC cache is the folder's file: that is how a DVC-tracked folder
is checked out under ``cache.type symlink`` (or ``hardlink``, which needs no link at all).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.contracts.content import file_kind
from tasks.runtime.atomic import write_json
from tasks.runtime.refusals import Refused, refusing

KEY = "ingest.source_dir"
LISTING = Path("data") / "ingest" / "source_listing.json"
HASHES = Path(".shardflow") / "source_hashes.json"  # real path -> [stat signature, sha256]
CHUNK = 1 << 20

Hashes = dict[str, list[Any]]


@dataclass
class HashCache:
    """Content hashes by real path and the stat signature each was taken under: ``known``
    from the last listing, ``seen`` this one's (the next run's ``known``)."""

    known: Hashes = field(default_factory=dict)
    seen: Hashes = field(default_factory=dict)


class SourceRefused(Refused):
    """``ingest.source_dir`` cannot be a folder's path."""


@dataclass(frozen=True)
class SourceEntry:
    """One entry under the folder: what DVC reruns ingest on when it changes."""

    path: str  # relative to the folder
    kind: str  # file | dir | link | the reason ingest quarantines it
    sha256: str = ""  # a file's, or a link's target's
    target: str = ""  # a link's target, relative to the folder


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


def content_sha256(real: str, status: os.stat_result, hashes: HashCache) -> str:
    """sha256 of the regular file ``real`` whose ``stat`` is ``status``: the known one when
    taken under the same stat signature, else read."""
    signature = [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]
    known = hashes.known.get(real)
    if known is not None and known[0] == signature:
        hashes.seen[real] = known
        return str(known[1])
    # a file swapped for a FIFO or a link since its stat is neither waited on nor followed
    handle = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(handle, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(f"{real}: no longer a regular file")
        digest = hashlib.sha256()
        while block := file.read(CHUNK):
            digest.update(block)
    hashes.seen[real] = [signature, digest.hexdigest()]
    return digest.hexdigest()


def _link(path: str, rel: str, roots: tuple[str, ...], hashes: HashCache) -> SourceEntry:
    """The link ``path`` as its target (hashed only when a regular file inside the folder),
    or why it leads to no file inside the folder."""
    try:
        real = os.fspath(Path(path).resolve(strict=True))
    except FileNotFoundError:
        return SourceEntry(rel, "a broken link (its target does not exist)")
    except (OSError, RuntimeError) as error:  # a loop, a folder it may not enter
        return SourceEntry(rel, f"a link that cannot be followed ({error.__class__.__name__})")
    root = next((root for root in roots if inside(real, root)), None)
    if root is None:
        return SourceEntry(rel, f"a link to {real}, outside the folder")
    status = os.stat(real)
    if not (stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode)):
        return SourceEntry(rel, f"a link to {file_kind(status.st_mode)}")
    digest = content_sha256(real, status, hashes) if stat.S_ISREG(status.st_mode) else ""
    if root != roots[0]:  # the DVC cache: a file of the folder under any cache.type
        return SourceEntry(rel, "file", digest)
    return SourceEntry(rel, "link", digest, os.path.relpath(real, root))


def _entry(path: str, rel: str, roots: tuple[str, ...], hashes: HashCache) -> SourceEntry:
    status = os.lstat(path)
    if stat.S_ISLNK(status.st_mode):
        return _link(path, rel, roots, hashes)
    if stat.S_ISDIR(status.st_mode):
        return SourceEntry(rel, "dir")
    if stat.S_ISREG(status.st_mode):
        return SourceEntry(rel, "file", content_sha256(path, status, hashes))
    return SourceEntry(rel, file_kind(status.st_mode))


def listing(folder: str | Path, hashes: HashCache | None = None) -> list[SourceEntry]:
    """Every entry under ``folder``, sorted: a regular file (or a link to one inside the
    folder) with its sha256; a special file, or a link out of the folder (other than into the
    project's DVC cache), with its reason, never opened. Links to folders are not walked
    into. ``hashes`` spares re-reading files whose stat is unchanged."""
    hashes = HashCache() if hashes is None else hashes
    top = os.fspath(folder)
    roots = (os.fspath(Path(top).resolve()), *filter(None, [dvc_cache(top)]))
    found: list[SourceEntry] = []

    def unreadable(error: OSError) -> None:
        rel = os.path.relpath(os.fspath(error.filename), top)
        found.append(SourceEntry(rel, f"cannot be listed ({error.strerror})"))

    for current, dirs, files in os.walk(top, onerror=unreadable):
        for name in [*dirs, *files]:
            path = os.path.join(current, name)
            rel = os.path.relpath(path, top)
            try:
                found.append(_entry(path, rel, roots, hashes))
            except OSError as error:  # gone or unreadable between the listing and the stat
                found.append(SourceEntry(rel, f"cannot be read ({error})"))
    return sorted(found, key=lambda entry: entry.path)


def refuse_unnamable(source_dir: str) -> None:
    """Refuse a ``source_dir`` no folder can be called (DVC: "embedded null byte")."""
    if "\0" in source_dir:
        raise SourceRefused(
            f"{KEY}={source_dir!r} holds a NUL byte: no folder can be called that",
            fix=f"set {KEY} in params.yaml to the folder's path",
        )


def source_record(
    source_dir: str, hashes: HashCache | None = None, excluded: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """What :data:`LISTING` holds for ``source_dir``: a missing folder is listed as missing
    (ingest reports it); names that are not UTF-8 keep their bytes as JSON escapes. A file
    whose content is ``excluded`` (forgotten) is left out: ingest never admits it, and the
    listing, an output DVC caches and pushes, names neither it nor its hash."""
    refuse_unnamable(source_dir)
    if not os.path.isdir(source_dir):
        return {"source_dir": source_dir, "missing": True, "entries": []}
    found = [e for e in listing(source_dir, hashes) if not (e.sha256 and e.sha256 in excluded)]
    entries = [[e.path, e.kind, e.sha256, e.target] for e in found]
    return {"source_dir": source_dir, "missing": False, "entries": entries}


def _known_hashes(path: Path) -> Hashes:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def write_listing(root: Path, source_dir: str) -> None:
    """Write :data:`LISTING` under ``root`` for ``source_dir`` (relative to ``root``), with
    the hashes known from the last listing (:class:`SourceRefused` for an unnamable one)."""
    from tasks.contracts.exclusions import load_excluded
    from tasks.runtime.layout import Layout

    hashes_path = root / HASHES
    hashes = HashCache(known=_known_hashes(hashes_path))
    excluded = load_excluded(Layout(root).excluded)
    record = source_record(os.fspath(root / source_dir), hashes, excluded)
    write_json(root / LISTING, {**record, "source_dir": source_dir})
    seen = {path: known for path, known in hashes.seen.items() if known[-1] not in excluded}
    if seen != hashes.known:
        write_json(hashes_path, seen)


def main(argv: list[str] | None = None) -> int:
    """The ``source`` stage: write :data:`LISTING` for ``ingest.source_dir``; a refusal is
    one short block (:func:`tasks.runtime.refusals.refusing`)."""
    from tasks.runtime.params import load_params

    del argv
    return refusing(
        lambda: write_listing(Path("."), load_params().ingest.source_dir), "the source stage"
    )


if __name__ == "__main__":
    sys.exit(main())
