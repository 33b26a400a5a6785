"""Promotion and the evaluate stage refusals, against a real (SQLite) registry."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tasks.evaluate.evidence import Answers
from tasks.evaluate.promotion import (
    ChampionMoved,
    Figure,
    PromotionDecision,
    Rescored,
    Rules,
    apply_decision,
    blank_record,
    decide,
    pending_decision,
    promote,
)
from tasks.evaluate.promotion_lock import LOCK_SUFFIX, lock_holder, promotion_lock
from tasks.evaluate.seen_records import SeenRecords
from tasks.runtime.atomic import write_json
from tasks.runtime.tracking import CHAMPION, champion_version
from tests.conftest import copy_blank_store

TEST_SET = "a" * 64
RECORDS = 200  # test records of the paired answers below
AUTO = "re-score the champion as its recorded figure, with answers"
TEST_HASHES = tuple(f"{n:064x}" for n in range(RECORDS))  # the test records' content hashes
# What each model trained and validated on: none of the test records.
SEEN = SeenRecords(
    "c" * 64, frozenset(f"{n:064x}" for n in range(RECORDS, RECORDS + 80)), frozenset()
)
CANDIDATE_SEEN = SeenRecords(TEST_SET, SEEN.train, frozenset({f"{RECORDS + 99:064x}"}))


def answers(value: float, records: int = RECORDS) -> Answers:
    """Answers right on the first ``value`` share of the records: two such sets disagree
    only where the better one is right, so their paired test is as clear as it gets."""
    import numpy as np

    labels = np.zeros(records, np.int64)
    predicted = (np.arange(records) >= round(value * records)).astype(np.int64)
    return Answers(labels, predicted, predicted == labels, 2)


def rules(
    margin: float = 0.0,
    allow_incomparable: bool = False,
    alpha: float = 0.05,
    share: float = 0.5,
    min_unseen: int = 50,
) -> Rules:
    return Rules(
        margin=margin,
        alpha=alpha,
        min_shared_class_share=share,
        allow_incomparable=allow_incomparable,
        min_unseen_records=min_unseen,
    )


@dataclass
class Registry:
    client: MlflowClient
    name: str

    def decide(
        self,
        value: float,
        *,
        margin: float = 0.0,
        test_set: str = TEST_SET,
        allow_incomparable: bool = False,
        metric: str = "accuracy",
        definition: str = "accuracy",
        rescore: Any = AUTO,
        classes: tuple[str, ...] = ("a", "b"),
        paired: Answers | str | None = AUTO,
        experiment: str | None = None,
    ) -> Any:
        source = str(Path(self.client.tracking_uri.removeprefix("sqlite:///")).parent)
        version = str(self.client.create_model_version(self.name, source=source).version)
        if rescore == AUTO:
            rescore = self.rescored_as_recorded(metric)
        decision = decide(
            self.client,
            self.name,
            version,
            Figure(
                metric,
                definition,
                value,
                test_set,
                classes,
                answers(value) if paired == AUTO else paired,  # type: ignore[arg-type]
                TEST_HASHES,
                CANDIDATE_SEEN,
            ),
            rules=rules(margin, allow_incomparable),
            rescore=rescore,
            experiment=experiment,
        )
        apply_decision(self.client, self.name, decision)  # as run_evaluate does, after writing
        return decision.to_json()  # the record as reports/eval_summary.json holds it

    def rescored_as_recorded(self, metric: str) -> Any:
        """A champion re-scored on the candidate's records as its recorded figure."""

        def rescore(version: str) -> Rescored:
            tags = self.client.get_model_version(self.name, version).tags
            value = float(tags[f"eval.{metric}"])
            return Rescored(value, answers=answers(value), seen=SEEN)

        return rescore

    @property
    def champion(self) -> str:
        return str(self.client.get_model_version_by_alias(self.name, CHAMPION).version)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, blank_mlflow_store: Path) -> MlflowClient:
    """One SQLite store for the module, a copy of the blank one."""
    uri = copy_blank_store(blank_mlflow_store, tmp_path_factory.mktemp("registry") / "mlflow.db")
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@pytest.fixture
def registry(store: MlflowClient, request: pytest.FixtureRequest) -> Registry:
    """A fresh registered model, named after the test, in the shared store."""
    store.create_registered_model(request.node.name)
    return Registry(store, request.node.name)


