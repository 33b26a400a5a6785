"""Promotion: whether a registered version takes the ``champion`` alias, on a fair comparison.

Each version carries its figure as tags: the value (``eval.<metric>``), the metric's
definition (``eval.definition.<metric>``: its name and the params it depends on, such as
``top_k``) and the test set it was measured on (``eval.test_fingerprint``). When the
champion's recorded figure was measured the same way on the same test set, it is compared
as recorded. Otherwise the champion is re-scored on the current test set (a ``rescore``
callable the evaluate stage supplies, which loads the champion's model and refuses when its
serving spec does not match the current shards); only when that is impossible is the
comparison "not comparable". :func:`decide` moves no alias (:func:`apply_decision` does),
so the decision is recorded first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.tracking import CHAMPION, champion_version

if TYPE_CHECKING:
    from mlflow import MlflowClient

# The params each metric's figure depends on: a figure measured with other values is another
# metric. The metrics not listed (accuracy, the macro averages) depend on none.
METRIC_PARAMS: dict[str, tuple[str, ...]] = {"top_k_accuracy": ("top_k",)}
# What of the serving spec decides which pixels the model sees: a champion whose spec
# differs in any of these cannot be scored on the current test shards.
SPEC_FIELDS = {
    "record_schema": "image size and encoding",
    "resize": "resize policy",
    "draft_decode": "draft JPEG decoding",
    "preprocessing_version": "preprocessing version",
    "classes": "classes",
}
RECORDED = "recorded"  # the champion's figure as its version tags hold it
RESCORED = "rescored"  # the champion's model scored on the current test set


class NotComparable(Exception):
    """The champion cannot be scored on the current test set; the message says why."""


def check_margin(margin: float) -> None:
    """A negative margin would let a worse model take the alias; refuse it up front."""
    if margin < 0:
        raise ValueError(
            f"evaluate.promotion_margin={margin} is negative: a candidate would replace a "
            f"better {CHAMPION}; set it to 0 or more in params.yaml"
        )


def metric_definition(metric: str, metrics: Mapping[str, Any]) -> str:
    """``metric`` and the params its figure depends on, e.g. ``top_k_accuracy(top_k=3)``.

    ``metrics`` holds the values actually used (``top_k`` after capping at the number of
    classes), so two figures with the same definition were measured the same way.
    """
    params = [f"{name}={metrics[name]}" for name in METRIC_PARAMS.get(metric, ())]
    return f"{metric}({', '.join(params)})" if params else metric


def recorded_definition(tags: Mapping[str, str], metric: str) -> str:
    """A version's recorded definition; versions tagged before definitions were recorded
    have one only for metrics that depend on no param (the definition is the name)."""
    recorded = tags.get(f"eval.definition.{metric}")
    if recorded is not None:
        return recorded
    return metric if metric not in METRIC_PARAMS else f"{metric}(unrecorded params)"


def spec_differences(champion: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What of the champion's serving spec differs from the current shards', in words."""
    return [
        f"{words}: {_short(champion.get(field))} (champion) vs {_short(current.get(field))}"
        for field, words in SPEC_FIELDS.items()
        if champion.get(field) != current.get(field)
    ]


def _short(value: Any) -> str:
    if isinstance(value, dict):  # the record schema: the fields a reader cares about
        keys = ("height", "width", "channels", "encoding")
        return ", ".join(f"{k}={value[k]}" for k in keys if k in value) or json.dumps(value)
    return str(value)


def tag_figure(
    client: MlflowClient,
    model_name: str,
    version: str,
    *,
    metric: str,
    definition: str,
    value: float,
    test_fingerprint: str,
) -> None:
    """Record on the version what its figure is and how and where it was measured."""
    client.set_model_version_tag(model_name, version, f"eval.{metric}", str(value))
    client.set_model_version_tag(model_name, version, f"eval.definition.{metric}", definition)
    client.set_model_version_tag(model_name, version, "eval.test_fingerprint", test_fingerprint)


def decide(
    client: MlflowClient,
    model_name: str,
    version: str,
    *,
    metric: str,
    definition: str,
    value: float,
    test_fingerprint: str,
    margin: float,
    allow_incomparable: bool,
    rescore: Callable[[str], float] | None = None,
) -> dict[str, Any]:
    """Whether ``version`` should take ``champion``: it must beat it by more than ``margin``
    on the same test set, measured the same way.

    The champion's recorded figure is used when it was measured with ``definition`` on
    ``test_fingerprint``; otherwise ``rescore(champion_version)`` scores it on the current
    test set (raising :class:`NotComparable` when it cannot). Without a fair figure the
    champion is kept unless ``allow_incomparable``. The record says which figure was used
    and how it was obtained.
    """
    check_margin(margin)
    tag_figure(
        client,
        model_name,
        version,
        metric=metric,
        definition=definition,
        value=value,
        test_fingerprint=test_fingerprint,
    )
    current = champion_version(client, model_name)
    decision: dict[str, Any] = {
        "metric": metric,
        "definition": definition,
        "test_fingerprint": test_fingerprint,
        "candidate_version": version,
        "candidate_value": value,
        "margin": margin,
        "champion_version": current,
        "champion_value": None,
        "champion_recorded_value": None,
        "champion_value_source": None,
        "champion_value_how": None,
        "comparable": True,
        "allow_incomparable": allow_incomparable,
    }
    if current is None:
        reason = f"no {CHAMPION} yet: version {version} becomes it"
        return {**decision, "promoted": True, "decision": "promoted", "reason": reason}
    if current == version:
        reason = f"version {version} already is {CHAMPION}"
        how = "the candidate itself"
        same = {"champion_value": value, "champion_value_source": RECORDED}
        return {
            **decision,
            **same,
            "champion_value_how": how,
            "promoted": True,
            "decision": "promoted",
            "reason": reason,
        }
    decision.update(champion_figure(client, model_name, current, decision, rescore))
    return {**decision, **outcome(decision, allow_incomparable)}


