"""File names DVC cannot hash: find them, and rename them losslessly on request.

DVC hashes a dependency folder by path; a name that is not valid UTF-8 makes it fail with its
own ``UnicodeEncodeError`` (naming no file) before any stage runs, `dvc status` included.
Shardflow's ingest quarantines such a file, but under DVC the run never gets that far, so:

    python -m tasks.ingest.filenames check [FOLDER]   # list them (exit 1 when there are any)
    python -m tasks.ingest.filenames fix [FOLDER]     # rename them, e.g. caf\\xe9.jpg -> caf%E9.jpg

FOLDER defaults to ``ingest.source_dir`` from ``params.yaml``. The rename is lossless: in a
renamed name every byte that is not valid UTF-8, and every ``%``, becomes ``%XX`` (its hex
value), so :func:`original_name` recovers the exact original bytes. Names that are valid UTF-8
are never touched. `make run` runs ``check`` before `dvc repro`, and refuses a ``source_dir``
no folder can be called. Special files and stray links are quarantined by ingest: DVC depends
on a listing of the folder, never on its bytes (:mod:`tasks.ingest.source_check`).
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
from pathlib import Path

from tasks.ingest.source_check import refuse_unnamable
from tasks.runtime.refusals import Refused


def is_valid(name: bytes) -> bool:
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _percent_escape(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeDecodeError)
    bad = error.object[error.start : error.end]
    return "".join(f"%{byte:02X}" for byte in bad), error.end


codecs.register_error("shardflow-percent", _percent_escape)


def escaped_name(name: bytes) -> str:
    """A valid UTF-8 name for ``name``: bad bytes and ``%`` as ``%XX``, the rest as is."""
    return name.replace(b"%", b"%25").decode("utf-8", "shardflow-percent")


def original_name(escaped: str) -> bytes:
    """Invert :func:`escaped_name`."""
    out = bytearray()
    text = escaped.encode("utf-8")
    position = 0
    while position < len(text):
        if text[position : position + 1] == b"%":
            out.append(int(text[position + 1 : position + 3], 16))
            position += 3
        else:
            out.append(text[position])
            position += 1
    return bytes(out)


def find_invalid(folder: Path) -> list[bytes]:
    """Paths (bytes, deepest first) under ``folder`` whose own name is not valid UTF-8."""
    found = []
    for current, dirs, files in os.walk(os.fsencode(folder)):
        for name in [*dirs, *files]:
            if not is_valid(name):
                found.append(os.path.join(current, name))
    return sorted(found, key=lambda p: (-p.count(b"/"), p))


def fix(folder: Path) -> list[tuple[bytes, bytes]]:
    """Rename every invalid name (deepest first, so parents move last); return the moves."""
    moves = []
    for path in find_invalid(folder):
        parent, name = os.path.split(path)
        target = os.path.join(parent, escaped_name(name).encode("utf-8"))
        if os.path.lexists(target):
            raise FileExistsError(f"{os.fsdecode(target)} exists; rename {path!r} by hand")
        os.rename(path, target)
        moves.append((path, target))
    return moves


def _source_dir() -> str:
    from tasks.runtime.params import load_params

    return load_params().ingest.source_dir


def _refusal(error: Refused) -> int:
    print(f"refused: {error}", file=sys.stderr)
    if error.fix:
        print(f"fix: {error.fix}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.ingest.filenames", description=__doc__)
    parser.add_argument("command", choices=("check", "fix"))
    parser.add_argument("folder", nargs="?", help="default: ingest.source_dir from params.yaml")
    args = parser.parse_args(argv)
    try:
        folder = args.folder or _source_dir()
        refuse_unnamable(folder)
    except Refused as error:
        return _refusal(error)
    if not os.path.isdir(folder):
        return 0  # nothing to check yet; ingest reports a missing folder itself
    if args.command == "fix":
        for old, new in fix(Path(folder)):
            print(f"renamed {old.decode('utf-8', 'backslashreplace')} -> {os.fsdecode(new)}")
        return 0
    return _check(Path(folder))


def _check(folder: Path) -> int:
    invalid = find_invalid(folder)
    for path in invalid:
        print(f"not valid UTF-8: {path.decode('utf-8', 'backslashreplace')}", file=sys.stderr)
    if invalid:
        print(
            f"{len(invalid)} file name(s) under {folder} are not valid UTF-8: DVC cannot hash "
            "the folder. Rename them losslessly with "
            f"`python -m tasks.ingest.filenames fix {folder}`.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
