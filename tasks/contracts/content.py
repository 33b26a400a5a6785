"""What every stage names data by, free of any stage: the split names, a file's sha256, what
a class may be called, how a path is shown, and the CSV lists users name files in.

Ingest assigns records to these splits and hashes source files with this; the shard
manifest lists the same splits and checks shards with the same hash, and ingest need not
import the manifest for either. Ingest and batch prediction read a user's CSV one way.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import os
import stat
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

SPLITS = ("train", "val", "test")


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read ``chunk`` bytes at a time (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def display_name(path: str) -> str:
    """A path as text that is always valid UTF-8 (undecodable bytes shown as ``\\xNN``)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def file_kind(mode: int) -> str:
    """What a ``st_mode`` that is not a regular file is, in words."""
    kinds = {
        stat.S_ISDIR: "a folder",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def class_label(name: str) -> str:
    """The class a folder name or CSV label names, in Unicode's composed form (NFC): macOS
    and some sync tools write ``café`` decomposed (``e`` + a combining accent), and the two
    spellings, which look alike everywhere, are one class."""
    return unicodedata.normalize("NFC", name)


@functools.cache  # ingest asks once per file, of a few distinct labels
def class_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a class (None when it can): class names are written one a line
    (TFDS's ``label.labels.txt``, read back stripped) and shown in reports, so a name is one
    line of visible text with no control character and no space around it."""
    if not name.strip():
        return "a class name needs a visible character"
    if name != name.strip():
        return "a class name cannot start or end with a space"
    if len(name.splitlines()) != 1 or any(unicodedata.category(c) == "Cc" for c in name):
        return "a class name cannot hold a line break or a control character"
    return None


def check_class_names(names: Iterable[str], where: str, fix: str) -> None:
    """Refuse (``ValueError``: ``where``, the name, why, ``fix``) the first of ``names``
    that cannot be a class (:func:`class_name_problem`)."""
    for name in names:
        if problem := class_name_problem(name):
            raise ValueError(f"{where}: class {name!r}: {problem}; {fix}")


def csv_rows(
    path: Path, columns: tuple[str, ...], what: str
) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, row) of a UTF-8 CSV with a header naming ``columns`` (a byte-order mark, as
    spreadsheets save it, is allowed), ``line`` as an editor counts it; an error names the
    file and ``what`` it is (``ingest.labels_csv``, say)."""
    if not path.is_file():
        found = "not found" if not path.exists() else "not a file"
        raise FileNotFoundError(f"{path}: {found} ({what} names a CSV file)")
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            if not reader.fieldnames or not set(columns) <= set(reader.fieldnames):
                header = ",".join(columns)
                raise ValueError(
                    f"{path}: needs a header with columns `{header}` "
                    f"(found {reader.fieldnames}; {what})"
                )
            for row in reader:
                yield reader.line_num, {k: (row.get(k) or "").strip() for k in columns}
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path}: not UTF-8 (byte {error.start}: {error.reason}); save {what} as UTF-8"
        ) from None
