"""Promotion: whether a registered version takes the ``champion`` alias, on a fair comparison.

Each version carries its figure as tags: the value (``eval.<metric>``), the metric's
definition (``eval.definition.<metric>``: its name and the params it depends on, such as
``top_k``) and the test set it was measured on (``eval.test_fingerprint``). When the
champion's recorded figure was measured the same way on the same test set, it is compared
as recorded. Otherwise the champion is re-scored on the current test set (a ``rescore``
callable the evaluate stage supplies, which loads the champion's model and refuses when the
pixels its serving spec describes are not the current shards'); only when that is impossible
is the comparison "not comparable". Classes are no such obstacle: the champion is scored by
class name (a class added since, or the same classes in another order), and the record says
how its classes differed (:func:`class_differences`). :func:`decide` moves no alias
(:func:`apply_decision` does), so the decision is recorded first.

Moving the alias is guarded on the registry itself, whichever way the evaluation was started
(a DVC stage, a deployment, another clone on the same tracking server): :func:`promote`
reads the champion, compares, records and moves the alias under :func:`promotion_lock`, and
:func:`apply_decision` moves it only while it still points where the comparison found it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.tracking import CHAMPION, champion_version

if TYPE_CHECKING:
    from mlflow import MlflowClient

# The params each metric's figure depends on: a figure measured with other values is another
# metric. The metrics not listed (accuracy, the macro averages) depend on none.
METRIC_PARAMS: dict[str, tuple[str, ...]] = {"top_k_accuracy": ("top_k",)}
# What of the serving spec decides which pixels the model sees: a champion whose spec
# differs in any of these cannot be scored on the current test shards. Its classes can
# differ: it is scored by class name.
SPEC_FIELDS = {
    "record_schema": "image size and encoding",
    "resize": "resize policy",
    "draft_decode": "draft JPEG decoding",
    "preprocessing_version": "preprocessing version",
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


def class_differences(champion: Sequence[str], current: Sequence[str]) -> dict[str, Any] | None:
    """How the champion's classes differ from the current shards' (None: not at all): the
    classes it does not know, those it knows that the current set lacks, whether the classes
    both know come in another order, and all that in words."""
    if list(champion) == list(current):
        return None
    shared = [name for name in champion if name in current]
    differences: dict[str, Any] = {
        "champion_classes": list(champion),
        "current_classes": list(current),
        "unknown_to_champion": [name for name in current if name not in champion],
        "unknown_today": [name for name in champion if name not in current],
        "order_differs": shared != [name for name in current if name in champion],
    }
    return {**differences, "in_words": class_words(differences)}


def class_words(differences: Mapping[str, Any]) -> str:
    """What :func:`class_differences` found, as the record and the card say it."""
    unknown, gone = differences["unknown_to_champion"], differences["unknown_today"]
    words = []
    if unknown:
        words.append(f"it does not know {', '.join(unknown)}: each test record of it is an error")
    if gone:
        words.append(
            f"it knows {', '.join(gone)}, which the current classes lack: each prediction of it "
            "is an error"
        )
    if differences["order_differs"]:
        which = "the shared" if unknown or gone else "the same"
        words.append(f"{which} classes in another order")
    return "; ".join(words)


def _short(value: Any) -> str:
    if isinstance(value, dict):  # the record schema: the fields a reader cares about
        keys = ("height", "width", "channels", "encoding")
        return ", ".join(f"{k}={value[k]}" for k in keys if k in value) or json.dumps(value)
    return str(value)


@dataclass(frozen=True)
class Rescored:
    """The champion's figure re-scored on the current test set, and how its classes
    differed from the current shards' (:func:`class_differences`; None: the same): what a
    ``rescore`` returns, and nothing else (a bare float said nothing of the classes)."""

    value: float
    class_differences: dict[str, Any] | None = None


@dataclass(frozen=True)
class Figure:
    """A version's figure: the value of ``metric``, measured as ``definition`` (the metric
    and the params it depends on) on the test set ``test_fingerprint``."""

    metric: str
    definition: str
    value: float
    test_fingerprint: str


def tag_figure(client: MlflowClient, model_name: str, version: str, figure: Figure) -> None:
    """Record on the version what its figure is and how and where it was measured."""
    tags = {
        f"eval.{figure.metric}": str(figure.value),
        f"eval.definition.{figure.metric}": figure.definition,
        "eval.test_fingerprint": figure.test_fingerprint,
    }
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)


def decide(
    client: MlflowClient,
    model_name: str,
    version: str,
    figure: Figure,
    *,
    margin: float,
    allow_incomparable: bool,
    rescore: Callable[[str], Rescored] | None = None,
) -> dict[str, Any]:
    """Whether ``version`` should take ``champion``: it must beat it by more than ``margin``
    on the same test set, measured the same way.

    The champion's recorded figure is used when it was measured with ``definition`` on
    ``test_fingerprint``; otherwise ``rescore(champion_version)`` scores it on the current
    test set, by class name (raising :class:`NotComparable` when it cannot). Without a fair
    figure the champion is kept unless ``allow_incomparable``. The record says which figure
    was used and how it was obtained, and how the champion's classes differed.
    """
    if not isinstance(figure, Figure):
        raise TypeError(
            f"decide: figure must be a tasks.promotion.Figure (metric, definition, value, "
            f"test set), got {type(figure).__name__} {figure!r}"
        )
    check_margin(margin)
    tag_figure(client, model_name, version, figure)
    metric, definition, value = figure.metric, figure.definition, figure.value
    current = champion_version(client, model_name)
    decision: dict[str, Any] = {
        "metric": metric,
        "definition": definition,
        "test_fingerprint": figure.test_fingerprint,
        "candidate_version": version,
        "candidate_value": value,
        "margin": margin,
        "champion_version": current,
        "champion_value": None,
        "champion_recorded_value": None,
        "champion_value_source": None,
        "champion_value_how": None,
        "class_differences": None,
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
    rescore: Callable[[str], Rescored] | None,
) -> dict[str, Any]:
    """The champion's figure to compare with, and how it was obtained (recorded or
    re-scored, and how its classes differed), or why there is none (``comparable: False``)."""
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
        scored = rescore(champion)
    except NotComparable as exc:
        return {**found, "comparable": False, "champion_value_how": f"{because}; {exc}"}
    if not isinstance(scored, Rescored):
        raise TypeError(
            f"rescore({champion!r}) returned {type(scored).__name__} {scored!r}: it must "
            "return a tasks.promotion.Rescored (the figure and how the classes differed)"
        )
    classes = scored.class_differences
    by_name = f" by class name ({classes['in_words']})" if classes else ""
    how = (
        f"re-scored on the current test set {candidate['test_fingerprint'][:12]} as "
        f"{definition}{by_name}, because {because}"
    )
    rescored = {"champion_value": scored.value, "champion_value_source": RESCORED}
    return {**found, **rescored, "champion_value_how": how, "class_differences": classes}


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


class ChampionMoved(RuntimeError):
    """The alias moved after the comparison was made: the decision no longer holds."""


def apply_decision(client: MlflowClient, model_name: str, decision: Mapping[str, Any]) -> None:
    """Move ``champion`` to the candidate if the decision says so (idempotent), and only
    while it still points at the version the decision compared with (a compare-and-set:
    raises :class:`ChampionMoved` otherwise, leaving the alias where it is)."""
    if not decision["promoted"]:
        return
    candidate = decision["candidate_version"]
    now = champion_version(client, model_name)
    if now not in (decision["champion_version"], candidate):
        raise ChampionMoved(
            f"{CHAMPION} of {model_name!r} moved to v{now} after version {candidate} was "
            f"compared with v{decision['champion_version']}: not promoted; evaluate again "
            "to compare with the new champion"
        )
    client.set_registered_model_alias(model_name, CHAMPION, candidate)


LOCK_SUFFIX = ".promotion-lock"  # the lock is a registered model of this name, while held
TAKEOVER_SUFFIX = ".takeover"  # held while one process deletes a lock a dead process left
LOCK_WAIT_S = 1800.0  # a promotion re-scores at most one champion; waiting longer means trouble


def lock_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _holder_is_gone(holder: str) -> bool:
    """Whether ``host:pid`` names a process on this host that no longer runs (a crash left
    the lock); a holder on another host is never judged from here."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextmanager
