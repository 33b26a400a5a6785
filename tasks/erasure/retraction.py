"""What ``shardflow forget`` does in the tracking store: the versions trained, validated or
tested on a forgotten image lose every alias and are retracted (or deleted), and the tags,
descriptions and artifacts that name or show it go (by identity:
:mod:`tasks.erasure.identity`). Each step is idempotent.

A retraction (:class:`tasks.contracts.model_versions.Retraction`, by an erasure or by hand:
``shardflow retract``) is a state of the version: it holds no alias (``champion``,
``challenger`` or any other), its tags and description say who or which erasure retracted it
(an erasure by its ``data/forgotten.json`` entry: date, reason, image count; never by hash or
file name), and Shardflow's loaders and ``shardflow promote`` refuse it.
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.contracts.model_versions import Retraction, retraction_words
from tasks.erasure.identity import Forgotten, holds
from tasks.erasure.lineage import TrackedRuns
from tasks.evaluate.model_card import RETRACTION_HEADING, retraction_paragraph
from tasks.evaluate.promotion_lock import promotion_lock
from tasks.evaluate.tracking import EVALUATES_TAG
from tasks.runtime.refusals import Refused

if TYPE_CHECKING:
    from mlflow import MlflowClient

REDACTED = "[forgotten]"
# Artifacts of an evaluation of a set that held a forgotten image that may show its pixels
# (the misclassified and label-review sheets): no byte search finds pixels in a PNG.
PICTURES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".svg")


def runs_that_held(runs: TrackedRuns, fingerprints: Iterable[str]) -> tuple[set[str], set[str]]:
    """(the training and evaluation runs on the sets, the versions registered from them)."""
    held, versions = set(), set()
    for fingerprint in fingerprints:
        for run_id, _ in runs.training.get(fingerprint, []):
            held.add(run_id)
            held.update(e_id for e_id, _ in runs.evaluations.get(run_id, []))
            versions.update(runs.versions.get(run_id, []))
    return held, versions


def retract_versions(
    client: MlflowClient,
    model_name: str,
    versions: Iterable[str],
    retraction: Retraction,
    *,
    delete: bool,
) -> list[str]:
    """Take every alias from ``versions`` at once, then retract each (tags and description,
    :func:`record_retraction`) or delete it; the versions acted on."""
    from mlflow.exceptions import MlflowException

    versions = sorted(set(versions), key=int)
    for version in versions:
        remove_aliases(client, model_name, version)
    done = []
    for version in versions:
        try:
            if delete:
                client.delete_model_version(model_name, version)
            else:
                record_retraction(client, model_name, version, retraction)
            done.append(version)
        except MlflowException:  # deleted already (a rerun after a kill)
            continue
    return done


def remove_aliases(client: MlflowClient, model_name: str, version: str) -> list[str]:
    """Delete every alias that names ``version`` (champion, challenger, any other); them."""
    from mlflow.exceptions import MlflowException

    try:
        aliases = list(client.get_model_version(model_name, version).aliases)
    except MlflowException:  # deleted already
        return []
    for alias in aliases:
        client.delete_registered_model_alias(model_name, alias)
    return aliases


def record_retraction(
    client: MlflowClient,
    model_name: str,
    version: str,
    retraction: Retraction,
) -> None:
    """The retraction on the version's tags, and at the head of its description (the model
    card the registry shows) once."""
    for key, value in retraction.tags().items():
        client.set_model_version_tag(model_name, version, key, value)
    description = client.get_model_version(model_name, version).description or ""
    if not description.startswith(RETRACTION_HEADING):
        paragraph = retraction_paragraph(retraction)
        client.update_model_version(model_name, version, f"{paragraph}\n\n{description}".strip())


class RetractionRefused(Refused):
    """A retraction by hand refused: no reason, or no such version."""


def retract_by_hand(
    client: MlflowClient, model_name: str, version: str, *, reason: str, by: str, at: str
) -> list[str]:
    """Retract ``version`` of ``model_name`` (``shardflow retract``): recorded like a manual
    promotion (who, when, why), under the promotion lock; the aliases it lost."""
    from mlflow.exceptions import MlflowException

    if not reason.strip():
        raise RetractionRefused(
            f"retracting {model_name} v{version} needs a reason: it is recorded",
            fix=f'shardflow retract --version {version} --reason "why"',
        )
    with promotion_lock(client, model_name):
        try:
            tags = client.get_model_version(model_name, version).tags
        except MlflowException:
            raise RetractionRefused(
                f"the registered model {model_name} has no version {version}",
                fix="shardflow retract --version N --reason R, with N a registered version",
            ) from None
        removed = remove_aliases(client, model_name, version)
        if retraction_words(tags) is None:  # retracted once: the first record stays
            record_retraction(client, model_name, version, Retraction(by, at, reason))
    return removed


def scrub_tracking(
    client: MlflowClient, forgotten: Forgotten, held: set[str], model_name: str
) -> list[str]:
    """Redact the forgotten hashes and paths (whole, never a part of another name) from
    every run's tags and every version's description. Artifacts go only from the ``held``
    runs (those that trained, validated or tested on a forgotten record, by membership):
    each that holds a forgotten image by identity, and an evaluation's pictures. What was
    changed, as ``run/path`` or ``model/version`` (no image named in it)."""
    from mlflow.entities import ViewType

    changed = []
    for experiment in client.search_experiments(view_type=ViewType.ALL):
        runs = client.search_runs(
            [experiment.experiment_id], run_view_type=ViewType.ALL, max_results=50000
        )
        for run in runs:
            run_id = run.info.run_id
            for key, value in run.data.tags.items():
                if forgotten.named_in(value):
                    client.set_tag(run_id, key, forgotten.redact(value, REDACTED))
                    changed.append(f"{run_id}: tag {key}")
            if run_id in held:  # the sheets that show images are an evaluation's
                pictures = EVALUATES_TAG in run.data.tags
                changed += _scrub_artifacts(client, run, forgotten, pictures=pictures)
    for version in client.search_model_versions(f"name = '{model_name}'"):
        description = version.description or ""
        if forgotten.named_in(description):
            redacted = forgotten.redact(description, REDACTED)
            client.update_model_version(model_name, version.version, redacted)
            changed.append(f"{model_name}/{version.version}: description")
    return changed


def _scrub_artifacts(
    client: MlflowClient, run: Any, forgotten: Forgotten, *, pictures: bool
) -> list[str]:
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repository = get_artifact_repository(run.info.artifact_uri)
    removed = []
    with tempfile.TemporaryDirectory() as scratch:
        for path in _artifact_files(client, run.info.run_id):
            local = Path(client.download_artifacts(run.info.run_id, path, scratch))
            if (pictures and path.lower().endswith(PICTURES)) or holds(
                local.name, local.read_bytes(), forgotten
            ):
                repository.delete_artifacts(path)
                removed.append(f"{run.info.run_id}: artifact {path}")
    return removed


def _artifact_files(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    files = []
    for info in client.list_artifacts(run_id, path):
        files += _artifact_files(client, run_id, info.path) if info.is_dir else [info.path]
    return files


def compact_sqlite(uri: str) -> bool:
    """VACUUM a SQLite tracking store, so the pages freed keep nothing; False for a server."""
    if not uri.startswith("sqlite:///"):
        return False
    connection = sqlite3.connect(uri.removeprefix("sqlite:///"))
    try:
        connection.execute("VACUUM")
    finally:
        connection.close()
    return True
