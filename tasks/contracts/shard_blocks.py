"""The block list: every shard's sha256 block by block, beside the manifest.

``blocks.json`` sits in the shard folder beside ``offsets.json`` and, like it, outside the
fingerprint: the manifest names what the set holds, this file says how to check a shard a
piece at a time. A read from object storage (:mod:`tasks.contracts.shard_store`) fetches a
shard as ranged requests of one block each, several in flight, and checks each block's
sha256 as it arrives, so a bad byte is refused naming its shard, its block and the block's
byte range, and no block waits for the whole shard to be hashed.

Each entry repeats the manifest's ``bytes`` and ``sha256`` of its shard, which tie it to
that shard: :func:`check_block_list` refuses a list whose entries, fingerprint or block
counts disagree with the manifest. The shard stage hashes each block from the very bytes
whose whole sha256 it checks against the manifest while writing the list.

Format (the bytes ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` gives, with a
line break before each shard; same shards, same bytes)::

    {"block_size":1048576,"fingerprint":"<the manifest's>","shards":{
    "<shard file>":{"blocks":["<sha256 of block 0>",...],"bytes":N,"sha256":"<whole shard>"},
    ...
    },"version":1}

Pure Python: an import-linter contract keeps TensorFlow and boto3 out.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.contracts.manifest import ShardFile, ShardManifest
from tasks.runtime.atomic import write_text

BLOCKS_NAME = "blocks.json"
BLOCKS_VERSION = 1
# One ranged GET a block: large enough that a request's overhead is small beside its bytes,
# small enough that a bad byte is placed within a MiB and blocks in flight take few MiB.
BLOCK_SIZE = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BlockListError(ValueError):
    """A block list that is not one, or that does not describe its manifest's shards."""


@dataclass(frozen=True)
class ShardBlocks:
    """One shard's entry: its size and sha256 (as the manifest has them) and each block's."""

    file: str
    bytes: int
    sha256: str
    blocks: tuple[str, ...]

    def span(self, number: int, block_size: int) -> tuple[int, int]:
        """First and last byte (inclusive, as an HTTP ``Range`` names them) of block
        ``number``; the last block is the shorter one."""
        first = number * block_size
        return first, min(first + block_size, self.bytes) - 1

    def to_json(self) -> str:
        """The entry as the list holds it (``"file":{...}``): the same entry, the same bytes."""
        body = {"blocks": list(self.blocks), "bytes": self.bytes, "sha256": self.sha256}
        return f"{json.dumps(self.file)}:{json.dumps(body, sort_keys=True, separators=(',', ':'))}"


@dataclass(frozen=True)
class BlockList:
    """A parsed ``blocks.json``: the set's block size, the fingerprint it was written for,
    and the entries by shard file."""

    block_size: int
    fingerprint: str
    shards: dict[str, ShardBlocks]