def test_first_version_becomes_champion(registry: Registry) -> None:
    assert registry.decide(0.7)["promoted"] is True
    assert registry.champion == "1"


def test_worse_model_does_not_take_the_alias(registry: Registry) -> None:
    registry.decide(0.8)
    decision = registry.decide(0.7)
    assert decision["promoted"] is False
    assert decision["champion_value"] == 0.8 and decision["candidate_value"] == 0.7
    assert registry.champion == "1"


def test_better_model_takes_the_alias(registry: Registry) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.8)
    assert decision["promoted"] is True and decision["comparable"] is True
    assert registry.champion == "2"


def test_gain_within_the_margin_is_not_enough(registry: Registry) -> None:
    registry.decide(0.80)
    assert registry.decide(0.82, margin=0.05)["promoted"] is False
    assert registry.champion == "1"


def test_an_advantage_within_chance_is_inconclusive_and_the_champion_stays(
    registry: Registry,
) -> None:
    """The bug: a challenger one test image better took the alias. On the same 200 records
    one more right is one discordant record (p = 0.5): inconclusive, champion kept, and
    the record gives the method, the p-value, the interval and the test-set size."""
    registry.decide(0.700)
    decision = registry.decide(0.705)
    assert decision["promoted"] is False and decision["decision"] == "inconclusive: champion kept"
    evidence = decision["evidence"]
    assert evidence["p_value"] == pytest.approx(0.5) and evidence["test_records"] == RECORDS
    assert "McNemar on 1 discordant records" in evidence["method"]
    assert evidence["ci_low"] < 0 < evidence["ci_high"]
    assert "within chance" in decision["reason"] and "promotion_alpha 0.05" in decision["reason"]
    assert registry.champion == "1"


def test_a_macro_figure_is_decided_by_a_seeded_paired_bootstrap(registry: Registry) -> None:
    import numpy as np

    labels = np.arange(RECORDS) % 2
    perfect = Answers(labels, labels, np.ones(RECORDS, bool), 2)
    coin = Answers(labels, np.zeros(RECORDS, np.int64), labels == 0, 2)

    def rescore(version: str) -> Rescored:
        return Rescored(1 / 3, answers=coin, seen=SEEN)

    registry.decide(1 / 3, metric="macro_f1", definition="macro_f1", paired=coin)
    decision = registry.decide(
        1.0, metric="macro_f1", definition="macro_f1", paired=perfect, rescore=rescore
    )
    assert decision["promoted"] is True
    assert "paired bootstrap" in decision["evidence"]["method"]
    assert decision["evidence"]["p_value"] < 0.001 and decision["evidence"]["ci_low"] > 0
    assert registry.champion == "2"


@pytest.mark.parametrize("allow_incomparable", [False, True])
def test_a_challenger_of_another_task_is_never_compared(
    registry: Registry, allow_incomparable: bool
) -> None:
    """The bug: a cat/coffee/rocket model took the shapes model's alias (re-scored 0.0 on
    classes it never knew). With under half of the champion's classes it is another task:
    not comparable, champion kept, whatever evaluate.allow_incomparable_promotion says."""
    registry.decide(0.9, classes=("circle", "square", "triangle"))
    decision = registry.decide(
        0.99,
        classes=("cat", "coffee", "triangle"),
        allow_incomparable=allow_incomparable,
    )
    assert decision["comparable"] is False and decision["same_task"] is False
    assert decision["promoted"] is False and decision["decision"] == "not comparable: champion kept"
    assert decision["shared_class_share"] == pytest.approx(1 / 3)
    assert (
        "another task" in decision["reason"] and "min_shared_class_share=0.5" in decision["reason"]
    )
    assert registry.champion == "1"


def test_a_class_added_to_the_same_task_still_compares(registry: Registry) -> None:
    registry.decide(0.7, classes=("circle", "square"))
    decision = registry.decide(0.9, classes=("circle", "square", "star"))
    assert decision["same_task"] is True and decision["shared_class_share"] == 1.0
    assert decision["promoted"] is True and registry.champion == "2"
    # two of the champion's three classes (one dropped, one new): the same task still
    renamed = registry.decide(0.99, classes=("circle", "star", "blob"))
    assert renamed["shared_class_share"] == pytest.approx(2 / 3) and renamed["comparable"] is True


