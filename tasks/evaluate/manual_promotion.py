"""The one recorded way to move the ``champion`` alias by hand (``shardflow promote``).

Evaluation moves the alias only on evidence, and never for a DVC experiment's version (it
becomes the ``challenger``). When a team decides otherwise, this moves it to a version they
name, under the registry's promotion lock, and records who, when and why on the version's
tags (``promotion.manual.*``). A version of another task is refused, as evaluation would never
compare it, whether or not there is a champion: it must have ``evaluate.min_shared_class_share``
of the current dataset's classes (and of the champion's), and the current shards' image size,
encoding, resize policy and preprocessing (its serving spec). So is a retracted version (named
with the erasure, or the person, that retracted it) and one the registered model does not hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tasks.contracts.model_versions import retraction_words
from tasks.evaluate.promotion import (
    recorded_classes,
    shared_class_share,
    spec_differences,
)
from tasks.evaluate.promotion_lock import promotion_lock
from tasks.runtime.refusals import Refused
from tasks.runtime.tracking import CHAMPION, champion_version

if TYPE_CHECKING:
    from mlflow import MlflowClient


class PromotionRefused(Refused):
    """A manual promotion refused: no reason, no such version, or a version of another task."""


@dataclass(frozen=True)
class Task:
    """What a version must be trained for to take the alias: the current dataset's classes
    and the serving spec of its shards (``ServingSpec.to_dict()`` of the manifest)."""

    classes: tuple[str, ...]
    spec: Mapping[str, Any] = field(default_factory=dict)
    where: str = "the current shards"  # how the refusal names it


@dataclass(frozen=True)
class ManualPromotion:
    """What ``shardflow promote`` did: the version now champion, the one before, by whom,
    when (UTC, ISO 8601) and why."""

    model_name: str
    version: str
    previous: str | None
    by: str
    at: str
    reason: str


def promote_by_hand(
    client: MlflowClient,
    model_name: str,
    version: str,
    *,
    reason: str,
    by: str,
    min_shared_class_share: float,
    task: Task | None,
    version_spec: Mapping[str, Any] | None = None,
) -> ManualPromotion:
    """Move ``champion`` of ``model_name`` to ``version`` and record who, when and why.

    ``task`` is the current dataset's (None: no shards built yet), ``version_spec`` the
    version's serving spec (its ``MLmodel`` metadata; None: unreadable): with neither a task
    nor a champion there is nothing to check the version against, and it is refused."""
    if not reason.strip():
        raise PromotionRefused(
            f"promoting {model_name} v{version} by hand needs a reason: it is recorded",
            fix=f'shardflow promote --version {version} --reason "why this version"',
        )
    with promotion_lock(client, model_name):
        tags = version_tags(client, model_name, version)
        refuse_retracted_promotion(model_name, version, tags)
        previous = champion_version(client, model_name)
        if task is None and previous is None:
            raise PromotionRefused(
                f"{model_name} has no {CHAMPION} and no shards are built: nothing to check "
                f"v{version}'s task (classes, image size, preprocessing) against",
                fix="shardflow run   (builds the shards, trains, evaluates and promotes)",
            )
        if task is not None:
            check_task(model_name, version, tags, version_spec, task, min_shared_class_share)
        if previous is not None and previous != version:
            check_same_task(client, model_name, version, tags, previous, min_shared_class_share)
        done = ManualPromotion(
            model_name,
            version,
            previous,
            by,
            datetime.now(UTC).isoformat(timespec="seconds"),
            reason,
        )
        record = {
            "promotion.manual.by": done.by,
            "promotion.manual.at": done.at,
            "promotion.manual.reason": done.reason,
            "promotion.manual.previous_champion": str(previous),
            "promotion.decision": "promoted by hand",
        }
        for key, value in record.items():
            client.set_model_version_tag(model_name, version, key, value)
        client.set_registered_model_alias(model_name, CHAMPION, version)
    return done


def version_tags(client: MlflowClient, model_name: str, version: str) -> dict[str, str]:
    """The tags of ``model_name`` ``version``; refused by name when there is no such version."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(client.get_model_version(model_name, version).tags)
    except MlflowException:
        pass
    versions = sorted(
        (int(v.version) for v in client.search_model_versions(f"name = '{model_name}'")),
        reverse=True,
    )
    known = ", ".join(map(str, versions[:10])) or "none yet"
    raise PromotionRefused(
        f"the registered model {model_name} (the current dataset's: evaluate.model_name, else "
        f"named after ingest.source_dir) has no version {version}; its versions: {known}",
        fix="shardflow promote --version N --reason R, with N one of those versions",
    )


def refuse_retracted_promotion(model_name: str, version: str, tags: Mapping[str, str]) -> None:
    """A retracted version never takes the alias again: refused, naming its retraction."""
    words = retraction_words(tags)
    if words is not None:
        raise PromotionRefused(
            f"{model_name} v{version} is {words}; a retracted version is never promoted",
            fix="promote a version trained without the retracted data, or retrain: shardflow run",
        )


def check_task(
    model_name: str,
    version: str,
    tags: Mapping[str, str],
    spec: Mapping[str, Any] | None,
    task: Task,
    min_share: float,
) -> None:
    """Refuse ``version`` unless it has ``min_share`` of ``task``'s classes and the serving
    spec (image size, encoding, resize, preprocessing) of its shards."""
    classes = recorded_classes(tags) or tuple((spec or {}).get("classes", ()))
    if spec is None or not classes:
        raise PromotionRefused(
            f"{model_name} v{version} records no serving spec or classes (its MLmodel "
            f"metadata): nothing to check it is of the task of {task.where}",
            fix="evaluate it again (dvc repro evaluate) so its version records them, or "
            "promote another version",
        )
    share = shared_class_share(task.classes, classes)
    differs = spec_differences(spec, task.spec)
    if share < min_share or differs:
        why = [f"it has {share:.0%} of the classes of {task.where} ({', '.join(task.classes)})"]
        raise PromotionRefused(
            f"{model_name} v{version} is of another task: "
            + "; ".join([*why, *(d.replace("(champion)", f"(v{version})") for d in differs)])
            + f" (evaluate.min_shared_class_share={min_share})",
            fix="evaluate it under the registered model of its own dataset "
            "(evaluate.model_name: null names one after ingest.source_dir)",
        )


def check_same_task(
    client: MlflowClient,
    model_name: str,
    version: str,
    tags: dict[str, str],
    champion: str,
    min_share: float,
) -> None:
    """Refuse ``version`` when it has fewer of the champion's classes than ``min_share``."""
    theirs = recorded_classes(client.get_model_version(model_name, champion).tags)
    ours = recorded_classes(tags)
    if not theirs or not ours:
        return  # versions tagged before their classes were: nothing to tell them apart by
    share = shared_class_share(theirs, ours)
    if share < min_share:
        raise PromotionRefused(
            f"{model_name} v{version} is of another task: it has {share:.0%} of {CHAMPION} "
            f"v{champion}'s classes ({', '.join(theirs)}), below "
            f"evaluate.min_shared_class_share={min_share}",
            fix="evaluate it under the registered model of its own dataset "
            "(evaluate.model_name: null names one after ingest.source_dir)",
        )
