"""What a registered model version is, as the registry records it on the version's tags: the
sha256 of its Keras file (set when evaluation registers it) and whether it was retracted
(by ``shardflow forget`` or by hand, ``shardflow retract``).

Every Shardflow loader (batch prediction, ``shardflow serve-model``, evaluation's re-scoring
of the champion) resolves an alias to a version number once, then loads that number after
:func:`refuse_retracted` and :func:`check_model_file`: a file copied over the version's, or
truncated, is refused by name instead of being served under the version's number. Only
these loaders check: ``mlflow models serve -m models:/NAME/N`` loads the files as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tasks.runtime.refusals import Refused

MODEL_SHA256_TAG = "shardflow.model_sha256"  # the sha256 of the version's Keras file
RETRACTED_TAG = "shardflow.retracted"  # why it was retracted and when, in words
# The ``at`` of the data/forgotten.json entry whose erasure retracted the version.
RETRACTED_ERASURE_TAG = "shardflow.retracted.erasure"
RETRACTED_BY_TAG = "shardflow.retracted.by"
RETRACTED_AT_TAG = "shardflow.retracted.at"
RETRACTED_REASON_TAG = "shardflow.retracted.reason"
RETRACTED_IMAGES_TAG = "shardflow.retracted.images"  # how many images the erasure forgot
ALLOW_RETRACTED = "--allow-retracted"
CHUNK = 1 << 20


class VersionRetracted(Refused):
    """A retracted version asked to be loaded, promoted or served."""


class ModelFileAltered(Refused):
    """A version's Keras file is not the file registered (replaced or truncated since)."""


@dataclass(frozen=True)
class Retraction:
    """Why a version was retracted: the erasure (its data/forgotten.json entry's ``at``, and
    how many images it forgot) or the person who retracted it by hand, when (UTC, ISO 8601),
    and the reason in words. Never a hash or a file name: erasure treats those as marks."""

    by: str
    at: str
    reason: str
    erasure: str | None = None  # the forgotten.json entry's `at`; None: by hand
    images: int | None = None  # the images that erasure forgot

    def tags(self) -> dict[str, str]:
        """The version tags that record it (:data:`RETRACTED_TAG` first, in words)."""
        tags = {
            RETRACTED_TAG: self.in_words(),
            RETRACTED_BY_TAG: self.by,
            RETRACTED_AT_TAG: self.at,
            RETRACTED_REASON_TAG: self.reason,
        }
        if self.erasure is not None:
            tags[RETRACTED_ERASURE_TAG] = self.erasure
        if self.images is not None:
            tags[RETRACTED_IMAGES_TAG] = str(self.images)
        return tags

    def in_words(self) -> str:
        if self.erasure is not None:
            images = "" if self.images is None else f"; {self.images} images forgotten"
            return (
                f"retracted {self.at} by the erasure of {self.erasure} recorded in "
                f"data/forgotten.json (reason: {self.reason}{images})"
            )
        return f"retracted {self.at} by {self.by}: {self.reason}"


def retraction_words(tags: Mapping[str, str]) -> str | None:
    """Why the version with ``tags`` was retracted, in words; None when it was not."""
    return tags.get(RETRACTED_TAG)


def refuse_retracted(
    model_name: str, version: str, tags: Mapping[str, str], *, allow: bool = False
) -> str | None:
    """Refuse to load a retracted version unless ``allow`` (the user's explicit
    ``--allow-retracted``); the retraction in words (None: not retracted)."""
    words = retraction_words(tags)
    if words is not None and not allow:
        raise VersionRetracted(
            f"{model_name} v{version} is {words}; a retracted version is not loaded",
            fix=f"use another version (the champion), or pass {ALLOW_RETRACTED} to load it "
            "anyway (recorded with the predictions)",
        )
    return words


def file_sha256(path: str | Path) -> str:
    """The sha256 of the file at ``path``, read a chunk at a time."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_model_file(
    path: str | Path, tags: Mapping[str, str], model_name: str, version: str
) -> None:
    """Refuse the Keras file at ``path`` unless its sha256 is the one recorded on the
    version's tags at registration. A version registered before the digest was recorded
    has none to check against, and passes."""
    expected = tags.get(MODEL_SHA256_TAG)
    if expected is None:
        return
    found = file_sha256(path)
    if found != expected:
        raise ModelFileAltered(
            f"the Keras file of {model_name} v{version} ({Path(path).name}, "
            f"{Path(path).stat().st_size} bytes) has sha256 {found[:16]}..., not the "
            f"{expected[:16]}... recorded when v{version} was registered "
            f"({MODEL_SHA256_TAG}): it was replaced or truncated in the artifact store, and is "
            "not used",
            fix=f"restore v{version}'s artifacts from a backup of the store, or retract it "
            f'(shardflow retract --version {version} --reason "model file altered") and '
            "retrain (shardflow run)",
        )
