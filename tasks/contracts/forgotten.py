"""The audit record of forgotten images: ``data/forgotten.json`` (git-tracked).

Each entry names the content hashes forgotten (never a file name: a name can itself be
personal), who asked, when and why, and what was removed where. An entry is written first
with ``state: "started"`` (the intent a rerun of a killed ``shardflow forget`` completes),
then rewritten ``"done"`` once no copy is left, or ``"abandoned"`` when
``shardflow forget --abandon`` gives it up. One erasure is unfinished at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.runtime.atomic import write_text
from tasks.runtime.refusals import Refused

RECORD_FORMAT = 1


class Erasure(BaseModel):
    """One ``shardflow forget``: what was asked and what it removed."""

    model_config = ConfigDict(extra="forbid")

    sha256: list[str]  # every hash removed: the images named and their near-duplicates
    asked: list[str]  # the hashes named on the command line (the rest: their groups)
    by: str
    at: str  # UTC, ISO 8601 to the second
    reason: str
    models: Literal["retrain", "delete", "keep"]
    # "abandoned": `shardflow forget --abandon` gave it up unfinished (when: abandoned_at);
    # what its steps done removed stays removed, its images are not forgotten
    state: Literal["started", "done", "abandoned"] = "started"
    abandoned_at: str | None = None
    steps: list[str] = Field(default_factory=list)  # the steps done (a rerun skips them)
    removed: dict[str, list[str]] = Field(default_factory=dict)  # where -> what (no names)
    versions: dict[str, list[str]] = Field(default_factory=dict)  # retracted/deleted/retrained
    # git commits and DVC experiment refs whose dvc.lock names a removed DVC object: they can
    # no longer be checked out with their data
    unrecoverable: dict[str, list[str]] = Field(default_factory=dict)
    # pipeline stages left stale (--models keep or delete retrain nothing): `dvc repro`
    stale: list[str] = Field(default_factory=list)


class ForgottenRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = RECORD_FORMAT
    erasures: list[Erasure] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


class ForgottenRecordUnreadable(Refused):
    """``data/forgotten.json`` cannot be read."""


def load_forgotten(path: Path) -> ForgottenRecord:
    """The record at ``path`` (an empty one when none was written yet)."""
    path = Path(path)
    if not path.exists():
        return ForgottenRecord()
    try:
        record = ForgottenRecord.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError) as error:
        raise ForgottenRecordUnreadable(
            f"{path}: the record of forgotten images is unreadable ({error})",
            fix=f"git checkout -- {path}",
        ) from error
    if record.format != RECORD_FORMAT:
        raise ForgottenRecordUnreadable(
            f"{path}: format {record.format}, this code reads {RECORD_FORMAT}",
            fix=f"git checkout -- {path}",
        )
    return record


def save_forgotten(path: Path, record: ForgottenRecord) -> None:
    write_text(Path(path), record.to_json())


def forgotten_at(path: Path, sha256: str) -> str | None:
    """When the image with this content hash was forgotten (its erasure's start); None if never."""
    for erasure in load_forgotten(path).erasures:
        if sha256 in erasure.sha256 and erasure.state != "abandoned":
            return erasure.at
    return None
