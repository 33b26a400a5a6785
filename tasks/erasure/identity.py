"""What a file holds of the forgotten images, told by what it is, never by a byte search.

A file (or an object, an artifact) is taken as holding a forgotten image only when:

- its bytes are a forgotten source file (their sha256 is a forgotten content hash);
- its name is a forgotten content hash (a staged or re-encoded copy, named by its hash);
- it is a TFRecord stream one of whose records carries a forgotten content hash;
- it is JSON (or JSON lines) one of whose keys or string values *is* a forgotten content
  hash or a forgotten image's path (whole, never a part of another name);
- it is a text table (CSV, TSV, a Markdown table) one of whose cells is one.

A name that is a substring of another (``a/1.png`` in ``a/11.png``), or the same file name
in another class folder (``b/1.png``), is another image. What a byte search still finds
after the scrub is reported (:func:`mentions`), never deleted on that ground.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.schema import HASH_KEY
from tasks.tfrecord import CorruptRecord, decode_example, read_framed

_HEX64 = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_GZIP_MAGIC = b"\x1f\x8b"
_CELL_SEPARATORS = re.compile(r"[,\t|]")
# the characters a path or a hash may continue with: a mark bounded by none of them is whole
_NAME_CHARS = r"\w./\\-"


@dataclass(frozen=True)
class Forgotten:
    """The identities of the images being forgotten: their content hashes, and their paths
    as the project writes them (relative to ``source_dir``, from the project root, absolute)."""

    hashes: frozenset[str]
    paths: frozenset[str]

    @classmethod
    def of(
        cls, hashes: Iterable[str], sources: Iterable[str], *, source_dir: Path, root: Path
    ) -> Forgotten:
        """``sources`` relative to ``source_dir``; every spelling of each path."""
        source_dir, root = Path(source_dir), Path(root)
        try:
            from_root = source_dir.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            from_root = None
        paths: set[str] = set()
        for relative in sources:
            paths.add(relative)
            paths.add((source_dir / relative).as_posix())
            paths.add((source_dir.resolve() / relative).as_posix())
            if from_root is not None:
                paths.add(f"{from_root}/{relative}")
        return cls(frozenset(hashes), frozenset(paths))

    def names(self, value: str) -> bool:
        """Whether ``value`` is, whole, a forgotten hash or path."""
        return value in self.hashes or value in self.paths

    def marks(self) -> list[str]:
        return sorted(self.hashes | self.paths, key=len, reverse=True)

    def named_in(self, text: str) -> bool:
        """Whether ``text`` (a log line, a tag) names a forgotten image as a whole token: a
        hash or a path not continued by another name's characters."""
        return bool(self.pattern().search(text)) if self.hashes or self.paths else False

    def pattern(self) -> re.Pattern[str]:
        alternatives = "|".join(re.escape(mark) for mark in self.marks())
        # a dot ends a sentence, or continues a name when a name character follows it
        return re.compile(rf"(?<![{_NAME_CHARS}])(?:{alternatives})(?![\w/\\-]|\.\w)")

    def redact(self, text: str, replacement: str) -> str:
        if not (self.hashes or self.paths):
            return text
        return self.pattern().sub(replacement, text)


def holds(name: str, data: bytes, forgotten: Forgotten) -> bool:
    """Whether a file named ``name`` with bytes ``data`` holds a forgotten image by identity
    (the module's four rules)."""
    if hashlib.sha256(data).hexdigest() in forgotten.hashes:
        return True
    if any(h in forgotten.hashes for h in _HEX64.findall(Path(name).name)):
        return True
    records = record_hashes(data)
    if records is not None:
        return bool(records & forgotten.hashes)
    documents = json_documents(data)
    if documents is not None:
        return any(forgotten.names(value) for value in _strings(documents))
    return any(forgotten.names(cell) for cell in table_cells(data))


def record_hashes(data: bytes) -> set[str] | None:
    """The content hashes of the records of a TFRecord stream (GZIP or not); None when the
    bytes are not one (their framing or Example bytes do not check out)."""
    if data.startswith(_GZIP_MAGIC):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, ValueError):
            return None
    found: set[str] = set()
    handle = io.BytesIO(data)
    try:
        while (record := read_framed(handle)) is not None:
            value = decode_example(record).get(HASH_KEY)
            if isinstance(value, bytes):
                found.add(value.decode("ascii", errors="replace"))
    except (CorruptRecord, UnicodeDecodeError):
        return None
    return found if data else None


def json_documents(data: bytes) -> list[Any] | None:
    """The JSON document, or each line of a JSON-lines file; None for anything else."""
    if not data.strip() or data.lstrip()[:1] not in (b"{", b"["):
        return None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        return None


def table_cells(data: bytes) -> Iterator[str]:
    """Every cell of a text table (comma, tab or ``|`` separated), stripped of spaces,
    quotes and backticks; nothing for bytes that are not UTF-8 text."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return
    for line in text.splitlines():
        for cell in _CELL_SEPARATORS.split(line):
            yield cell.strip().strip("\"'`").strip()


def _strings(value: Any) -> Iterator[str]:
    """Every string of a JSON value: keys and string values, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def mentions(data: bytes, forgotten: Forgotten) -> bool:
    """Whether a byte search finds a forgotten hash (hex or raw) or path, bounded as in
    :meth:`Forgotten.named_in`: a report of what is left, never a reason to delete."""
    if any(bytes.fromhex(h) in data for h in forgotten.hashes):
        return True
    return forgotten.named_in(data.decode("latin-1"))