@pytest.mark.parametrize("first", [True, False], ids=["no-champion-yet", "over-a-champion"])
def test_a_dvc_experiment_s_version_becomes_the_challenger_never_the_champion(
    registry: Registry, first: bool
) -> None:
    from tasks.runtime.tracking import CHALLENGER

    if not first:
        registry.decide(0.5)
    decision = registry.decide(0.95, experiment="lr-high")
    version = decision["candidate_version"]
    assert decision["promoted"] is False and decision["would_have_promoted"] is True
    assert decision["decision"] == f"{CHALLENGER} (experiment; main line: promoted)"
    assert "shardflow promote --version" in decision["reason"]
    assert champion_version(registry.client, registry.name) == (None if first else "1")
    aliased = registry.client.get_model_version_by_alias(registry.name, CHALLENGER)
    assert str(aliased.version) == version


def test_champion_on_another_test_set_is_kept_not_silently_compared(
    registry: Registry,
) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.9, test_set="b" * 64, rescore=None)
    assert decision["comparable"] is False and decision["promoted"] is False
    assert decision["decision"] == "not comparable: champion kept"
    assert "evaluate.allow_incomparable_promotion" in decision["reason"]
    assert registry.champion == "1"


def test_incomparable_promotion_only_when_the_param_allows_it(registry: Registry) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.9, test_set="b" * 64, allow_incomparable=True, rescore=None)
    assert decision["comparable"] is False and decision["promoted"] is True
    assert "NOT COMPARABLE" in decision["reason"]
    assert registry.champion == "2"


def test_champion_without_a_figure_is_not_comparable(registry: Registry) -> None:
    registry.decide(0.7)
    registry.client.delete_model_version_tag(registry.name, "1", "eval.accuracy")
    decision = registry.decide(0.9, rescore=None)
    assert decision["comparable"] is False and decision["promoted"] is False
    assert decision["champion_value"] is None
    assert registry.champion == "1"


def test_negative_margin_is_refused(registry: Registry) -> None:
    registry.decide(0.8)
    with pytest.raises(ValueError, match=r"evaluate\.promotion_margin=-0\.1"):
        registry.decide(0.75, margin=-0.1)
    assert registry.champion == "1"


def racing_promotion(
    registry: Registry, value: float, rescore: Any
) -> tuple[str, Callable[[], dict[str, Any]]]:
    """A new version and the promotion an evaluation of it runs (on test set b)."""
    client, name = registry.client, registry.name
    source = str(Path(client.tracking_uri.removeprefix("sqlite:///")).parent)
    version = str(client.create_model_version(name, source=source).version)
    figure = Figure(
        "accuracy", "accuracy", value, "b" * 64, ("a", "b"), answers(value), TEST_HASHES, SEEN
    )

    def choose() -> PromotionDecision:
        return decide(client, name, version, figure, rules=rules(), rescore=rescore)

    return version, lambda: promote(client, name, choose, lambda decision: None).to_json()