def champion_figure(
    client: MlflowClient,
    model_name: str,
    champion: str,
    candidate: Mapping[str, Any],
    rescore: Callable[[str], float] | None,
) -> dict[str, Any]:
    """The champion's figure to compare with, and how it was obtained (recorded or
    re-scored), or why there is none (``comparable: False``)."""
    tags = client.get_model_version(model_name, champion).tags
    metric, definition = candidate["metric"], candidate["definition"]
    recorded = float(tags.get(f"eval.{metric}", "nan"))
    recorded_set = tags.get("eval.test_fingerprint", "unknown")
    recorded_as = recorded_definition(tags, metric)
    found = {"champion_recorded_value": None if math.isnan(recorded) else recorded}
    differs = []
    if math.isnan(recorded):
        differs.append(f"it has no recorded {metric}")
    if recorded_set != candidate["test_fingerprint"]:
        differs.append(
            f"it was evaluated on test set {recorded_set[:12]}, the candidate on "
            f"{candidate['test_fingerprint'][:12]}"
        )
    if recorded_as != definition:
        differs.append(f"its figure is {recorded_as}, the candidate's {definition}")
    if not differs:
        how = f"recorded {definition} on the same test set {recorded_set[:12]}"
        return {
            **found,
            "champion_value": recorded,
            "champion_value_source": RECORDED,
            "champion_value_how": how,
        }
    because = "; ".join(differs)
    if rescore is None:
        return {**found, "comparable": False, "champion_value_how": because}
    try:
        value = rescore(champion)
    except NotComparable as exc:
        return {**found, "comparable": False, "champion_value_how": f"{because}; {exc}"}
    how = (
        f"re-scored on the current test set {candidate['test_fingerprint'][:12]} as "
        f"{definition}, because {because}"
    )
    rescored = {"champion_value": value, "champion_value_source": RESCORED}
    return {**found, **rescored, "champion_value_how": how}


def outcome(decision: Mapping[str, Any], allow_incomparable: bool) -> dict[str, Any]:
    """Promoted or kept, and the reason in words, from the two figures."""
    metric, value, margin = decision["metric"], decision["candidate_value"], decision["margin"]
    current, champion_value = decision["champion_version"], decision["champion_value"]
    if not decision["comparable"]:
        reason = f"NOT COMPARABLE with {CHAMPION} v{current}: {decision['champion_value_how']}"
        if allow_incomparable:
            reason += "; evaluate.allow_incomparable_promotion is true: promoted anyway"
            return {"promoted": True, "decision": "promoted", "reason": reason}
        decision_text = "not comparable: champion kept"
        reason = (
            f"{decision_text} ({reason}); set evaluate.allow_incomparable_promotion to "
            "promote anyway"
        )
        return {"promoted": False, "decision": decision_text, "reason": reason}
    beats = value > champion_value + margin
    reason = (
        f"{metric} {value:.4f} {'beats' if beats else 'does not beat'} {CHAMPION} v{current} "
        f"({champion_value:.4f}, {decision['champion_value_how']}) by more than margin {margin}"
    )
    return {"promoted": beats, "decision": "promoted" if beats else "kept", "reason": reason}


def apply_decision(client: MlflowClient, model_name: str, decision: Mapping[str, Any]) -> None:
    """Move ``champion`` to the candidate if the decision says so (idempotent)."""
    if decision["promoted"]:
        client.set_registered_model_alias(model_name, CHAMPION, decision["candidate_version"])


def pending_decision(
    summary_path: Path,
    *,
    run_id: str,
    version: str,
    metric: str,
    definition: str,
    champion: str | None,
) -> dict[str, Any] | None:
    """A promotion recorded for this run and version whose alias move may not have happened.

    Evaluation writes its decision (to ``reports/eval_summary.json``) before moving the
    alias; after a crash in between, the rerun completes that move rather than deciding
    again. A decision is pending only while the alias is still where it was when the
    decision was made (or already on ``version``).
    """
    if not summary_path.exists():
        return None
    recorded = json.loads(summary_path.read_text())
    decision = recorded.get("promotion") or {}
    same = (
        recorded.get("run_id") == run_id
        and recorded.get("model_version") == version
        and decision.get("metric") == metric
        and decision.get("definition", metric) == definition
    )
    if not same or decision.get("promoted") is not True:
        return None
    if champion not in (decision.get("champion_version"), version):
        return None  # the alias moved elsewhere since: decide afresh
    return dict(decision)
