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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.runtime.params import Params


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


# The demo's source folder: its registered model keeps the project's own name, so the
# demo's lineage (and every `models:/shardflow@champion` already in use) stays where it was.
DEMO_SOURCE = "data/demo"
DEMO_MODEL_NAME = "shardflow"


def registered_model_name(
    model_name: str | None, source_dir: str, labels_csv: str | None, root: str | Path = "."
) -> str:
    """The registered model a dataset's versions go to: ``evaluate.model_name`` when set;
    else ``shardflow`` for the demo's data and ``shardflow-<dataset_slug>`` for any other,
    so a new dataset (a new task) starts a lineage of its own and never competes with the
    demo's champion."""
    if model_name:
        return model_name
    identity = dataset_identity(source_dir, labels_csv, root)
    return DEMO_MODEL_NAME if identity == DEMO_SOURCE else f"shardflow-{dataset_slug(identity)}"


def model_name_for(params: Params, root: str | Path = ".") -> str:
    """:func:`registered_model_name` of the dataset ``params`` name (the current one)."""
    ingest = params.ingest
    return registered_model_name(
        params.evaluate.model_name, ingest.source_dir, ingest.labels_csv, root
    )
