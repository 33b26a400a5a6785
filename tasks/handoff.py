"""The decode hand-off: ingest's decode of a new image, kept for the shard stage to reuse.

Ingest decodes every new image to check it and take its perceptual hash; the shard stage
then decoded it again. Ingest now keeps what :func:`tasks.images.finish_decode` returned
(8-bit ``L`` or ``RGB`` pixels) in a bounded folder inside the repository
(``.shardflow/handoff/<preprocessing version>/``, gitignored, never a DVC dependency), one
entry per content hash, with the JPEG's header (its bytes up to the first scan). The shard
stage opens the image's header, configures its decoder as it always does
(:func:`tasks.images.draft_for`) and, when the entry was decoded at that same scale, resizes
the kept pixels instead of decoding: the same libjpeg scaling and the same
:func:`~tasks.images.finish_decode` made them, so the record's bytes are those of a decode.
Anything else (no entry, another scale, an entry that does not read back whole) is a decode
as before, never another record.

The shard stage reads and hashes each source file to check that it is the one ingest
indexed. An entry also keeps the file's stat signature when ``ingest.trust_file_stat``
trusts it (with ingest's margin against a write in the tick of the stat): while the file's
stat is unchanged, its bytes are ingest's, and a hit opens the kept header instead of
reading the file again. A file whose stat changed is read and hashed, and refused as before.

Keyed by content (sha256) and by decoder (the folder is the preprocessing version, which
names this code's pixel libraries), so no entry is used for other bytes or by another
decoder. Ingest empties the folder when it starts and writes at most ``ingest.handoff_mb``;
the shard stage removes each entry it reads and the folder when it ends, so nothing grows
across runs.
"""

from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
from PIL import Image

from tasks.worker_cost import worth_handing_off

MAGIC = b"SFHANDO3"
# The content's sha256; the decoder's scale, width and height before decoding (the size the
# decoder was set to, before orientation); channels, width and height of the kept pixels
# (after orientation); the file's stat signature when ingest read it (size, mtime_ns,
# ctime_ns, inode, device) and whether it may be trusted; the length of the file's header
# kept; CRC-32C of the header and the pixels (google-crc32c runs on the CPU's crc32
# instruction: a fraction of zlib's crc32, paid on both sides of the hand-off for every photo).
HEADER = struct.Struct("<32sBIIBIIIQqqQQBI")
MODES = {1: "L", 3: "RGB"}

Signature = tuple[int, int, int, int, int]  # (size, mtime_ns, ctime_ns, inode, device)
NO_SIGNATURE = (0, 0, 0, 0, 0)


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
    formats (the shard stage then reads the file)."""
    fp = getattr(image, "fp", None)  # an ImageFile's, left at the first scan by its opening
    return data[: fp.tell()] if image.format == "JPEG" and fp is not None else b""


def signature_of(path: Path) -> Signature:
    info = os.stat(path)
    return (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)


def checksum(head: bytes, pixels: bytes) -> int:
    """CRC-32C of an entry's header then pixels."""
    return int(google_crc32c.extend(google_crc32c.value(head), pixels))


def folder_for(root: Path, version: str) -> Path:
    """The hand-off folder of one preprocessing version under ``root``."""
    return Path(root) / version


def entry_path(folder: Path, sha256: str) -> Path:
    return Path(folder) / f"{sha256}.px"


class HandoffWriter:
    """Keeps decoded images in ``folder`` up to ``budget`` bytes (one process's share).

    ``trusted_before_ns``: a file whose stat signature last changed before then may be
    trusted to be unchanged while its signature is (what ``ingest.trust_file_stat`` trusts,
    with the same margin against writes in the tick of the stat); None trusts none.
    """

    def __init__(self, folder: Path, budget: int, trusted_before_ns: int | None = None) -> None:
        self.folder = Path(folder)
        self.budget = budget
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
        """Keep ``decoded`` (what finish_decode returned for the image ``key`` names) for the
        content ``sha256`` with its file's ``signature`` and ``head`` (:func:`header_bytes`).
        False when it is not an ``L``/``RGB`` image, its entry would cost more than the
        decode it saves (:func:`tasks.worker_cost.worth_handing_off`: small images), it is
        past the budget, or the write failed: the shard stage then decodes, as it always could."""
        channels = {"L": 1, "RGB": 3}.get(decoded.mode)
        if channels is None:
            return False
        width, height = decoded.size
        size = len(MAGIC) + HEADER.size + len(head) + width * height * channels
        scale, draft_width, draft_height = key
        if not worth_handing_off(draft_width * draft_height * scale * scale, size):
            return False
        if self.spent + size > self.budget:
            return False
        path = entry_path(self.folder, sha256)
        if path.exists():  # the same content under another name: kept once
            return True
        trusted = (
            signature is not None
            and self.trusted_before_ns is not None
            and max(signature[1:3]) < self.trusted_before_ns
        )
        pixels = decoded.tobytes()
        header = HEADER.pack(
            bytes.fromhex(sha256),
            *key,
            channels,
            width,
            height,
            checksum(head, pixels),
            *(signature if trusted and signature else NO_SIGNATURE),
            trusted,
            len(head),
        )
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if not self.made:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.made = True
            with open(tmp, "wb") as handle:
                handle.write(MAGIC + header + head)
                handle.write(pixels)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self.spent += size
        return True


@dataclass(frozen=True)
class Entry:
    """One kept decode, read back whole."""

    key: tuple[int, int, int]
    image: Image.Image
    head: bytes  # the file's header (JPEG), empty when not kept
    signature: Signature | None  # the file's stat when ingest read it, if it may be trusted

    def file_unchanged(self, path: Path) -> bool:
        """Whether ``path``'s stat still says the bytes are those ingest hashed."""
        try:
            return self.signature is not None and signature_of(path) == self.signature
        except OSError:
            return False


def take(folder: Path, sha256: str) -> Entry | None:
    """The kept decode of content ``sha256``, removed from the folder (each content is
    sharded once a run); None when there is none or it does not read back whole (wrong
    length, magic, content hash or checksum)."""
    path = entry_path(folder, sha256)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    start = len(MAGIC) + HEADER.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        return None
    (digest, scale, draft_w, draft_h, channels, width, height, crc, *stat) = HEADER.unpack(
        data[len(MAGIC) : start]
    )
    *signature, trusted, head_len = stat
    body = memoryview(data)[start:]
    head, pixels = bytes(body[:head_len]), bytes(body[head_len:])
    if (
        digest.hex() != sha256
        or channels not in MODES
        or len(head) != head_len
        or len(pixels) != width * height * channels
        or checksum(head, pixels) != crc
    ):
        return None
    try:
        image = Image.frombytes(MODES[channels], (width, height), pixels)
    except (ValueError, MemoryError):  # an entry this code did not write: decode instead
        return None
    kept = tuple(signature) if trusted else None
    return Entry((scale, draft_w, draft_h), image, head, kept)  # type: ignore[arg-type]


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