def block_count(size: int, block_size: int) -> int:
    """Blocks that cover ``size`` bytes exactly (the last one shorter; none for no bytes)."""
    return -(-size // block_size)


def hash_blocks(path: Path, shard: ShardFile, block_size: int = BLOCK_SIZE) -> ShardBlocks:
    """``shard``'s entry, read from ``path`` once: each block's sha256, the whole file's
    checked against the manifest's (a shard changed since it was written is refused)."""
    whole, blocks, size = hashlib.sha256(), [], 0
    with path.open("rb") as handle:
        while block := handle.read(block_size):
            whole.update(block)
            blocks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    if size != shard.bytes or whole.hexdigest() != shard.sha256:
        raise BlockListError(
            f"{path}: {size} bytes with sha256 {whole.hexdigest()[:12]}, the manifest says "
            f"{shard.bytes} bytes with sha256 {shard.sha256[:12]} (changed since it was "
            "written); rerun the shard stage"
        )
    return ShardBlocks(shard.file, shard.bytes, shard.sha256, tuple(blocks))


def block_list_text(fingerprint: str, entries: list[ShardBlocks], block_size: int) -> str:
    """The list's bytes: entries sorted by shard file, one a line."""
    ordered = sorted(entries, key=lambda entry: entry.file)
    lines = "".join(f"{',' if n else ''}\n{entry.to_json()}" for n, entry in enumerate(ordered))
    return (
        f'{{"block_size":{block_size},"fingerprint":{json.dumps(fingerprint)},"shards":{{'
        f'{lines}\n}},"version":{BLOCKS_VERSION}}}\n'
    )


def block_entries(
    manifest: ShardManifest,
    shards_dir: str | Path,
    *,
    base: ShardManifest | None = None,
    block_size: int = BLOCK_SIZE,
) -> list[ShardBlocks]:
    """Every shard's entry. With ``base`` (an append), a base shard keeps the entry the
    folder's list holds where that list is the base's (its fingerprint, block size and the
    shard's entry checked against the base manifest); any other shard is read and hashed."""
    shards_dir = Path(shards_dir)
    known = _base_entries(shards_dir, base, block_size)
    entries = []
    for info in manifest.splits.values():
        for shard in info.shards:
            entry = known.get(shard.file)
            if entry is None or (entry.bytes, entry.sha256) != (shard.bytes, shard.sha256):
                entry = hash_blocks(shards_dir / shard.file, shard, block_size)
            entries.append(entry)
    return entries


def write_block_list(
    manifest: ShardManifest,
    shards_dir: str | Path,
    base: ShardManifest | None = None,
    *,
    block_size: int = BLOCK_SIZE,
) -> None:
    """Write ``blocks.json`` for the manifest's shards (atomically; same shards, same bytes)."""
    entries = block_entries(manifest, shards_dir, base=base, block_size=block_size)
    write_text(
        Path(shards_dir) / BLOCKS_NAME,
        block_list_text(manifest.fingerprint, entries, block_size),
    )


def _base_entries(
    shards_dir: Path, base: ShardManifest | None, block_size: int
) -> dict[str, ShardBlocks]:
    """The base's checked entries, or none where the folder holds no list of the base (a set
    written before block lists, an edited list, another block size): those are hashed again."""
    path = shards_dir / BLOCKS_NAME
    if base is None or not path.exists():
        return {}
    try:
        listed = check_block_list(
            parse_block_list(path.read_text(), where=str(path)), base, where=str(path)
        )
    except BlockListError:
        return {}
    return listed.shards if listed.block_size == block_size else {}


def parse_block_list(text: str, *, where: str) -> BlockList:
    """A block list from its JSON text (``where`` names its file or object in errors)."""
    try:
        data = json.loads(text)
        if data["version"] != BLOCKS_VERSION:
            raise ValueError(f"version {data['version']!r}, this code reads {BLOCKS_VERSION}")
        block_size = data["block_size"]
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size {block_size!r}")
        shards = {file: _entry(file, body) for file, body in data["shards"].items()}
        fingerprint = str(data["fingerprint"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise BlockListError(
            f"{where}: not a block list this code reads ({error}); rerun the shard stage and "
            "republish the shard set"
        ) from error
    return BlockList(block_size, fingerprint, shards)


def _entry(file: str, body: dict[str, Any]) -> ShardBlocks:
    blocks = tuple(body["blocks"])
    if not all(isinstance(b, str) and _SHA256.fullmatch(b) for b in blocks):
        raise ValueError(f"{file}: a block's sha256 is not 64 hex digits")
    return ShardBlocks(file, int(body["bytes"]), str(body["sha256"]), blocks)


def check_block_list(listed: BlockList, manifest: ShardManifest, *, where: str) -> BlockList:
    """``listed``, refused naming ``where`` unless it describes exactly ``manifest``'s shards:
    the same fingerprint, every shard listed with the manifest's bytes and sha256 and as many
    blocks as cover those bytes, and no other shard."""
    problems = []
    if listed.fingerprint != manifest.fingerprint:
        problems.append(
            f"lists shard set {listed.fingerprint[:12]}, the manifest is "
            f"{manifest.fingerprint[:12]} (a list of another set)"
        )
    wanted = {s.file: s for info in manifest.splits.values() for s in info.shards}
    for file, shard in sorted(wanted.items()):
        entry = listed.shards.get(file)
        if entry is None:
            problems.append(f"lists no entry for shard {file}")
        elif (entry.bytes, entry.sha256) != (shard.bytes, shard.sha256):
            problems.append(
                f"lists {file} with {entry.bytes} bytes and sha256 {entry.sha256[:12]}, the "
                f"manifest says {shard.bytes} bytes and sha256 {shard.sha256[:12]}"
            )
        elif len(entry.blocks) != block_count(shard.bytes, listed.block_size):
            problems.append(
                f"lists {len(entry.blocks)} blocks of {listed.block_size} bytes for {file}, "
                f"its {shard.bytes} bytes take {block_count(shard.bytes, listed.block_size)}"
            )
    extra = sorted(set(listed.shards) - set(wanted))
    problems += [f"lists {file}, a shard the manifest does not" for file in extra]
    if problems:
        shown = "; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if problems[3:] else "")
        raise BlockListError(
            f"{where}: {shown}; rerun the shard stage (it writes {BLOCKS_NAME} beside the "
            "manifest) and republish the shard set"
        )
    return listed
