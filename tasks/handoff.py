"""The decode hand-off: ingest's decode of a new image, kept for the shard stage to reuse.

Ingest decodes every new image to check it and take its perceptual hash; the shard stage
then decoded it again. Ingest now keeps what :func:`tasks.images.finish_decode` returned
(8-bit ``L`` or ``RGB`` pixels) in a bounded folder inside the repository
(``.shardflow/handoff/<preprocessing version>/``, gitignored, never a DVC dependency), one
entry per content hash. The shard stage opens the image's header, configures its decoder
as it always does (:func:`tasks.images.draft_for`) and, when the entry was decoded at that
same scale, resizes the kept pixels instead of decoding: the same libjpeg scaling and the
same :func:`~tasks.images.finish_decode` made them, so the record's bytes are those of a
decode. Anything else (no entry, another scale, an entry that does not read back whole) is
a decode as before, never another record.

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
import zlib
from pathlib import Path

from PIL import Image

MAGIC = b"SFHANDO1"
# scale, width and height of the decode (before orientation: the size the decoder was set to),
# channels, width and height of the kept pixels (after orientation), crc32 of the pixels
HEADER = struct.Struct("<32sBIIBIII")
MODES = {1: "L", 3: "RGB"}


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


def folder_for(root: Path, version: str) -> Path:
    """The hand-off folder of one preprocessing version under ``root``."""
    return Path(root) / version


def entry_path(folder: Path, sha256: str) -> Path:
    return Path(folder) / f"{sha256}.px"


class HandoffWriter:
    """Keeps decoded images in ``folder`` up to ``budget`` bytes (one process's share)."""

    def __init__(self, folder: Path, budget: int) -> None:
        self.folder = Path(folder)
        self.budget = budget
        self.spent = 0

    def put(self, sha256: str, key: tuple[int, int, int], decoded: Image.Image) -> bool:
        """Keep ``decoded`` (what finish_decode returned for the image ``key`` names) for the
        content ``sha256``; False when past the budget, not an ``L``/``RGB`` image, or the
        write failed (the shard stage then decodes, as it always could)."""
        channels = {"L": 1, "RGB": 3}.get(decoded.mode)
        if channels is None:
            return False
        width, height = decoded.size
        size = HEADER.size + len(MAGIC) + width * height * channels
        if self.spent + size > self.budget:
            return False
        path = entry_path(self.folder, sha256)
        if path.exists():  # the same content under another name: kept once
            return True
        pixels = decoded.tobytes()
        header = HEADER.pack(
            bytes.fromhex(sha256), *key, channels, width, height, zlib.crc32(pixels)
        )
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(MAGIC + header)
                handle.write(pixels)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self.spent += size
        return True


def take(folder: Path, sha256: str, key: tuple[int, int, int]) -> Image.Image | None:
    """The kept decode of content ``sha256`` when it was made with decoder ``key``; the entry
    is removed either way (each content is sharded once a run). None when there is none, it
    was decoded otherwise or it does not read back whole (wrong length, magic or crc32)."""
    path = entry_path(folder, sha256)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    start = len(MAGIC) + HEADER.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        return None
    digest, scale, draft_w, draft_h, channels, width, height, crc = HEADER.unpack(
        data[len(MAGIC) : start]
    )
    pixels = memoryview(data)[start:]
    if (
        digest.hex() != sha256
        or (scale, draft_w, draft_h) != key
        or channels not in MODES
        or len(pixels) != width * height * channels
        or zlib.crc32(pixels) != crc
    ):
        return None
    try:
        return Image.frombytes(MODES[channels], (width, height), bytes(pixels))
    except (ValueError, MemoryError):  # an entry this code did not write: decode instead
        return None


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