def test_a_promotion_whose_comparison_another_run_invalidated_never_moves_the_alias(
    registry: Registry,
) -> None:
    """v2 (0.7) compares with champion v1 (re-scored: slowly) while v3 (0.9) compares with
    v1 too and takes the alias: v2's comparison no longer holds and it must not move the
    alias off the better v3 (unguarded, it did). Under the lock v3 waits and compares with
    whichever version is champion by then; either way v3 ends champion."""
    registry.decide(0.95)  # v1, on test set a: re-scored on b as 0.5
    comparing, better_done = threading.Event(), threading.Event()

    def slow_rescore(version: str) -> Rescored:
        comparing.set()
        better_done.wait(timeout=3)  # under the lock the better one cannot finish meanwhile
        return Rescored(0.5, answers=answers(0.5), seen=SEEN)

    weaker, run_weaker = racing_promotion(registry, 0.7, slow_rescore)
    better, run_better = racing_promotion(
        registry, 0.9, lambda version: Rescored(0.5, answers=answers(0.5), seen=SEEN)
    )
    outcomes: dict[str, Any] = {}

    def run(version: str, promotion: Callable[[], dict[str, Any]], done: threading.Event) -> None:
        try:
            outcomes[version] = promotion()
        except Exception as error:  # the outcome the test inspects
            outcomes[version] = error
        done.set()

    threads = [threading.Thread(target=run, args=(weaker, run_weaker, threading.Event()))]
    threads[0].start()
    assert comparing.wait(timeout=30)
    threads.append(threading.Thread(target=run, args=(better, run_better, better_done)))
    threads[1].start()
    for thread in threads:
        thread.join(timeout=120)
    assert (weaker, better) == ("2", "3")
    assert registry.champion == better, outcomes
    assert outcomes[better]["promoted"] is True, outcomes
    # The weaker one promoted only on a comparison still true when it moved the alias (the
    # better one then compared with it), or was refused.
    assert isinstance(outcomes[weaker], ChampionMoved) or (
        outcomes[weaker]["champion_version"] == "1"
        and outcomes[better]["champion_version"] == weaker
    ), outcomes
    assert not registry.client.search_registered_models(f"name = '{registry.name}{LOCK_SUFFIX}'")


def test_the_alias_moves_only_while_it_is_where_the_comparison_found_it(
    registry: Registry,
) -> None:
    """apply_decision is a compare-and-set: a decision made against v1 cannot move the alias
    once another version took it."""
    registry.decide(0.5)
    stale = registry.decide(0.6)  # v2 beats v1 ...
    registry.client.set_registered_model_alias(registry.name, CHAMPION, "1")
    registry.decide(0.9)  # ... but v3 took the alias meanwhile
    with pytest.raises(ChampionMoved, match=r"moved to v3 after version 2 was compared with v1"):
        apply_decision(registry.client, registry.name, PromotionDecision.from_json(stale))
    assert registry.champion == "3"


def test_a_promotion_waits_for_the_lock_and_takes_over_one_a_dead_process_left(
    registry: Registry,
) -> None:
    client, lock = registry.client, f"{registry.name}{LOCK_SUFFIX}"
    client.create_registered_model(lock, tags={"holder": lock_holder()})  # held, alive
    with (
        pytest.raises(TimeoutError, match=re.escape(lock)),
        promotion_lock(client, registry.name, wait_s=0.5),
    ):
        pass
    client.delete_registered_model(lock)
    gone = subprocess.Popen(["true"])
    gone.wait()
    client.create_registered_model(lock, tags={"holder": f"{socket.gethostname()}:{gone.pid}"})
    version, promotion = racing_promotion(registry, 0.8, None)
    assert promotion()["promoted"] is True and registry.champion == version
    assert not client.search_registered_models(f"name = '{lock}'")


