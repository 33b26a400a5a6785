"""Which dataset a run is about, as every clone of a team names it.

A dataset's identity is what ``params.yaml`` names as its source: ``ingest.source_dir`` as
written (relative to the repository when it lies inside it, so two clones agree) and
``ingest.labels_csv``. It never depends on the files' content: a change within a dataset is
a new version of the same dataset.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path, PurePosixPath


def dataset_identity(source_dir: str, labels_csv: str | None, root: str | Path = ".") -> str:
    """``source_dir`` (repository-relative where it is inside ``root``, POSIX separators,
    no trailing slash), then ``::`` and ``labels_csv`` when one is set."""
    base = Path(root).resolve()
    raw = Path(source_dir)
    absolute = Path(os.path.normpath(raw if raw.is_absolute() else base / raw))
    try:
        name = PurePosixPath(absolute.relative_to(base).as_posix()).as_posix()
    except ValueError:
        name = absolute.as_posix()
    name = name or "."
    return f"{name}::{labels_csv}" if labels_csv else name


def dataset_slug(identity: str) -> str:
    """A short name for ``identity`` that fits a registered model's name: its last folder
    (and CSV stem), lower-cased, plus 6 hex characters of the identity's hash so two folders
    of one name never share it."""
    folder, _, csv = identity.partition("::")
    words = PurePosixPath(folder).name or "data"
    if csv:
        words += "-" + PurePosixPath(csv).stem
    words = re.sub(r"[^a-z0-9]+", "-", words.lower()).strip("-") or "data"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:6]
    return f"{words[:40]}-{digest}"
