"""Ingest's inspection of one file (``tasks.ingest.stage`` runs it over every file found, in
workers): where it is and what it is before any byte is read (:class:`Locator`), then its
content hash, and a full decode with the near-duplicate hash taken from it
(:func:`check_image`); a verdict of the previous run is reused for unchanged content. A bad
file never raises: it comes back with its quarantine reason.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from PIL import ImageFile

from tasks.contracts.content import class_name_problem, display_name, file_kind
from tasks.contracts.handoff import HandoffWriter, Target, decode_key, header_bytes
from tasks.contracts.near_duplicates import HASH_SIDE, perceptual_hash, thumbnail
from tasks.images import ImageRejected, finish_decode, open_checked, oriented_size
from tasks.ingest.discovery import Candidate
from tasks.ingest.source_check import dvc_cache

if TYPE_CHECKING:
    from PIL import Image


class Inspected(NamedTuple):
    """What inspecting one file found (a tuple: one is built per file, the cheapest record)."""

    path: str
    label: str
    sha256: str | None
    format: str | None
    width: int
    height: int
    reason: str | None  # None when the image is usable
    reused: bool = False  # verdict taken from the previous index (same path, same content)
    signature: Signature | None = None  # the file's stat when it was vetted
    trusted: bool = False  # content hash taken on its unchanged stat: the bytes were not read
    phash: str | None = None  # perceptual hash of the decoded image (near-duplicates)
    thumb: str | None = None  # its grey thumbnail: the near-duplicate confirmation's input


# (size, mtime_ns, ctime_ns, inode, device): what `git status` and DVC also trust to mean
# "unchanged". Any write moves mtime and ctime, and no user call can set ctime back.
Signature = tuple[int, int, int, int, int]


def signature(info: os.stat_result) -> Signature:
    return (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)


class Rejected(Exception):
    """A file quarantined before its bytes were read (where it is, what it is, its size)."""


class Locator:
    """Resolves candidates inside one ``source_dir`` and vets them before any byte is read.

    Refuses (:class:`Rejected`, message = quarantine reason) a name that is not valid
    UTF-8, a path that leaves ``source_dir`` (absolute, ``..``, or a symlink pointing
    outside, other than into the project's own DVC cache: a DVC-tracked folder checked out
    with ``cache.type symlink``), anything that is not a regular file (FIFO, socket,
    device, folder), and a file over ``ingest.max_file_mb``. Reading a FIFO would block the
    stage; a huge file would fill memory: both are stopped here.

    Each folder is resolved once: ``realpath(folder/name)`` is ``realpath(folder)/name``
    whenever ``name`` itself is not a symlink, so a plain file costs one ``lstat`` instead of
    one per path component (a whole resolve per file would dominate an incremental ingest).
    Paths are plain strings here: ``pathlib`` parsing per file would dominate it too, once
    the decodes are reused.
    """

    def __init__(self, source_dir: Path, max_bytes: int) -> None:
        self.source_dir = Path(source_dir)
        self.root = os.fspath(self.source_dir.resolve())
        self.max_bytes = max_bytes
        self._root_prefix = self.root.rstrip("/") + "/"
        self._source = os.fspath(self.source_dir).rstrip("/") or "/"
        cache = dvc_cache(self.source_dir)
        self._cache_prefix = cache.rstrip("/") + "/" if cache else None
        self._folders: dict[str, str | Rejected] = {}  # folder -> its real path

    def __call__(self, relative: str) -> tuple[str, os.stat_result]:
        """The real path of ``relative`` and its stat, vetted; :class:`Rejected` says why not."""
        try:
            relative.encode("utf-8")
        except UnicodeEncodeError:
            raise Rejected(
                "file name is not valid UTF-8 (rename it: `python -m tasks.ingest.filenames fix`)"
            ) from None
        if "\0" in relative:  # only a CSV row can hold one; the OS refuses the name
            raise Rejected("file name holds a NUL byte: no file can be called that")
        if os.path.isabs(relative) or ".." in relative.split("/"):
            raise Rejected(
                f"outside source_dir: {relative!r} is not a path inside {self.source_dir}"
            )
        path = f"{self._source}/{relative}"
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise Rejected("unreadable: no such file (or a broken symlink)") from None
        except OSError as exc:
            raise Rejected(f"unreadable: {exc}") from None
        cached = False
        if stat.S_ISLNK(info.st_mode):
            real = _resolve(path)
            info = os.stat(real)
            cached = self._cache_prefix is not None and real.startswith(self._cache_prefix)
        else:
            folder, name = path.rsplit("/", 1)
            real = f"{self._folder(folder)}/{name}"
        if not (cached or real == self.root or real.startswith(self._root_prefix)):
            raise Rejected(
                f"outside source_dir: {relative!r} resolves to a path outside {self.root}"
            )
        if not stat.S_ISREG(info.st_mode):
            raise Rejected(f"not a regular file ({file_kind(info.st_mode)})")
        if info.st_size > self.max_bytes:
            raise Rejected(
                f"file too large: {info.st_size / 2**20:.1f} MB > ingest.max_file_mb "
                f"({self.max_bytes / 2**20:g} MB)"
            )
        return real, info

    def _folder(self, folder: str) -> str:
        if folder not in self._folders:
            try:
                self._folders[folder] = _resolve(folder)
            except Rejected as exc:
                self._folders[folder] = exc
        found = self._folders[folder]
        if isinstance(found, Rejected):
            raise found
        return found


def _resolve(path: str) -> str:
    try:
        return os.fspath(Path(path).resolve(strict=True))
    except FileNotFoundError:
        raise Rejected("unreadable: no such file (or a broken symlink)") from None
    except (OSError, RuntimeError) as exc:  # symlink loop, permissions
        raise Rejected(f"unreadable: {exc}") from None


def inspect_file(
    locator: Locator,
    candidate: Candidate,
    max_pixels: int,
    min_side: int,
    draft: bool = True,
    known: list[Any] | None = None,
    trusted: Signature | None = None,
    handoff: HandoffWriter | None = None,
) -> Inspected:
    """Vet, read, hash and fully decode one file; never raises for a bad file.

    ``known`` is the previous index's verdict for this path (``[sha256, format, width,
    height, reason, phash, thumb]``): when the content hash still matches, the verdict is
    reused and the file is not decoded again. ``trusted`` is the stat signature under which
    that hash was taken, where it is safe to trust (see :func:`previous_signatures`): when
    the file's stat still equals it, the hash and verdict are reused without reading it.
    ``handoff`` keeps the decode of a file decoded now for the shard stage
    (:mod:`tasks.contracts.handoff`).
    """
    name = display_name(candidate.path)

    def rejected(reason: str, digest: str | None = None) -> Inspected:
        return Inspected(name, display_name(candidate.label), digest, None, 0, 0, reason)

    if problem := class_name_problem(candidate.label):
        return rejected(f"class folder {display_name(candidate.label)!r}: {problem}; rename it")
    try:
        real, info = locator(candidate.path)
        now = signature(info)
        if known is not None and trusted is not None and now == trusted:
            return _reuse(candidate, known, known[0], now, trusted=True)
        with open(real, "rb") as handle:
            data = handle.read()
    except Rejected as exc:
        return rejected(str(exc))
    except OSError as exc:
        return rejected(f"unreadable: {exc}")
    digest = hashlib.sha256(data).hexdigest()
    if known is not None and known[0] == digest:
        return _reuse(candidate, known, digest, now, trusted=False)
    try:
        keep = partial(handoff.put, digest, now) if handoff is not None else None
        fmt, width, height, phash, thumb = check_image(
            data, max_pixels=max_pixels, min_side=min_side, draft=draft, keep=keep
        )
    except ImageRejected as exc:
        return rejected(str(exc), digest)._replace(signature=now)
    return Inspected(
        candidate.path,
        candidate.label,
        digest,
        fmt,
        width,
        height,
        None,
        False,
        now,
        False,
        phash,
        thumb,
    )


DECODER_BLOCK = 8 << 20  # bytes handed to an image decoder at once (camera photos: all)


def check_image(
    data: bytes,
    *,
    max_pixels: int,
    min_side: int,
    draft: bool,
    keep: Callable[[Image.Image, tuple[int, int, int], bytes], object] | None = None,
) -> tuple[str, int, int, str, str]:
    """Ingest's check, :func:`tasks.images.verify`'s steps: (format, width and height after
    EXIF orientation, perceptual hash, thumbnail) of usable image bytes.

    Every byte of the image data is decoded (with ``draft`` a JPEG at 1/8 scale: libjpeg
    still parses the whole stream), so truncated or corrupt files are caught; the
    near-duplicate hash and the thumbnail that confirms a near pair are taken from that same
    decode, so they cost no second one. ``keep``
    is handed the decode, the decoder's :func:`~tasks.contracts.handoff.decode_key` and the file's
    header (:meth:`tasks.contracts.handoff.HandoffWriter.put`): when the shard stage would decode at
    the same scale, the record's pixels are made from it and the shard stage decodes none.
    """
    image = open_checked(data, max_pixels=max_pixels, min_side=min_side)
    # The bytes are in memory: the decoder gets them in one piece of up to DECODER_BLOCK (a
    # copy), not in Pillow's 64 KiB reads (libjpeg, suspended at each refill, starts that
    # MCU again): a faster check of a large photo, the same pixels.
    if isinstance(image, ImageFile.ImageFile):
        image.decodermaxblock = max(image.decodermaxblock, min(len(data), DECODER_BLOCK))
    head = header_bytes(data, image) if keep is not None else b""
    fmt, (width, height) = str(image.format), oriented_size(image)
    if draft and image.format == "JPEG":
        # never below the hash's own input (HASH_SIDE): a 1/8 draft of a 160 px JPEG is
        # 20 px, too coarse to tell drawings apart; photos (256 px and up) still get 1/8
        image.draft(None, (max(HASH_SIDE, image.width // 8), max(HASH_SIDE, image.height // 8)))
    key = decode_key(image)
    decoded = finish_decode(image)
    phash, thumb = perceptual_hash(decoded), thumbnail(decoded)
    # a file kept only once it passed every check; a JPEG only with the header that tells
    # how the shard stage's decoder would be set
    if keep is not None and (head or image.format != "JPEG"):
        keep(decoded, key, head)
    return fmt, width, height, phash, thumb


def _reuse(
    candidate: Candidate, known: list[Any], digest: str, now: Signature, *, trusted: bool
) -> Inspected:
    """The previous verdict for unchanged content (a quarantine reason, or the image's
    format and size)."""
    _, fmt, width, height, reason, phash, thumb = known
    if reason is not None:
        name, label = display_name(candidate.path), display_name(candidate.label)
        return Inspected(name, label, digest, None, 0, 0, reason, True, now, trusted)
    return Inspected(
        candidate.path,
        candidate.label,
        digest,
        fmt,
        width,
        height,
        None,
        True,
        now,
        trusted,
        phash,
        thumb,
    )


def inspect_chunk(
    source_dir: str,
    chunk: list[Candidate],
    limits: tuple[int, int, int, bool],
    handoff: tuple[str, int, Target, int | None] | None = None,
) -> list[Inspected]:
    """A worker's job: vet, read and decode new files (none has a verdict to reuse);
    ``handoff``: (folder, this chunk's share of the bound, the shard stage's target, stat
    trust cutoff) where decodes are kept (:class:`tasks.contracts.handoff.HandoffWriter`)."""
    max_pixels, min_side, max_bytes, draft = limits
    locator = Locator(Path(source_dir), max_bytes)  # one per chunk: folders resolved once
    writer = HandoffWriter(Path(handoff[0]), *handoff[1:]) if handoff else None
    return [inspect_file(locator, c, max_pixels, min_side, draft, handoff=writer) for c in chunk]