def model_to_register(tmp_path: Path) -> tuple[Path, Any]:
    """A saved two-class Keras model and a serving spec for it."""
    import keras

    from tasks.predict import ServingSpec
    from tasks.schema import RecordSchema

    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Flatten(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model_file = tmp_path / "m.keras"
    model.save(model_file)
    spec = ServingSpec(
        RecordSchema(8, 8, "raw").to_dict(), "pad", True, ["a", "b"], "v", 10**6, 1, 10**6
    )
    return model_file, spec


def store_with_runs(
    new_store: Callable[[Path], str], tmp_path: Path, name: str, runs: int
) -> tuple[MlflowClient, list[str]]:
    uri = new_store(tmp_path / name)
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    return client, [client.create_run(experiment).info.run_id for _ in range(runs)]


# -- the evaluate stage: refusals, fair comparison and crash recovery ------------------------


def test_recorded_decision_is_pending_only_while_the_alias_has_not_moved(tmp_path: Path) -> None:
    path = tmp_path / "eval_summary.json"
    decision = replace(
        blank_record("2", Figure("accuracy", "accuracy", 0.9, TEST_SET), rules(), "1", None),
        promoted=True,
        decision="promoted",
        reason="beats it",
    )
    write_json(path, {"run_id": "r", "model_version": "2", "promotion": decision.to_json()})

    def pending(run_id: str = "r", version: str = "2", champion: str | None = "1") -> Any:
        return pending_decision(
            path,
            run_id=run_id,
            version=version,
            metric="accuracy",
            definition="accuracy",
            champion=champion,
        )

    assert pending() == decision  # crashed before the move: complete it
    assert pending(champion="2") == decision  # moved already: completing is a no-op
    assert pending(champion="3") is None  # another version took it since: decide afresh
    assert pending(run_id="other") is None and pending(version="3") is None
    write_json(
        path,
        {
            "run_id": "r",
            "model_version": "2",
            "promotion": {**decision.to_json(), "promoted": False},
        },
    )
    assert pending() is None


# The record as JSON holds it: the keys each step of the decision adds, none more.
BLANK_KEYS = {
    "metric", "definition", "test_fingerprint", "test_records", "candidate_version",
    "candidate_value", "margin", "alpha", "min_shared_class_share", "champion_version",
    "champion_value", "champion_recorded_value", "champion_value_source", "champion_value_how",
    "class_differences", "shared_class_share", "evidence", "unseen", "min_unseen_records",
    "comparable", "same_task", "allow_incomparable", "experiment",
    "promoted", "decision", "reason",
}  # fmt: skip


def test_the_decision_record_holds_the_keys_of_the_steps_taken(registry: Registry) -> None:
    """The first version's record has the blank record's keys and the verdict; a compared
    one adds the task's words; an experiment's adds the main line's verdict."""
    assert set(registry.decide(0.5)) == BLANK_KEYS
    assert set(registry.decide(0.6)) == BLANK_KEYS | {"task_words"}
    experiment = registry.decide(0.7, experiment="lr-high")
    assert set(experiment) == BLANK_KEYS | {"task_words", "would_have_promoted"}


def test_a_decision_read_back_from_its_json_is_the_same_decision(registry: Registry) -> None:
    """What ``reports/eval_summary.json`` holds reads back as the decision that wrote it,
    evidence included: a pending promotion completes the decision that was made."""
    registry.decide(0.5)
    recorded = registry.decide(0.9)
    assert recorded["evidence"]["p_value"] < 0.05
    decision = PromotionDecision.from_json(recorded)
    assert decision.evidence is not None and decision.evidence.p_value < 0.05
    assert decision.to_json() == recorded
    assert PromotionDecision.from_json(decision.to_json()) == decision


# -- a fair comparison: the champion re-scored on today's test set, the same metric ----------


def test_top_k_change_rescores_the_champion_rather_than_comparing(registry: Registry) -> None:
    """The bug: v1 champion at top_k 1 (0.533); v2 at top_k 5 (0.8174) was promoted as
    comparable. A figure measured with another k is another metric: the champion is
    re-scored at the candidate's k on the candidate's test set, and keeps the alias."""
    registry.decide(0.533, metric="top_k_accuracy", definition="top_k_accuracy(top_k=1)")
    asked: list[str] = []

    def rescore(version: str) -> Rescored:
        asked.append(version)
        return Rescored(0.9, seen=SEEN)  # the champion's top-5 accuracy on the same test set

    decision = registry.decide(
        0.8174, metric="top_k_accuracy", definition="top_k_accuracy(top_k=5)", rescore=rescore
    )
    assert asked == ["1"]
    assert decision["promoted"] is False and decision["comparable"] is True
    assert decision["champion_value"] == 0.9 and decision["champion_recorded_value"] == 0.533
    assert decision["champion_value_source"] == "rescored"
    assert "top_k_accuracy(top_k=1)" in decision["champion_value_how"]
    assert registry.champion == "1"
    tags = registry.client.get_model_version(registry.name, "2").tags
    assert tags["eval.definition.top_k_accuracy"] == "top_k_accuracy(top_k=5)"


def test_top_k_change_without_a_rescore_is_not_comparable(registry: Registry) -> None:
    registry.decide(0.533, metric="top_k_accuracy", definition="top_k_accuracy(top_k=1)")
    decision = registry.decide(
        0.8174, metric="top_k_accuracy", definition="top_k_accuracy(top_k=5)", rescore=None
    )
    assert decision["comparable"] is False and decision["promoted"] is False
    assert "top_k_accuracy(top_k=1)" in decision["reason"]
    assert registry.champion == "1"


def test_champion_on_another_test_set_is_rescored_on_this_one(registry: Registry) -> None:
    registry.decide(0.95)  # on test set a: a figure the candidate cannot be held to
    decision = registry.decide(
        0.9,
        test_set="b" * 64,
        rescore=lambda version: Rescored(0.6, answers=answers(0.6), seen=SEEN),
    )
    assert decision["comparable"] is True and decision["promoted"] is True
    assert decision["champion_value"] == 0.6 and decision["champion_recorded_value"] == 0.95
    assert "re-scored on the current test set bbbbbbbbbbbb" in decision["champion_value_how"]
    assert "aaaaaaaaaaaa" in decision["champion_value_how"]  # and why
    assert registry.champion == "2"


def test_a_rescore_or_figure_of_another_type_is_refused_naming_the_type(
    registry: Registry,
) -> None:
    """A re-scored figure is a Rescored, a candidate's figure a Figure: a bare float said
    nothing of how the champion's classes differed, and was taken as a figure anyway."""
    registry.decide(0.7)
    with pytest.raises(TypeError, match=r"rescore\('1'\) returned float 0\.6: it must return a "):
        registry.decide(0.9, test_set="b" * 64, rescore=lambda version: 0.6)
    wrong_type = r"figure must be a tasks\.evaluate\.promotion\.Figure .*got float"
    with pytest.raises(TypeError, match=wrong_type):
        decide(registry.client, registry.name, "1", 0.9, rules=rules())  # type: ignore[arg-type]
    assert registry.champion == "1"


def test_the_champion_is_rescored_even_on_the_same_test_set_for_paired_answers(
    registry: Registry,
) -> None:
    """Its recorded figure on the same test set is a number, not answers per record: the
    champion is re-scored anyway, so the paired test has both models' answers."""
    registry.decide(0.7)
    asked: list[str] = []

    def rescore(version: str) -> Rescored:
        asked.append(version)
        return Rescored(0.7, answers=answers(0.7), seen=SEEN)

    decision = registry.decide(0.8, rescore=rescore)
    assert asked == ["1"]
    assert decision["champion_value_source"] == "rescored" and decision["promoted"] is True
    assert decision["evidence"]["test_records"] == RECORDS


def test_a_champion_that_cannot_be_rescored_on_the_same_test_set_keeps_the_alias(
    registry: Registry,
) -> None:
    """The recorded figure is comparable, but without the champion's answers on these
    records no advantage is evidence: inconclusive, champion kept."""
    from tasks.evaluate.promotion import NotComparable

    def unloadable(version: str) -> Rescored:
        raise NotComparable("its model could not be loaded")

    registry.decide(0.7)
    decision = registry.decide(0.9, rescore=unloadable)
    assert decision["champion_value_source"] == "recorded" and decision["comparable"] is True
    assert decision["decision"] == "inconclusive: champion kept"
    assert "could not be loaded" in decision["champion_value_how"]
    assert registry.champion == "1"


def test_a_champion_that_cannot_be_rescored_is_not_comparable_and_says_why(
    registry: Registry,
) -> None:
    from tasks.evaluate.promotion import NotComparable

    def other_spec(version: str) -> Rescored:
        raise NotComparable("its serving spec differs (image size and encoding: 8x8 vs 16x16)")

    registry.decide(0.7)
    decision = registry.decide(0.9, test_set="b" * 64, rescore=other_spec)
    assert decision["comparable"] is False and decision["promoted"] is False
    assert "image size and encoding: 8x8 vs 16x16" in decision["reason"]
    assert registry.champion == "1"


# -- classes that differ: the champion re-scored by class name -------------------------------


def test_a_champion_is_scored_by_its_own_ranking_of_names() -> None:
    """Today's classes a, b; the champion knows c, b, a (that order). Its prediction c is
    wrong on an a record, never re-ranked to b after dropping c; its top 2 (c, b) misses a;
    the macro figures are over today's two classes."""
    import numpy as np

    from tasks.evaluate.metrics import metrics_by_name

    probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.7, 0.2], [0.2, 0.1, 0.7]], np.float32)
    labels = np.array([0, 1, 0])  # a, b, a
    metrics = metrics_by_name(labels, probs, ["c", "b", "a"], ["a", "b"], top_k=2)
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["top_k_accuracy"] == pytest.approx(2 / 3)
    assert metrics["macro_recall"] == pytest.approx((1 / 2 + 1) / 2)
    assert metrics["macro_precision"] == pytest.approx(1.0)
    assert [row["class"] for row in metrics["per_class"]] == ["a", "b"]