def promotion_lock(
    client: MlflowClient, model_name: str, *, wait_s: float = LOCK_WAIT_S, poll_s: float = 0.2
) -> Iterator[None]:
    """Hold the registry's promotion lock of ``model_name`` for the block.

    The lock is the registered model ``<model_name>.promotion-lock``: creating a registered
    model whose name exists fails in every MLflow store (a unique key in SQL, the tracking
    server's error over REST), so whoever creates it holds the lock, whatever process, clone
    or Prefect server it runs under. It is deleted on exit; one left by a crashed process on
    this host is taken over (by one process at a time: :func:`_take_over`), one held
    elsewhere is waited for up to ``wait_s`` seconds.
    """
    from mlflow.exceptions import MlflowException

    name, holder = f"{model_name}{LOCK_SUFFIX}", lock_holder()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            description = f"held by {holder} while it promotes {model_name}"
            client.create_registered_model(name, tags={"holder": holder}, description=description)
            break
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        held_by = _lock_holder_tag(client, name)
        if held_by is not None and _holder_is_gone(held_by):
            _take_over(client, name, held_by)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the promotion lock {name!r} (a registered model) was held by {held_by} for "
                f"over {wait_s:.0f} s; if that process is gone, delete the registered model "
                f"{name!r} and evaluate again"
            )
        time.sleep(poll_s)
    try:
        yield
    finally:
        _delete_lock(client, name)


def _take_over(client: MlflowClient, name: str, dead_holder: str) -> None:
    """Delete the lock ``name`` that ``dead_holder`` left, unless another process has taken it
    over since. Takeovers go one at a time, under a second registered model
    (``<name>.takeover``): two processes that both found the dead holder would otherwise both
    delete, and the second would delete the lock the first had just taken."""
    from mlflow.exceptions import MlflowException

    guard = f"{name}{TAKEOVER_SUFFIX}"
    try:
        client.create_registered_model(guard, tags={"holder": lock_holder()})
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        guard_holder = _lock_holder_tag(client, guard)
        if guard_holder is not None and _holder_is_gone(guard_holder):
            _delete_lock(client, guard)  # a takeover that died halfway (a moment's window)
        return  # another process is taking over: the caller looks again
    try:
        if _lock_holder_tag(client, name) == dead_holder:  # still the dead one's
            _delete_lock(client, name)
    finally:
        _delete_lock(client, guard)


def _lock_holder_tag(client: MlflowClient, name: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name).tags.get("holder")
    except MlflowException:
        return None  # released meanwhile


def _delete_lock(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.delete_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise


def promote(
    client: MlflowClient,
    model_name: str,
    choose: Callable[[], dict[str, Any]],
    record: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Under the promotion lock: ``choose`` a decision (read the champion, compare),
    ``record`` it, then move the alias if it says so. No run moves the alias on a
    comparison another run invalidated."""
    with promotion_lock(client, model_name):
        decision = choose()
        record(decision)
        apply_decision(client, model_name, decision)
    return decision


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
