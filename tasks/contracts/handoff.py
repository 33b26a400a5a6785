"""The decode hand-off: ingest's decode of a new image, made into the shard stage's pixels.

Ingest decodes every new image to check it and take its perceptual hash; the shard stage
then decoded it again. Ingest now finishes the job when the shard stage would decode at that
very scale: it opens the image's header again, configures a decoder as the shard stage does
(:func:`tasks.images.draft_for`, for the shard params' :class:`Target`: record size, resize
policy, reduced decoding) and, when that decoder's :func:`decode_key` is its own, resizes its
decode (:func:`tasks.images.resize_image`, the shard stage's own call) and keeps the record's
pixels in a bounded folder inside the repository (``.shardflow/handoff/<preprocessing
version>/``, gitignored, never a DVC dependency), one entry per content hash. The shard
stage encodes those pixels instead of decoding: the same libjpeg scaling, the same
:func:`~tasks.images.finish_decode` and the same resize made them, so the record's bytes are
those of a decode. An entry made for another target (the params changed between the stages),
or one that does not read back whole, is a decode as before, never another record. Keeping
the resized pixels (150 KB for 224 px) rather than the 1/8 decode (560 KB for a 12 MP photo)
makes an entry a quarter of the bytes to write, read back and check.

The shard stage reads and hashes each source file to check that it is the one ingest
indexed. An entry also keeps the file's stat signature when ``ingest.trust_file_stat``
trusts it (with ingest's margin against a write in the tick of the stat): while the file's
stat is unchanged, its bytes are ingest's, and a hit reads no file. A file whose stat
changed is read and hashed, and refused as before.

Keyed by content (sha256), by target (checked as it is read) and by pixel code (the folder is
the preprocessing version, which names this code's pixel libraries), so no entry is used for
other bytes, another record size or by other pixel code. Ingest empties the folder when it
starts and writes at most ``ingest.handoff_mb``; the shard stage removes each entry it reads
and the folder when it ends, so nothing grows across runs.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import google_crc32c
import numpy as np
from PIL import Image

from tasks.images import RESIZE_POLICIES, draft_for, open_checked, resize_image

# The hand-off's cost model: the shard stage's decode that an entry saves against what the
# entry costs (docs/performance.md, "When ingest keeps a decode").
SHARD_SECONDS_PER_PIXEL = 2.5e-9  # shard: per source pixel decoded and resized
# A record whose decode ingest handed off is made by ingest, which resizes its 1/8-scale
# decode (1/64 of the pixels); the shard stage decodes and resizes none of it, and only
# encodes and frames the kept pixels.
HANDED_OFF_PIXEL_FRACTION = 1 / 64
# A hand-off entry is a file of its own: ingest checksums, writes and renames it; the shard
# stage reads, checks and removes it. The bench's `handoff.entry_ms` measures that cost net of
# the decodes the entries save; the figure held here sits above it, so a small image is
# decoded twice rather than handed off at a loss. Plus its pixels, written and read back.
HANDOFF_ENTRY_S = 1.0e-3
HANDOFF_SECONDS_PER_BYTE = 3.5e-3 / 2**20


def worth_handing_off(pixels: int, entry_bytes: int) -> bool:
    """Whether ingest keeping its decode of an image of ``pixels`` source pixels, in an entry
    of ``entry_bytes``, costs less than the decode it saves the shard stage.

    The data side's saving is the shard stage's decode less the resize ingest does instead;
    the entry's cost is a file written, read back and removed. Photos (a few MP) save more
    than their entry costs and are kept; small images save less and are decoded again (the
    break-even size is the bench's ``handoff.break_even_mp``).
    """
    saved = SHARD_SECONDS_PER_PIXEL * pixels * (1 - HANDED_OFF_PIXEL_FRACTION)
    return saved > HANDOFF_ENTRY_S + HANDOFF_SECONDS_PER_BYTE * entry_bytes


MAGIC = b"SFHANDO4"
# The content's sha256; the target the pixels were made for (height, width, resize policy's
# index in RESIZE_POLICIES, reduced decoding); the file's stat signature when ingest read it
# (size, mtime_ns, ctime_ns, inode, device) and whether it may be trusted. Then CRC-32C of
# those fields and the pixels (google-crc32c runs on the CPU's crc32 instruction, paid on
# both sides of the hand-off for every photo), and the pixels: height x width x 3 bytes.
FIELDS = struct.Struct("<32sIIBBQqqQQB")
CRC = struct.Struct("<I")
HEADER_SIZE = FIELDS.size + CRC.size
CHANNELS = 3  # tasks.images.resize_image's output is always RGB

Signature = tuple[int, int, int, int, int]  # (size, mtime_ns, ctime_ns, inode, device)
NO_SIGNATURE = (0, 0, 0, 0, 0)


class Target(NamedTuple):
    """What the shard stage makes of an image: its record's size, resize policy and whether
    it decodes JPEGs reduced (``shard.image_size``, ``shard.resize``, ``shard.draft_decode``)."""

    height: int
    width: int
    policy: str
    draft: bool

    @classmethod
    def of(cls, shard: Any) -> Target:
        """The target of :class:`tasks.runtime.params.ShardParams` ``shard``."""
        height, width = shard.image_size
        return cls(int(height), int(width), str(shard.resize), bool(shard.draft_decode))

    @property
    def entry_bytes(self) -> int:
        """An entry's size on disk for this target."""
        return len(MAGIC) + HEADER_SIZE + self.height * self.width * CHANNELS


def decode_key(image: Image.Image) -> tuple[int, int, int]:
    """What decides an opened image's decoded pixels besides its bytes: (libjpeg scale,
    width, height) as its decoder is configured now, before decoding.

    The scale is read from the decoder config :meth:`PIL.Image.Image.draft` sets (1 when
    none was set, or for other formats): two scales can give one size for a tiny JPEG.
    """
    config = getattr(image, "decoderconfig", ())
    scale = int(config[0]) if image.format == "JPEG" and config else 1
    width, height = image.size
    return scale, width, height


def header_bytes(data: bytes, image: Image.Image) -> bytes:
    """A JPEG's bytes up to its first scan (markers, EXIF, tables), just opened from ``data``:
    enough to open it again and configure its decoder, not to decode it. Empty for other
    formats, which no decoder reduces."""
    fp = getattr(image, "fp", None)  # an ImageFile's, left at the first scan by its opening
    return data[: fp.tell()] if image.format == "JPEG" and fp is not None else b""


def shard_decode_key(head: bytes, target: Target) -> tuple[int, int, int] | None:
    """The :func:`decode_key` the shard stage's decoder gets for the JPEG whose header is
    ``head`` (:func:`header_bytes`): opened and configured as
    :func:`tasks.images.preprocess_bytes` does; None when the header does not open."""
    try:
        image = open_checked(head, max_pixels=sys.maxsize, min_side=1)
        if target.draft:
            draft_for(image, (target.height, target.width), target.policy)
    except Exception:
        return None
    return decode_key(image)


def signature_of(path: Path) -> Signature:
    info = os.stat(path)
    return (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)


def checksum(fields: bytes, pixels: bytes) -> int:
    """CRC-32C of an entry's fields then its pixels."""
    return int(google_crc32c.extend(google_crc32c.value(fields), pixels))


def folder_for(root: Path, version: str) -> Path:
    """The hand-off folder of one preprocessing version under ``root``."""
    return Path(root) / version


def entry_path(folder: Path, sha256: str) -> Path:
    return Path(folder) / f"{sha256}.px"


class HandoffWriter:
    """Keeps the shard stage's pixels for ``target`` in ``folder`` up to ``budget`` bytes
    (one process's share).

    ``trusted_before_ns``: a file whose stat signature last changed before then may be
    trusted to be unchanged while its signature is (what ``ingest.trust_file_stat`` trusts,
    with the same margin against writes in the tick of the stat); None trusts none.
    """

    def __init__(
        self, folder: Path, budget: int, target: Target, trusted_before_ns: int | None = None
    ) -> None:
        self.folder = Path(folder)
        self.budget = budget
        self.target = Target(*target)
        self.trusted_before_ns = trusted_before_ns
        self.spent = 0
        self.made = False  # the folder, made by the first entry written

    def put(
        self,
        sha256: str,
        signature: Signature | None,
        decoded: Image.Image,
        key: tuple[int, int, int],
        head: bytes,
    ) -> bool:
        """Keep the target's pixels of ``decoded`` (what finish_decode returned for the image
        ``key`` names) for the content ``sha256``, with its file's ``signature``; ``head``:
        the file's :func:`header_bytes`. False when it is not an ``L``/``RGB`` image, the
        shard stage would decode it at another scale, its entry would cost more than the
        decode it saves (:func:`worth_handing_off`: small images), it is
        past the budget, or the write failed: the shard stage then decodes, as it always could."""
        if decoded.mode not in ("L", "RGB"):
            return False
        target, size = self.target, self.target.entry_bytes
        scale, draft_width, draft_height = key
        if not worth_handing_off(draft_width * draft_height * scale * scale, size):
            return False
        if self.spent + size > self.budget:
            return False
        path = entry_path(self.folder, sha256)
        if path.exists():  # the same content under another name: kept once
            return True
        # A JPEG is reduced by its decoder: kept only when the shard stage's decoder would
        # be set as ingest's was. No other format is (its key's scale is 1 on both sides).
        if (shard_decode_key(head, target) if head else (1, draft_width, draft_height)) != key:
            return False
        trusted = (
            signature is not None
            and self.trusted_before_ns is not None
            and max(signature[1:3]) < self.trusted_before_ns
        )
        pixels = resize_image(decoded, (target.height, target.width), target.policy).tobytes()
        fields = FIELDS.pack(
            bytes.fromhex(sha256),
            target.height,
            target.width,
            RESIZE_POLICIES.index(target.policy),
            target.draft,
            *(signature if trusted and signature else NO_SIGNATURE),
            trusted,
        )
        header = fields + CRC.pack(checksum(fields, pixels))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if not self.made:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.made = True
            with open(tmp, "wb") as handle:
                handle.write(MAGIC + header)
                handle.write(pixels)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self.spent += size
        return True


@dataclass(frozen=True)
class Entry:
    """One kept record's pixels, read back whole."""

    pixels: np.ndarray  # uint8 height x width x 3, what preprocess_bytes returns
    signature: Signature | None  # the file's stat when ingest read it, if it may be trusted

    def file_unchanged(self, path: Path) -> bool:
        """Whether ``path``'s stat still says the bytes are those ingest hashed."""
        try:
            return self.signature is not None and signature_of(path) == self.signature
        except OSError:
            return False


def take(folder: Path, sha256: str, target: Target) -> Entry | None:
    """The pixels kept for content ``sha256`` at ``target``, removed from the folder (each
    content is sharded once a run); None when there are none, they were made for another
    target, or they do not read back whole (wrong length, magic, content hash, or a checksum
    of the fields and pixels that does not match)."""
    path = entry_path(folder, sha256)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    start = len(MAGIC) + HEADER_SIZE
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        return None
    fields = data[len(MAGIC) : len(MAGIC) + FIELDS.size]
    (digest, height, width, policy, draft, *stat) = FIELDS.unpack(fields)
    *signature, trusted = stat
    (crc,) = CRC.unpack(data[len(MAGIC) + FIELDS.size : start])
    pixels = data[start:]
    made_for = (height, width, RESIZE_POLICIES[policy] if policy < len(RESIZE_POLICIES) else "")
    if (
        digest.hex() != sha256
        or (*made_for, bool(draft)) != tuple(target)
        or len(pixels) != height * width * CHANNELS
        or checksum(fields, pixels) != crc
    ):
        return None
    array = np.frombuffer(pixels, dtype=np.uint8).reshape(height, width, CHANNELS)
    kept = tuple(signature) if trusted else None
    return Entry(array, kept)  # type: ignore[arg-type]


def clear(root: Path, *, keep: str | None = None) -> None:
    """Remove the hand-off under ``root``: every version's folder, or all but ``keep``'s."""
    root = Path(root)
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if folder.name != keep:
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
            else:
                folder.unlink(missing_ok=True)
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