# -- evaluation's own run ------------------------------------------------------------------


# -- the card and the label review, per registered version ---------------------------------


def seen_test_records(first: int, last: int) -> SeenRecords:
    """A champion that trained on test records ``first`` to ``last - 1`` of today's set (the
    split moved since it was trained)."""
    return SeenRecords("d" * 64, frozenset(TEST_HASHES[first:last]) | SEEN.train, frozenset())


def test_the_champion_is_compared_only_on_test_records_neither_model_saw(
    registry: Registry,
) -> None:
    """The split moved: 60 of today's 200 test records were in the champion's training
    split. On all 200 it wins (it learned those 60 by heart); on the 140 neither model saw,
    the challenger is better, and takes the alias. The record names what was left out and
    why; the candidate's full-test figure stays beside the compared one."""
    import numpy as np

    labels = np.zeros(RECORDS, np.int64)
    champion_right = np.arange(RECORDS) < 130  # all 60 it saw, 70 of the other 140
    challenger_right = (np.arange(RECORDS) >= 60) & (np.arange(RECORDS) < 180)  # 120 of 140
    champion = Answers(labels, (~champion_right).astype(np.int64), champion_right, 2)
    challenger = Answers(labels, (~challenger_right).astype(np.int64), challenger_right, 2)
    registry.decide(0.65)

    def rescore(version: str) -> Rescored:
        return Rescored(0.65, answers=champion, seen=seen_test_records(0, 60))

    decision = registry.decide(0.6, paired=challenger, rescore=rescore)
    assert decision["promoted"] is True, decision["reason"]
    assert decision["unseen"]["left_out_records"] == 60
    assert decision["unseen"]["left_out_champion_saw"] == 60
    assert decision["unseen"]["unseen_records"] == decision["evidence"]["test_records"] == 140
    assert decision["candidate_value"] == pytest.approx(120 / 140)
    assert decision["champion_value"] == pytest.approx(70 / 140)
    assert decision["candidate_full_value"] == 0.6 and decision["champion_full_value"] == 0.65
    assert (
        "60 of 200 test records left out (60 trained or validated on by champion v1"
        in (decision["reason"])
    )
    assert registry.champion == "2"


