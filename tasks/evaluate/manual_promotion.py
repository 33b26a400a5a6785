"""The one recorded way to move the ``champion`` alias by hand (``shardflow promote``).

Evaluation moves the alias only on evidence, and never for a DVC experiment's version (it
becomes the ``challenger``). When a team decides otherwise, this moves it to a version they
name, under the registry's promotion lock, and records who, when and why on the version's
tags (``promotion.manual.*``). A version that is not of the champion's task (fewer of its
classes than ``evaluate.min_shared_class_share``) is refused, as evaluation would never compare
it, and so is one the registered model does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from tasks.evaluate.promotion import recorded_classes, shared_class_share
from tasks.evaluate.promotion_lock import promotion_lock
from tasks.runtime.refusals import Refused
from tasks.runtime.tracking import CHAMPION, champion_version

if TYPE_CHECKING:
    from mlflow import MlflowClient


class PromotionRefused(Refused):
    """A manual promotion refused: no reason, no such version, or a version of another task."""


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
) -> ManualPromotion:
    """Move ``champion`` of ``model_name`` to ``version`` and record who, when and why."""
    if not reason.strip():
        raise PromotionRefused(
            f"promoting {model_name} v{version} by hand needs a reason: it is recorded",
            fix=f'shardflow promote --version {version} --reason "why this version"',
        )
    with promotion_lock(client, model_name):
        tags = version_tags(client, model_name, version)
        previous = champion_version(client, model_name)
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
