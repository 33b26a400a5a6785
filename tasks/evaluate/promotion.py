"""Promotion: whether a registered version takes the ``champion`` alias, on evidence.

Each version carries its figure as tags: the value (``eval.<metric>``), the metric's
definition (``eval.definition.<metric>``: its name and the params it depends on, such as
``top_k``), the test set it was measured on (``eval.test_fingerprint``) and its classes
(``eval.classes``). A challenger is compared with the champion only when it is of the same
task: it has at least ``evaluate.min_shared_class_share`` of the champion's classes (a class
added since is the same task; a dataset of other classes is not, and is never compared,
whatever ``allow_incomparable_promotion`` says). The champion is then re-scored on the current
test records (a ``rescore`` callable the evaluate stage supplies, which loads the champion's
model and scores it by class name, :func:`class_differences`), so both models' answers on the
same records are at hand. Only the records neither model trained or validated on count
(:mod:`tasks.evaluate.seen_records`; fewer than ``evaluate.min_unseen_records``, or a champion
that logged no such hashes, is "not comparable"): the challenger takes the alias only when its
figure on them beats the
champion's by more than the margin *and* a one-sided paired test (:mod:`tasks.evaluate.evidence`)
gives
p below ``evaluate.promotion_alpha``; a smaller advantage is "inconclusive: champion kept".
When the champion cannot be scored on these records the comparison is "not comparable".
:func:`decide` moves no alias (:func:`apply_decision` does), so the decision is recorded
first. A version registered under ``dvc exp run``
(:func:`tasks.contracts.run_records.dvc_experiment`)
gets the decision it would have had and the ``challenger`` alias, never ``champion``.

Moving the alias is guarded on the registry itself, whichever way the evaluation was started
(a DVC stage, a deployment, another clone on the same tracking server): :func:`promote`
reads the champion, compares, records and moves the alias under :func:`promotion_lock`, and
:func:`apply_decision` moves it only while it still points where the comparison found it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.evaluate.evidence import Answers, Evidence, paired_evidence
from tasks.evaluate.promotion_lock import promotion_lock
from tasks.evaluate.seen_records import SEEN_ARTIFACT, SeenRecords, UnseenTest, unseen_test
from tasks.runtime.tracking import CHALLENGER, CHAMPION, champion_version

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
CLASSES_TAG = "eval.classes"  # a version's classes, as a JSON list
RECORDED = "recorded"  # the champion's figure as its version tags hold it
RESCORED = "rescored"  # the champion's model scored on the current test set
INCONCLUSIVE = "inconclusive: champion kept"
NOT_COMPARABLE = "not comparable: champion kept"


class NotComparable(Exception):
    """The champion cannot be scored on the current test set; the message says why."""


class NoSeenRecords(NotComparable):
    """The champion logged no hashes of its training and validation records: no current
    test record can be shown unseen by it, so not even its recorded figure stands."""


def no_seen_records(champion: str) -> NoSeenRecords:
    """Why a champion without its seen records is not comparable, and what to do."""
    return NoSeenRecords(
        f"{CHAMPION} v{champion} logged no hashes of the records it trained and validated on "
        f"({SEEN_ARTIFACT} on its training run), so no current test record can be shown to be "
        "unseen by it; check it by hand and move the alias with `shardflow promote --version "
        "V --reason R`, or set evaluate.allow_incomparable_promotion: true for one run"
    )


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
    answers: Answers | None = None  # its answers on each current test record, for evidence
    classes: tuple[str, ...] = ()  # its own classes (from its serving spec)
    # where the answers came from when the model was not run again: the answers its own
    # evaluation recorded on the same test set, measured the same way
    recorded: str | None = None
    seen: SeenRecords | None = None  # the records it trained and validated on


@dataclass(frozen=True)
class Figure:
    """A version's figure: the value of ``metric``, measured as ``definition`` (the metric
    and the params it depends on) on the test set ``test_fingerprint``; the version's
    ``classes`` and its ``answers`` on each test record (what a paired test compares)."""

    metric: str
    definition: str
    value: float
    test_fingerprint: str
    classes: tuple[str, ...] = ()
    answers: Answers | None = None
    # each test record's content hash, in the answers' order, and the records the version
    # trained and validated on: what leaves out the test records either model saw
    test_hashes: tuple[str, ...] | None = None
    seen: SeenRecords | None = None


@dataclass(frozen=True)
class Rules:
    """What a challenger must show (``evaluate.*`` in params.yaml)."""

    margin: float
    alpha: float
    min_shared_class_share: float
    allow_incomparable: bool
    # fewer test records seen by neither model: the two are not comparable
    min_unseen_records: int


def tag_figure(client: MlflowClient, model_name: str, version: str, figure: Figure) -> None:
    """Record on the version what its figure is and how and where it was measured."""
    tags = {
        f"eval.{figure.metric}": str(figure.value),
        f"eval.definition.{figure.metric}": figure.definition,
        "eval.test_fingerprint": figure.test_fingerprint,
    }
    if figure.classes:
        tags[CLASSES_TAG] = json.dumps(list(figure.classes))
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)


@dataclass(frozen=True)
class Verdict:
    """Promoted, kept or inconclusive (``decision``, in the record's words) and why."""

    promoted: bool
    decision: str
    reason: str


@dataclass(frozen=True)
class TaskShare:
    """Whether the candidate is of the champion's task (:func:`task_share`): the share of
    the champion's classes it has (None: either side's classes unknown) and, when it is of
    another task, that in words."""

    share: float | None
    same_task: bool
    words: str | None


@dataclass(frozen=True)
class PromotionDecision:
    """A promotion decision: what was compared, by which rules, with which champion, the
    champion's figure and how it was obtained, the evidence, and the verdict.

    :meth:`to_json` gives the record ``reports/eval_summary.json`` holds (its ``promotion``)
    and :meth:`from_json` reads it back; a field that is None there is the JSON ``null``.
    """

    metric: str
    definition: str
    test_fingerprint: str
    test_records: int | None  # the test records with answers (None: none recorded)
    candidate_version: str
    candidate_value: float
    margin: float
    alpha: float
    min_shared_class_share: float
    min_unseen_records: int
    allow_incomparable: bool
    champion_version: str | None
    experiment: str | None = None  # the DVC experiment the version was made under
    champion_value: float | None = None
    champion_recorded_value: float | None = None
    champion_value_source: str | None = None  # RECORDED or RESCORED
    champion_value_how: str | None = None
    class_differences: dict[str, Any] | None = None  # :func:`class_differences`, as JSON
    shared_class_share: float | None = None
    evidence: Evidence | None = None
    unseen: dict[str, Any] | None = None  # :meth:`UnseenTest.to_dict`, as JSON
    comparable: bool = True
    same_task: bool = True
    task_words: str | None = None  # another task, in words (recorded once compared)
    # the figures on all test records, when those either model saw were left out
    candidate_full_value: float | None = None
    champion_full_value: float | None = None
    promoted: bool = False
    decision: str | None = None
    reason: str | None = None
    would_have_promoted: bool | None = None  # under an experiment: the main line's verdict
    model_name: str | None = None  # the registered model (the evaluate stage names it)

    @property
    def compared(self) -> bool:
        """Whether there was a champion other than the candidate to compare with."""
        return self.champion_version not in (None, self.candidate_version)

    def with_verdict(self, verdict: Verdict) -> PromotionDecision:
        return replace(
            self, promoted=verdict.promoted, decision=verdict.decision, reason=verdict.reason
        )

    def to_json(self) -> dict[str, Any]:
        """The record as JSON holds it: a key whose step did not happen is left out (the
        task's words before a comparison, the full-set figures when none were left out, the
        main line's verdict outside an experiment, the model's name before the stage's)."""
        record = {field.name: getattr(self, field.name) for field in fields(self)}
        record["evidence"] = None if self.evidence is None else self.evidence.to_dict()
        optional = ("candidate_full_value", "champion_full_value", "model_name")
        absent = [key for key in optional if record[key] is None]
        absent += [] if self.compared else ["task_words"]
        absent += [] if self.experiment else ["would_have_promoted"]
        return {key: value for key, value in record.items() if key not in absent}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> PromotionDecision:
        """A record :meth:`to_json` wrote (keys it left out take their defaults)."""
        known = {field.name for field in fields(cls)}
        values = {key: value for key, value in record.items() if key in known}
        evidence = values.get("evidence")
        values["evidence"] = None if evidence is None else Evidence(**evidence)
        return cls(**values)


def decide(
    client: MlflowClient,
    model_name: str,
    version: str,
    figure: Figure,
    *,
    rules: Rules,
    rescore: Callable[[str], Rescored] | None = None,
    experiment: str | None = None,
) -> PromotionDecision:
    """Whether ``version`` should take ``champion``: of the champion's task, it must beat it
    by more than ``rules.margin`` on the same test records, measured the same way, and a
    one-sided paired test must give p below ``rules.alpha``.

    ``rescore(champion_version)`` scores the champion on the current test records, by class
    name (raising :class:`NotComparable` when it cannot); without it, or when it cannot,
    the champion's recorded figure is the only one, and without paired answers no advantage
    is evidence. The record says which figure was used, how it was obtained, how the
    champion's classes differed and the evidence. Under a DVC ``experiment`` the decision
    is the one the main line would have had, and the version becomes the ``challenger``.
    """
    if not isinstance(figure, Figure):
        raise TypeError(
            f"decide: figure must be a tasks.evaluate.promotion.Figure (metric, definition, value, "
            f"test set), got {type(figure).__name__} {figure!r}"
        )
    check_margin(rules.margin)
    tag_figure(client, model_name, version, figure)
    current = champion_version(client, model_name)
    blank = blank_record(version, figure, rules, current, experiment)
    if current is None:
        reason = f"no {CHAMPION} yet: version {version} becomes it"
        decision = blank.with_verdict(Verdict(True, "promoted", reason))
    elif current == version:
        decision = replace(
            blank,
            champion_value=figure.value,
            champion_value_source=RECORDED,
            champion_value_how="the candidate itself",
        ).with_verdict(Verdict(True, "promoted", f"version {version} already is {CHAMPION}"))
    else:
        compared = champion_figure(client, model_name, current, figure, rules, rescore, blank)
        decision = compared.with_verdict(outcome(compared, rules))
    return as_experiment(decision, experiment) if experiment else decision


def blank_record(
    version: str, figure: Figure, rules: Rules, current: str | None, experiment: str | None
) -> PromotionDecision:
    """The decision record before the comparison fills it in: what is compared, by which
    rules, with which champion."""
    return PromotionDecision(
        metric=figure.metric,
        definition=figure.definition,
        test_fingerprint=figure.test_fingerprint,
        test_records=None if figure.answers is None else len(figure.answers.labels),
        candidate_version=version,
        candidate_value=figure.value,
        margin=rules.margin,
        alpha=rules.alpha,
        min_shared_class_share=rules.min_shared_class_share,
        min_unseen_records=rules.min_unseen_records,
        allow_incomparable=rules.allow_incomparable,
        champion_version=current,
        experiment=experiment,
    )


def as_experiment(decision: PromotionDecision, experiment: str) -> PromotionDecision:
    """The decision of a version made by ``dvc exp run``: never promoted; it becomes the
    ``challenger`` and the record keeps what the main line would have decided."""
    would = "promoted" if decision.promoted else decision.decision
    reason = (
        f"DVC experiment {experiment!r}: the version becomes {CHALLENGER}, never {CHAMPION} "
        f"(on the main line: {would}: {decision.reason}); `shardflow promote --version "
        f"{decision.candidate_version} --reason R` moves {CHAMPION} to it by hand"
    )
    verdict = Verdict(False, f"{CHALLENGER} (experiment; main line: {would})", reason)
    return replace(decision, would_have_promoted=decision.promoted).with_verdict(verdict)


def shared_class_share(champion: Sequence[str], candidate: Sequence[str]) -> float:
    """The share of the champion's classes the candidate also has (1.0 when the champion
    names none: nothing to tell the tasks apart by)."""
    if not champion:
        return 1.0
    return sum(name in set(candidate) for name in champion) / len(champion)


def recorded_classes(tags: Mapping[str, str]) -> tuple[str, ...]:
    """A version's classes as tagged (none for versions tagged before classes were)."""
    raw = tags.get(CLASSES_TAG)
    return tuple(json.loads(raw)) if raw else ()


def with_task(decision: PromotionDecision, share: TaskShare) -> PromotionDecision:
    """``decision`` with the task share found (a share not found leaves the one it has)."""
    found = decision.shared_class_share if share.share is None else share.share
    return replace(
        decision, shared_class_share=found, same_task=share.same_task, task_words=share.words
    )


def not_comparable(decision: PromotionDecision, how: str | None) -> PromotionDecision:
    """``decision`` with no champion figure to compare with, and why."""
    return replace(decision, comparable=False, champion_value_how=how)


def champion_figure(
    client: MlflowClient,
    model_name: str,
    champion: str,
    figure: Figure,
    rules: Rules,
    rescore: Callable[[str], Rescored] | None,
    blank: PromotionDecision,
) -> PromotionDecision:
    """``blank`` with the champion's figure to compare with, how it was obtained (re-scored
    on the current test records, else recorded), how its classes differed, the share of them
    the candidate has, and the paired evidence; or why there is no figure (``comparable``
    False)."""
    tags = client.get_model_version(model_name, champion).tags
    metric, definition = figure.metric, figure.definition
    recorded = float(tags.get(f"eval.{metric}", "nan"))
    found = replace(blank, champion_recorded_value=None if math.isnan(recorded) else recorded)
    found = with_task(found, task_share(recorded_classes(tags), figure, rules))
    if not found.same_task:
        return not_comparable(found, found.task_words)
    differs = recorded_differences(tags, figure, recorded)
    failed = None
    if rescore is not None:
        try:
            scored = rescore(champion)
        except NoSeenRecords as exc:
            return not_comparable(found, str(exc))
        except NotComparable as exc:
            failed = str(exc)
        else:
            if not recorded_classes(tags) and isinstance(scored, Rescored):
                found = with_task(found, task_share(scored.classes, figure, rules))  # untagged
            if not found.same_task:
                return not_comparable(found, found.task_words)
            return rescored_figure(champion, scored, figure, rules, differs, found)
    if differs:
        because = "; ".join(differs) + (f"; {failed}" if failed else "")
        return not_comparable(found, because)
    how = f"recorded {definition} on the same test set {figure.test_fingerprint[:12]}"
    if failed:
        how += f" (not re-scored: {failed})"
    return replace(
        found, champion_value=recorded, champion_value_source=RECORDED, champion_value_how=how
    )


def recorded_differences(tags: Mapping[str, str], figure: Figure, recorded: float) -> list[str]:
    """Why the champion's recorded figure cannot stand beside the candidate's, in words."""
    recorded_set = tags.get("eval.test_fingerprint", "unknown")
    recorded_as = recorded_definition(tags, figure.metric)
    differs = []
    if math.isnan(recorded):
        differs.append(f"it has no recorded {figure.metric}")
    if recorded_set != figure.test_fingerprint:
        differs.append(
            f"it was evaluated on test set {recorded_set[:12]}, the candidate on "
            f"{figure.test_fingerprint[:12]}"
        )
    if recorded_as != figure.definition:
        differs.append(f"its figure is {recorded_as}, the candidate's {figure.definition}")
    return differs


def task_share(champion: Sequence[str], figure: Figure, rules: Rules) -> TaskShare:
    """Whether the candidate is of the champion's task: the share of the champion's classes
    it has, against ``rules.min_shared_class_share`` (unknown classes: the same task)."""
    if not champion or not figure.classes:
        return TaskShare(None, True, None)
    share = shared_class_share(champion, figure.classes)
    same = share >= rules.min_shared_class_share
    words = (
        f"another task: the candidate has {share:.0%} of the {CHAMPION}'s classes "
        f"({', '.join(champion)}), below evaluate.min_shared_class_share="
        f"{rules.min_shared_class_share}"
    )
    return TaskShare(share, same, None if same else words)


def rescored_figure(
    champion: str,
    scored: Rescored,
    figure: Figure,
    rules: Rules,
    differs: list[str],
    found: PromotionDecision,
) -> PromotionDecision:
    """``found`` with the re-scored champion's figure, how it was obtained, and the paired
    evidence."""
    if not isinstance(scored, Rescored):
        raise TypeError(
            f"rescore({champion!r}) returned {type(scored).__name__} {scored!r}: it must "
            "return a tasks.evaluate.promotion.Rescored (the figure and how the classes differed)"
        )
    unseen = unseen_part(champion, scored, figure, rules)
    if isinstance(unseen, str):
        return not_comparable(found, unseen)
    classes = scored.class_differences
    by_name = f" by class name ({classes['in_words']})" if classes else ""
    because = "; ".join(differs) if differs else "a paired comparison needs both on one set"
    how = (
        f"re-scored on the current test set {figure.test_fingerprint[:12]} as "
        f"{figure.definition}{by_name}, because {because}"
    )
    if scored.recorded:
        how = (
            f"recorded {figure.definition} on the same test set {figure.test_fingerprint[:12]}, "
            f"with its answers per record ({scored.recorded})"
        )
    candidate, rival = figure.answers, scored.answers
    values = replace(found, champion_value=scored.value)
    if unseen.left_out and candidate is not None and rival is not None:
        candidate, rival = candidate.subset(unseen.keep), rival.subset(unseen.keep)
        values = replace(
            found,
            candidate_value=candidate.value(figure.metric),
            candidate_full_value=figure.value,
            champion_value=rival.value(figure.metric),
            champion_full_value=scored.value,
        )
        how += f"; {unseen.in_words(champion)}"
    evidence = None
    if candidate is not None and rival is not None:
        evidence = paired_evidence(candidate, rival, figure.metric, alpha=rules.alpha)
    return replace(
        values,
        champion_value_source=RECORDED if scored.recorded else RESCORED,
        champion_value_how=how,
        class_differences=classes,
        evidence=evidence,
        unseen=unseen.to_dict(champion),
    )


def unseen_part(champion: str, scored: Rescored, figure: Figure, rules: Rules) -> UnseenTest | str:
    """The current test records neither the champion nor the candidate trained or
    validated on (:func:`unseen_test`), or why the two cannot be compared on such records."""
    if scored.seen is None:
        return str(no_seen_records(champion))
    if figure.seen is None or figure.test_hashes is None:
        return (
            "the candidate's training and validation records or its test records' hashes are "
            "unknown, so no test record can be shown to be unseen by it; evaluate again"
        )
    unseen = unseen_test(figure.test_hashes, scored.seen, figure.seen)
    answered = figure.answers is not None and scored.answers is not None
    if unseen.left_out and not answered:
        return (
            f"{unseen.in_words(champion)}, but without both models' answers per record no "
            "figure on those records can be made"
        )
    if unseen.unseen < rules.min_unseen_records:
        return (
            f"only {unseen.unseen} of {unseen.total} current test records were seen by neither "
            f"model ({unseen.in_words(champion)}), below evaluate.min_unseen_records="
            f"{rules.min_unseen_records}: add images neither model has seen (new images land in "
            "test by ingest.splits), or evaluate on the split the champion was trained on, or "
            "check both by hand and move the alias with `shardflow promote --version V "
            "--reason R`"
        )
    return unseen


def outcome(decision: PromotionDecision, rules: Rules) -> Verdict:
    """Promoted, kept or inconclusive, and the reason in words, from the two figures and
    the evidence."""
    metric, value, margin = decision.metric, decision.candidate_value, rules.margin
    current, champion_value = decision.champion_version, decision.champion_value
    if not decision.comparable or champion_value is None:
        reason = f"NOT COMPARABLE with {CHAMPION} v{current}: {decision.champion_value_how}"
        if not decision.same_task:
            reason += (
                "; a model of another task never replaces it (a new task gets a "
                "registered model of its own: leave evaluate.model_name null)"
            )
            return Verdict(False, NOT_COMPARABLE, reason)
        if rules.allow_incomparable:
            reason += "; evaluate.allow_incomparable_promotion is true: promoted anyway"
            return Verdict(True, "promoted", reason)
        reason = (
            f"{NOT_COMPARABLE} ({reason}); set evaluate.allow_incomparable_promotion to "
            "promote anyway"
        )
        return Verdict(False, NOT_COMPARABLE, reason)
    beats = value > champion_value + margin
    figures = (
        f"{metric} {value:.4f} {'beats' if beats else 'does not beat'} {CHAMPION} v{current} "
        f"({champion_value:.4f}, {decision.champion_value_how}) by more than margin {margin}"
    )
    if not beats:
        return Verdict(False, "kept", figures)
    evidence = decision.evidence
    if evidence is None:
        reason = (
            f"{figures}, but without both models' answers on the same records there is "
            "no evidence the difference is more than chance"
        )
        return Verdict(False, INCONCLUSIVE, reason)
    words = evidence.in_words()
    if evidence.p_value >= rules.alpha:
        reason = (
            f"{figures}, but within chance ({words}; not below evaluate.promotion_alpha "
            f"{rules.alpha})"
        )
        return Verdict(False, INCONCLUSIVE, reason)
    reason = f"{figures}, beyond chance ({words}; below evaluate.promotion_alpha {rules.alpha})"
    return Verdict(True, "promoted", reason)


class ChampionMoved(RuntimeError):
    """The alias moved after the comparison was made: the decision no longer holds."""


def apply_decision(client: MlflowClient, model_name: str, decision: PromotionDecision) -> None:
    """Move ``champion`` to the candidate if the decision says so (idempotent), and only
    while it still points at the version the decision compared with (a compare-and-set:
    raises :class:`ChampionMoved` otherwise, leaving the alias where it is). A DVC
    experiment's version takes ``challenger`` instead, whatever the decision."""
    candidate = decision.candidate_version
    if decision.experiment:
        client.set_registered_model_alias(model_name, CHALLENGER, candidate)
        return
    if not decision.promoted:
        return
    now = champion_version(client, model_name)
    if now not in (decision.champion_version, candidate):
        raise ChampionMoved(
            f"{CHAMPION} of {model_name!r} moved to v{now} after version {candidate} was "
            f"compared with v{decision.champion_version}: not promoted; evaluate again "
            "to compare with the new champion"
        )
    client.set_registered_model_alias(model_name, CHAMPION, candidate)


def promote(
    client: MlflowClient,
    model_name: str,
    choose: Callable[[], PromotionDecision],
    record: Callable[[PromotionDecision], None],
) -> PromotionDecision:
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
) -> PromotionDecision | None:
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
    return PromotionDecision.from_json(decision)