def test_too_few_test_records_neither_model_saw_are_not_comparable_and_say_what_to_do(
    registry: Registry,
) -> None:
    registry.decide(0.7)

    def rescore(version: str) -> Rescored:
        return Rescored(0.7, answers=answers(0.7), seen=seen_test_records(0, 170))

    decision = registry.decide(0.95, rescore=rescore)
    assert decision["comparable"] is False and decision["promoted"] is False
    assert decision["decision"] == "not comparable: champion kept"
    assert "only 30 of 200 current test records were seen by neither model" in decision["reason"]
    assert "evaluate.min_unseen_records=50" in decision["reason"]
    assert "shardflow promote --version" in decision["reason"]
    assert registry.champion == "1"


def test_a_champion_that_logged_no_seen_records_is_not_comparable(registry: Registry) -> None:
    """A version registered without the hashes of its training and validation records
    cannot be shown to be unseen on any test record: not comparable, whatever its figure,
    whether it was re-scored or raised before loading its model."""
    from tasks.evaluate.promotion import no_seen_records

    registry.decide(0.5)
    unknown = registry.decide(0.9, rescore=lambda version: Rescored(0.5, answers=answers(0.5)))
    assert unknown["comparable"] is False and unknown["promoted"] is False

    def raises(version: str) -> Rescored:
        raise no_seen_records(version)

    refused = registry.decide(0.9, rescore=raises)
    assert refused["comparable"] is False and refused["champion_value"] is None
    for decision in (unknown, refused):
        assert "logged no hashes of the records it trained and validated on" in decision["reason"]
    assert registry.champion == "1"
