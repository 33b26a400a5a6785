"""Promotion and the evaluate stage refusals, against a real (SQLite) registry."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tasks.contracts.validated_shards import ModelNotFromTheseShards, ShardsNotValidated
from tasks.evaluate.evidence import Answers
from tasks.evaluate.promotion import (
    ChampionMoved,
    Figure,
    Rescored,
    Rules,
    apply_decision,
    decide,
    pending_decision,
    promote,
)
from tasks.evaluate.promotion_lock import LOCK_SUFFIX, lock_holder, promotion_lock
from tasks.evaluate.stage import run_evaluate
from tasks.evaluate.store_check import REBUILD
from tasks.evaluate.tracking import TrainingRunNotInStore
from tasks.runtime.atomic import write_json
from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.runtime.tracking import CHAMPION, champion_version

TEST_SET = "a" * 64
RECORDS = 200  # test records of the paired answers below
AUTO = "re-score the champion as its recorded figure, with answers"


def answers(value: float, records: int = RECORDS) -> Answers:
    """Answers right on the first ``value`` share of the records: two such sets disagree
    only where the better one is right, so their paired test is as clear as it gets."""
    import numpy as np

    labels = np.zeros(records, np.int64)
    predicted = (np.arange(records) >= round(value * records)).astype(np.int64)
    return Answers(labels, predicted, predicted == labels, 2)


def rules(
    margin: float = 0.0, allow_incomparable: bool = False, alpha: float = 0.05, share: float = 0.5
) -> Rules:
    return Rules(
        margin=margin,
        alpha=alpha,
        min_shared_class_share=share,
        allow_incomparable=allow_incomparable,
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
            ),
            rules=rules(margin, allow_incomparable),
            rescore=rescore,
            experiment=experiment,
        )
        apply_decision(self.client, self.name, decision)  # as run_evaluate does, after writing
        return decision

    def rescored_as_recorded(self, metric: str) -> Any:
        """A champion re-scored on the candidate's records as its recorded figure."""

        def rescore(version: str) -> Rescored:
            tags = self.client.get_model_version(self.name, version).tags
            value = float(tags[f"eval.{metric}"])
            return Rescored(value, answers=answers(value))

        return rescore

    @property
    def champion(self) -> str:
        return str(self.client.get_model_version_by_alias(self.name, CHAMPION).version)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    """One SQLite store for the module (creating its tables takes seconds)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"
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
        return Rescored(1 / 3, answers=coin)

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
    figure = Figure("accuracy", "accuracy", value, "b" * 64, ("a", "b"), answers(value))

    def choose() -> dict[str, Any]:
        return decide(client, name, version, figure, rules=rules(), rescore=rescore)

    return version, lambda: promote(client, name, choose, lambda decision: None)


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
        return Rescored(0.5, answers=answers(0.5))

    weaker, run_weaker = racing_promotion(registry, 0.7, slow_rescore)
    better, run_better = racing_promotion(
        registry, 0.9, lambda version: Rescored(0.5, answers=answers(0.5))
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
        apply_decision(registry.client, registry.name, stale)
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


def test_two_processes_finding_the_same_dead_lock_never_both_hold_it(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both read the dead holder before either deletes its lock, and the second acts only
    once the first holds the lock anew (the interleaving is forced): it waits for the lock
    instead of deleting it from under the first. Two live holders (this process and its
    parent) stand for two processes."""
    import tasks.evaluate.promotion_lock as promotion_lock_module

    client, lock = registry.client, f"{registry.name}{LOCK_SUFFIX}"
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = f"{socket.gethostname()}:{gone.pid}"
    client.create_registered_model(lock, tags={"holder": dead})
    me = threading.local()
    monkeypatch.setattr(promotion_lock_module, "lock_holder", lambda: me.holder)
    both_saw_it = threading.Barrier(2, timeout=20)
    read_holder = promotion_lock_module._lock_holder_tag

    def slow_reader(client: MlflowClient, name: str) -> str | None:
        held_by = read_holder(client, name)
        if held_by == dead and not getattr(me, "waited", False):
            me.waited = True
            both_saw_it.wait()  # neither has deleted the dead lock yet
            if me.second:  # ...and the second acts once the first holds the lock anew
                threading.Event().wait(0.7)
        return held_by

    monkeypatch.setattr(promotion_lock_module, "_lock_holder_tag", slow_reader)
    inside, most_inside, errors = [0], [0], []
    count = threading.Lock()

    def promoter(pid: int) -> None:
        me.holder, me.second = f"{socket.gethostname()}:{pid}", pid == os.getppid()
        try:
            with promotion_lock(client, registry.name, wait_s=20, poll_s=0.05):
                with count:
                    inside[0] += 1
                    most_inside[0] = max(most_inside[0], inside[0])
                threading.Event().wait(2.0)
                with count:
                    inside[0] -= 1
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=promoter, args=(p,)) for p in (os.getpid(), os.getppid())]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and most_inside[0] == 1
    assert not client.search_registered_models(f"name LIKE '{lock}%'")


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


def store_with_runs(tmp_path: Path, name: str, runs: int) -> tuple[MlflowClient, list[str]]:
    uri = f"sqlite:///{tmp_path / name}"
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    return client, [client.create_run(experiment).info.run_id for _ in range(runs)]


def test_registering_the_same_run_twice_reuses_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried or repeated evaluation must not add a duplicate registry version."""
    from tasks.evaluate.registry import register_model

    client, runs = store_with_runs(tmp_path, "mlflow.db", 2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
    model_file, spec = model_to_register(tmp_path)
    first = register_model(client, runs[0], model_file, "m", spec)
    again = register_model(client, runs[0], model_file, "m", spec)
    other = register_model(client, runs[1], model_file, "m", spec)
    assert first == again == "1" and other == "2"


def test_a_pyfunc_logged_early_is_deleted_when_another_evaluation_registered_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two evaluations of one training run, both logging their pyfunc while measuring: the
    one that registers second reuses the first one's version and must not leave its own
    pyfunc behind, unregistered, on the run."""
    from tasks.evaluate.registry import log_due_pyfunc, register_model

    client, runs = store_with_runs(tmp_path, "mlflow.db", 1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
    model_file, spec = model_to_register(tmp_path)
    experiment = client.get_run(runs[0]).info.experiment_id
    # from two workspaces (one evaluation at a time runs in each), before either registers
    first = log_due_pyfunc(client, runs[0], model_file, "m", spec, "workspace-a")
    second = log_due_pyfunc(client, runs[0], model_file, "m", spec, "workspace-b")
    assert first and second and first != second

    assert register_model(client, runs[0], model_file, "m", spec, first) == "1"
    assert register_model(client, runs[0], model_file, "m", spec, second) == "1"

    kept = [m.model_id for m in client.search_logged_models([experiment])]
    assert kept == [first.removeprefix("models:/")]
    # Registering the version's own pyfunc again (a repeated call) deletes nothing.
    assert register_model(client, runs[0], model_file, "m", spec, first) == "1"
    assert [m.model_id for m in client.search_logged_models([experiment])] == kept


def test_registering_leaves_the_process_and_the_run_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering in the client's store must not point the process, or the children it
    starts later, at that store (their ``models:/m@champion`` would resolve there), nor end
    the run that evaluation is still logging to."""
    import mlflow

    from tasks.evaluate.registry import register_model

    client, runs = store_with_runs(tmp_path, "project.db", 1)
    own = f"sqlite:///{tmp_path / 'own.db'}"  # the store this process is configured for
    monkeypatch.setenv("MLFLOW_TRACKING_URI", own)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    before = (mlflow.get_tracking_uri(), mlflow.get_registry_uri())
    model_file, spec = model_to_register(tmp_path)

    assert register_model(client, runs[0], model_file, "m", spec) == "1"

    assert client.get_model_version("m", "1").run_id == runs[0]  # in the client's store
    assert (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) == before == (own, own)
    assert os.environ["MLFLOW_TRACKING_URI"] == own
    assert "MLFLOW_REGISTRY_URI" not in os.environ
    # Evaluation goes on logging to the run: it must not look finished yet, nor stay active.
    assert client.get_run(runs[0]).info.status == "RUNNING"
    assert mlflow.active_run() is None


# -- the evaluate stage: refusals, fair comparison and crash recovery ------------------------


@pytest.fixture
def model_root(tiny_shards: Path, mlflow_uri: str) -> Layout:
    """A project root as train leaves it, but no tracking store: the refusals need none.

    The model is untrained (evaluation does not care how good it is), which keeps this fast.
    """
    from tasks.contracts.manifest import load_manifest
    from tasks.train.models import build_model

    layout = Layout(tiny_shards)
    manifest = load_manifest(layout.shards_dir)
    layout.model_dir.mkdir(parents=True, exist_ok=True)
    build_model(default_params().train, len(manifest.classes), (16, 16, 3)).save(layout.model_file)
    write_json(layout.train_run, {"run_id": "not-opened", "fingerprint": manifest.fingerprint})
    return layout


@pytest.fixture
def trained(model_root: Layout) -> Layout:
    """``model_root`` plus the finished training run its run.json names, in a real store."""
    from tasks.runtime import tracking

    client = tracking.client(model_root.root)
    run_id = client.create_run(tracking.experiment_id(client)).info.run_id
    client.set_terminated(run_id)
    record = json.loads(model_root.train_run.read_text())
    write_json(model_root.train_run, {**record, "run_id": run_id})
    return model_root


def refused(layout: Layout) -> bool:
    """Nothing evaluated, nothing tracked."""
    return not layout.eval_metrics.exists() and not (layout.root / "mlflow.db").exists()


def evaluate(layout: Layout, **settings: Any) -> dict[str, Any]:
    """Evaluate with some settings changed; model_copy skips validation, so evaluate's own
    refusals (a negative margin) are exercised too, not only the params file's."""
    base = default_params(evaluate={"model_name": "m"})
    section = base.evaluate.model_copy(update=settings)
    return run_evaluate(base.model_copy(update={"evaluate": section}), layout)


def test_model_trained_on_other_shards_is_refused(model_root: Layout) -> None:
    record = json.loads(model_root.train_run.read_text())
    write_json(model_root.train_run, {**record, "fingerprint": "f" * 64})
    with pytest.raises(ModelNotFromTheseShards, match=r"run\.json.*trained on shards ffffff"):
        evaluate(model_root)
    assert refused(model_root)


def test_a_training_run_the_store_does_not_hold_is_refused_naming_the_fix(
    model_root: Layout,
) -> None:
    """With mlflow.db deleted or MLFLOW_TRACKING_URI pointed elsewhere, evaluation failed
    with MLflow's bare "Run with id=... not found", retried twice."""
    record = json.loads(model_root.train_run.read_text())
    write_json(model_root.train_run, {**record, "run_id": "0" * 32})
    with pytest.raises(
        TrainingRunNotInStore,
        match=rf"run\.json names the MLflow run 0{{32}}.*{re.escape(REBUILD)}",
    ):
        evaluate(model_root)
    assert not model_root.eval_metrics.exists()


def test_evaluation_refuses_unvalidated_shards(model_root: Layout) -> None:
    model_root.validation_report.unlink()
    with pytest.raises(ShardsNotValidated, match="no validation report"):
        evaluate(model_root)
    assert refused(model_root)


def test_evaluation_refuses_a_same_size_edit_after_validation(model_root: Layout) -> None:
    shard = sorted(model_root.shards_dir.glob("test.tfrecord-*[0-9]"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardsNotValidated, match=rf"{shard.name}.*sha256"):
        evaluate(model_root)
    assert refused(model_root)


def test_evaluation_refuses_a_negative_margin(model_root: Layout) -> None:
    with pytest.raises(ValueError, match=r"evaluate\.promotion_margin=-0\.01"):
        evaluate(model_root, promotion_margin=-0.01)
    assert refused(model_root)


def test_incomparable_champion_is_kept_and_the_record_says_so(
    trained: Layout, mlflow_uri: str
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    client.create_registered_model("m")
    old = client.create_model_version("m", source=str(trained.root)).version
    client.set_model_version_tag("m", old, "eval.accuracy", "0.0")  # any candidate beats it
    client.set_model_version_tag("m", old, "eval.test_fingerprint", "b" * 64)
    client.set_registered_model_alias("m", CHAMPION, old)

    result = evaluate(trained)
    recorded = json.loads(trained.eval_summary.read_text())["promotion"]
    assert recorded == result["promotion"]
    assert recorded["promoted"] is False and recorded["comparable"] is False
    assert recorded["decision"] == "not comparable: champion kept"
    tags = client.get_run(result["eval_run_id"]).data.tags
    assert tags["promotion.decision"] == "not comparable: champion kept"
    assert tags["promotion.comparable"] == "false"
    # the run page opens on its description, which ends with the decision
    note = f"m v{result['model_version']}: **not comparable: champion kept**."
    assert note in tags["mlflow.note.content"]
    assert client.get_model_version_by_alias("m", CHAMPION).version == old


def test_rerun_after_a_crash_between_record_and_alias_completes_the_move(
    trained: Layout, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    real = MlflowClient.set_registered_model_alias
    crashes: list[str] = []

    def crash_once(self: MlflowClient, name: str, alias: str, version: str) -> None:
        if not crashes:
            crashes.append(version)
            raise RuntimeError("killed between the record and the alias move")
        real(self, name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", crash_once)
    with pytest.raises(RuntimeError, match="killed"):
        evaluate(trained)
    recorded = json.loads(trained.eval_summary.read_text())  # beside the numeric metrics
    assert recorded["promotion"]["promoted"] is True and recorded["model_version"] == "1"
    assert champion_version(client, "m") is None  # the decision is on disk, the alias is not

    result = evaluate(trained)
    assert crashes == ["1"]
    assert result["model_version"] == "1" and result["promotion"] == recorded["promotion"]
    assert champion_version(client, "m") == "1"


def test_recorded_decision_is_pending_only_while_the_alias_has_not_moved(tmp_path: Path) -> None:
    path = tmp_path / "eval_summary.json"
    decision = {"metric": "accuracy", "promoted": True, "champion_version": "1"}
    write_json(path, {"run_id": "r", "model_version": "2", "promotion": decision})

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
        path, {"run_id": "r", "model_version": "2", "promotion": {**decision, "promoted": False}}
    )
    assert pending() is None


# -- a fair comparison: the champion re-scored on today's test set, the same metric ----------


def test_top_k_change_rescores_the_champion_rather_than_comparing(registry: Registry) -> None:
    """The bug: v1 champion at top_k 1 (0.533); v2 at top_k 5 (0.8174) was promoted as
    comparable. A figure measured with another k is another metric: the champion is
    re-scored at the candidate's k on the candidate's test set, and keeps the alias."""
    registry.decide(0.533, metric="top_k_accuracy", definition="top_k_accuracy(top_k=1)")
    asked: list[str] = []

    def rescore(version: str) -> Rescored:
        asked.append(version)
        return Rescored(0.9)  # the champion's top-5 accuracy on the same test set

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
        0.9, test_set="b" * 64, rescore=lambda version: Rescored(0.6, answers=answers(0.6))
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
        return Rescored(0.7, answers=answers(0.7))

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


def register_champion(
    client: MlflowClient, layout: Layout, spec: Any, *, fingerprint: str, accuracy: float
) -> str:
    """The model of ``layout`` registered from a run of its own as ``m@champion``, with a
    recorded figure measured on test set ``fingerprint``."""
    from tasks.evaluate.registry import register_model
    from tasks.runtime import tracking

    run_id = client.create_run(tracking.experiment_id(client)).info.run_id
    version = register_model(client, run_id, layout.model_file, "m", spec)
    client.set_terminated(run_id)
    client.set_model_version_tag("m", version, "eval.accuracy", str(accuracy))
    client.set_model_version_tag("m", version, "eval.test_fingerprint", fingerprint)
    client.set_registered_model_alias("m", CHAMPION, version)
    return version


def current_spec(layout: Layout) -> Any:
    from tasks.contracts.manifest import load_manifest
    from tasks.predict import ServingSpec

    ingest = default_params().ingest
    return ServingSpec.from_manifest(load_manifest(layout.shards_dir), ingest)


def test_champion_on_older_test_data_is_rescored_on_todays_shards(
    trained: Layout, mlflow_uri: str
) -> None:
    """Growing data: the champion's recorded figure is on an older test set. Its model
    (the same one here) is scored on the current test shards, and the decision is made on
    that: the same model does not beat itself, and both figures are recorded."""
    client = MlflowClient(mlflow_uri, mlflow_uri)
    old = register_champion(
        client, trained, current_spec(trained), fingerprint="b" * 64, accuracy=0.0
    )

    result = evaluate(trained)
    decision = result["promotion"]
    assert decision["comparable"] is True and decision["champion_value_source"] == "rescored"
    assert decision["champion_value"] == pytest.approx(result["accuracy"])
    assert decision["champion_recorded_value"] == 0.0
    assert decision["promoted"] is False and decision["decision"] == "kept"
    assert str(client.get_model_version_by_alias("m", CHAMPION).version) == old
    tags = client.get_run(result["eval_run_id"]).data.tags
    assert tags["promotion.champion_value_source"] == "rescored"
    assert "re-scored on the current test set" in tags["promotion.champion_value_how"]
    recorded = json.loads(trained.eval_summary.read_text())["promotion"]
    assert recorded["champion_value"] == decision["champion_value"]


def test_champion_with_another_serving_spec_is_not_comparable_and_names_the_difference(
    trained: Layout, mlflow_uri: str, tmp_path: Path
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    other_model, other_spec = model_to_register(tmp_path)  # 8x8 inputs, classes a, b
    champion_layout = Layout(tmp_path / "champion")
    champion_layout.model_dir.mkdir(parents=True)
    champion_layout.model_file.write_bytes(other_model.read_bytes())
    register_champion(client, champion_layout, other_spec, fingerprint="b" * 64, accuracy=0.0)

    decision = evaluate(trained)["promotion"]
    assert decision["comparable"] is False and decision["promoted"] is False
    assert "image size and encoding: height=8, width=8" in decision["reason"]
    assert "height=16, width=16" in decision["reason"]
    assert "classes" in decision["reason"]


# -- classes that differ: the champion re-scored by class name -------------------------------


def colour_model(outputs: Sequence[str], colours: Sequence[str] | None = None) -> Any:
    """A Keras model over tiny-shard tiles whose output ``i`` is the class ``outputs[i]``
    and fires for the base colour ``colours[i]`` (default: its own): the nearest base colour
    to a tile's mean wins. Swapped colours make a model that is wrong on purpose."""
    import keras
    import numpy as np

    from tests.tiny_shards import BASE_COLOURS

    prototypes = np.array([BASE_COLOURS[c] for c in colours or outputs], np.float32).T / 255
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Rescaling(1.0 / 255),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(len(outputs), activation="softmax"),
        ]
    )
    # -|m - c|^2 up to a term every class shares, sharpened: the nearest colour wins.
    model.layers[-1].set_weights([40 * prototypes, -20 * (prototypes**2).sum(axis=0)])
    return model


def project(root: Path, classes: Sequence[str], candidate: Any) -> Layout:
    """Validated test shards of ``classes`` (in that order) under ``root``, ``candidate`` as
    the trained model and its finished training run in the tracking store."""
    from tasks.contracts.manifest import load_manifest
    from tasks.runtime import tracking
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(root, classes=classes, per_class={"train": 2, "val": 2, "test": 10})
    layout = Layout(root)
    layout.model_dir.mkdir(parents=True, exist_ok=True)
    candidate.save(layout.model_file)
    client = tracking.client(root)
    run_id = client.create_run(tracking.experiment_id(client)).info.run_id
    client.set_terminated(run_id)
    fingerprint = load_manifest(layout.shards_dir).fingerprint
    write_json(layout.train_run, {"run_id": run_id, "fingerprint": fingerprint})
    return layout


def register_colour_champion(
    client: MlflowClient, layout: Layout, root: Path, classes: Sequence[str]
) -> str:
    """A champion that tells ``classes`` (its own order) apart perfectly, with today's pixel
    spec, its recorded figure (a perfect 1.0) measured on an older test set."""
    from dataclasses import replace

    champion = Layout(root)
    champion.model_dir.mkdir(parents=True)
    colour_model(classes).save(champion.model_file)
    spec = replace(current_spec(layout), classes=list(classes))
    return register_champion(client, champion, spec, fingerprint="b" * 64, accuracy=1.0)


@pytest.mark.parametrize(
    ("candidate_colours", "promoted"),
    [(None, True), (["green", "red", "blue", "yellow"], False)],
    ids=["better-candidate", "worse-candidate"],
)
def test_a_champion_without_the_new_class_is_rescored_by_name_and_the_better_one_wins(
    tmp_path: Path, mlflow_uri: str, candidate_colours: list[str] | None, promoted: bool
) -> None:
    """The bug: after ``shard.mode: append`` added a class, the 3-class champion was "not
    comparable" with every 4-class candidate and stayed champion for ever. It is re-scored on
    today's 4-class test shards by class name: right on red, green and blue, wrong on every
    yellow record (a class it does not know), so 0.75. A perfect candidate (1.0) beats it; one
    that swaps red and green (0.5) does not."""
    today = ["red", "green", "blue", "yellow"]  # yellow appended
    layout = project(tmp_path, today, colour_model(today, candidate_colours))
    client = MlflowClient(mlflow_uri, mlflow_uri)
    old = register_colour_champion(client, layout, tmp_path / "champion", today[:3])

    result = evaluate(layout)

    decision = result["promotion"]
    assert result["accuracy"] == (1.0 if promoted else 0.5)
    assert decision["comparable"] is True and decision["champion_value_source"] == "rescored"
    assert decision["champion_value"] == pytest.approx(0.75)
    assert decision["promoted"] is promoted
    assert decision["class_differences"]["unknown_to_champion"] == ["yellow"]
    assert decision["class_differences"]["unknown_today"] == []
    assert "does not know yellow" in decision["champion_value_how"]
    assert json.loads(layout.eval_summary.read_text())["promotion"] == decision
    assert "does not know yellow" in layout.model_card.read_text()
    champion = str(client.get_model_version_by_alias("m", CHAMPION).version)
    assert champion == (result["model_version"] if promoted else old)
    if promoted:  # 10 yellow records only the candidate gets right: p = 2**-10
        evidence = decision["evidence"]
        assert evidence["p_value"] == pytest.approx(2**-10) and evidence["test_records"] == 40
        # the decision record: the version's tags, the evaluation run's, the card
        run_tags = client.get_run(result["eval_run_id"]).data.tags
        version_tags = client.get_model_version("m", result["model_version"]).tags
        for tags in (run_tags, version_tags):
            assert "McNemar on 10 discordant records" in tags["promotion.method"]
            assert float(tags["promotion.p_value"]) == pytest.approx(2**-10)
            assert tags["promotion.ci"].startswith("90% CI +")
            assert tags["promotion.test_records"] == "40"
        assert "p-value 0.0009766" in layout.model_card.read_text()


def test_a_new_dataset_starts_its_own_lineage_and_the_demo_champion_is_untouched(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """The bug: after switching ingest.source_dir to another photo set, its first model took
    `shardflow@champion` from the demo's. With evaluate.model_name null it goes to the
    registered model named after its dataset, whose first version it becomes."""
    from tasks.runtime.dataset_identity import dataset_identity, dataset_slug

    classes = ["red", "green", "blue"]
    layout = project(tmp_path, classes, colour_model(classes))
    client = MlflowClient(mlflow_uri, mlflow_uri)
    register_colour_champion(client, layout, tmp_path / "demo", classes)
    client.rename_registered_model("m", "shardflow")  # the demo's lineage, champion v1

    params = default_params(ingest={"source_dir": "data/photos"})
    result = run_evaluate(params, layout)

    own = f"shardflow-{dataset_slug(dataset_identity('data/photos', None, tmp_path))}"
    decision = result["promotion"]
    assert decision["model_name"] == own and decision["promoted"] is True
    assert champion_version(client, own) == result["model_version"] == "1"
    assert champion_version(client, "shardflow") == "1"
    assert len(client.search_model_versions("name = 'shardflow'")) == 1


def test_the_same_classes_in_another_order_are_comparable_and_the_better_champion_stays(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """The bug: a rebuild (or ``make compact``) sorts the classes by name where appends had
    kept the base order; the same classes in another order made every candidate "not
    comparable" for ever. The champion is re-scored by class name (not by output position,
    which would score it 1/3): perfect, it stays champion over a candidate that swaps red and
    green."""
    today = ["blue", "green", "red"]  # sorted, as ingest orders them
    layout = project(tmp_path, today, colour_model(today, ["blue", "red", "green"]))
    client = MlflowClient(mlflow_uri, mlflow_uri)
    old = register_colour_champion(client, layout, tmp_path / "champion", ["red", "green", "blue"])

    result = evaluate(layout)

    decision = result["promotion"]
    assert result["accuracy"] == pytest.approx(1 / 3)
    assert decision["comparable"] is True and decision["champion_value_source"] == "rescored"
    assert decision["champion_value"] == 1.0
    assert decision["promoted"] is False and decision["decision"] == "kept"
    assert decision["class_differences"]["order_differs"] is True
    assert "another order" in decision["champion_value_how"]
    assert "another order" in layout.model_card.read_text()
    assert str(client.get_model_version_by_alias("m", CHAMPION).version) == old


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


def test_changed_evaluate_params_reevaluate_the_same_training_run(
    trained: Layout, mlflow_uri: str
) -> None:
    """Evaluation's params live on its own run (a child of the training run): a changed
    evaluate.* param evaluates again instead of failing on "Changing param values"."""
    client = MlflowClient(mlflow_uri, mlflow_uri)
    first = evaluate(trained, top_k=1)
    second = evaluate(trained, top_k=2, allow_incomparable_promotion=True)

    train_run_id = json.loads(trained.train_run.read_text())["run_id"]
    assert first["run_id"] == second["run_id"] == train_run_id
    assert first["eval_run_id"] != second["eval_run_id"]
    for result, top_k in ((first, "1"), (second, "2")):
        run = client.get_run(result["eval_run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.params["evaluate.top_k"] == top_k
        # counts and settings are tags, never metrics to chart
        assert run.data.tags["test.records"] == "30" and run.data.tags["test.top_k"] == top_k
        assert "test_num_test_records" not in run.data.metrics
        assert "test_top_k" not in run.data.metrics and "test_accuracy" in run.data.metrics
        assert run.data.tags["mlflow.parentRunId"] == train_run_id
    training = client.get_run(train_run_id)
    assert training.info.status == "FINISHED"
    assert not any(key.startswith("evaluate.") for key in training.data.params)
    assert training.data.tags["eval.latest_run_id"] == second["eval_run_id"]


def test_a_failed_evaluation_marks_its_run_failed(
    trained: Layout, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.evaluate.stage

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("registry unreachable")

    monkeypatch.setattr(tasks.evaluate.stage, "register_model", broken)
    with pytest.raises(RuntimeError, match="registry unreachable"):
        evaluate(trained)
    client = MlflowClient(mlflow_uri, mlflow_uri)
    train_run_id = json.loads(trained.train_run.read_text())["run_id"]
    evaluations = client.search_runs(
        [client.get_run(train_run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{train_run_id}'",
    )
    assert [run.info.status for run in evaluations] == ["FAILED"]
    assert client.get_run(train_run_id).info.status == "FINISHED"  # untouched
    # The pyfunc logged while measuring, never registered, is not left on the run.
    experiment = client.get_run(train_run_id).info.experiment_id
    assert client.search_logged_models([experiment]) == []


def test_a_failure_after_registering_keeps_the_versions_model(
    trained: Layout, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.evaluate.stage

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("store went away")

    monkeypatch.setattr(tasks.evaluate.stage, "log_test_results", broken)
    with pytest.raises(RuntimeError, match="store went away"):
        evaluate(trained)
    client = MlflowClient(mlflow_uri, mlflow_uri)
    [version] = client.search_model_versions("name = 'm'")
    experiment = client.get_run(version.run_id).info.experiment_id
    made_from = version.source.removeprefix("models:/")  # the logged model's id
    assert [m.model_id for m in client.search_logged_models([experiment])] == [made_from]
    # The rerun reuses that version, and its model.
    monkeypatch.undo()
    assert evaluate(trained)["model_version"] == str(version.version)
    assert [m.model_id for m in client.search_logged_models([experiment])] == [made_from]


def test_the_pyfunc_a_killed_evaluation_logged_is_deleted_by_the_next_one_of_its_workspace(
    trained: Layout, mlflow_uri: str
) -> None:
    """SIGKILLed between logging its pyfunc and registering it, an evaluation leaves the
    pyfunc on the training run. The next evaluation in the same workspace (the workspace
    lock lets no other one run there) deletes it; another workspace's, which may be an
    evaluation still running elsewhere, is left alone."""
    from tasks.contracts.manifest import load_manifest
    from tasks.evaluate.registry import log_due_pyfunc, workspace_id
    from tasks.predict import ServingSpec

    client = MlflowClient(mlflow_uri, mlflow_uri)
    train_run_id = json.loads(trained.train_run.read_text())["run_id"]
    experiment = client.get_run(train_run_id).info.experiment_id
    spec = ServingSpec.from_manifest(load_manifest(trained.shards_dir), default_params().ingest)
    log = partial(log_due_pyfunc, client, train_run_id, trained.model_file, "m", spec)
    killed = log(workspace_id(trained.root))
    elsewhere = log(workspace_id(trained.root / "another_clone"))
    assert killed and elsewhere

    result = evaluate(trained)

    made_from = client.get_model_version("m", result["model_version"]).source
    left = {f"models:/{m.model_id}" for m in client.search_logged_models([experiment])}
    assert left == {made_from, elsewhere}
    assert made_from not in {killed, elsewhere}  # its own, logged anew


def test_an_evaluation_killed_before_it_could_end_its_run_is_marked_killed(
    trained: Layout, mlflow_uri: str
) -> None:
    """A SIGKILLed evaluation leaves its run RUNNING; the next evaluation of the same
    training run ends it KILLED, so no run stays RUNNING for ever."""
    from tasks.evaluate.tracking import start_evaluation_run

    client = MlflowClient(mlflow_uri, mlflow_uri)
    train_run_id = json.loads(trained.train_run.read_text())["run_id"]
    killed = start_evaluation_run(client, train_run_id, default_params().evaluate)
    result = evaluate(trained)
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(result["eval_run_id"]).info.status == "FINISHED"


def test_no_run_stays_running_after_an_evaluation_killed_while_logging_the_model(
    trained: Layout, mlflow_uri: str
) -> None:
    """Logging the pyfunc reopens the training run (``mlflow.start_run(run_id=...)``); a
    kill before it is ended again leaves it RUNNING in the store, as here. The next
    evaluation leaves no run of the experiment RUNNING."""
    client = MlflowClient(mlflow_uri, mlflow_uri)
    train_run_id = json.loads(trained.train_run.read_text())["run_id"]
    client.update_run(train_run_id, status="RUNNING")  # the store after that kill
    assert client.get_run(train_run_id).info.status == "RUNNING"
    evaluate(trained)
    experiment = client.get_run(train_run_id).info.experiment_id
    statuses = {r.info.run_id: r.info.status for r in client.search_runs([experiment])}
    assert statuses[train_run_id] == "FINISHED"
    assert "RUNNING" not in statuses.values()


# -- the card and the label review, per registered version ---------------------------------


def test_each_registered_version_gets_a_model_and_data_card(
    trained: Layout, mlflow_uri: str
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    write_json(
        trained.ingest_report,
        {
            "files_found": 125,
            "accepted": 120,
            "quarantined_count": 3,
            "duplicate_count": 2,
            "quarantined": [{"path": f"x{i}.jpg", "reason": "not an image"} for i in range(3)],
        },
    )
    result = evaluate(trained)
    card = trained.model_card.read_text()
    description = client.get_model_version("m", result["model_version"]).description
    assert description == card
    logged = {a.path for a in client.list_artifacts(result["eval_run_id"], "card")}
    assert logged == {"card/model_card.md"}
    for section in ("## Data", "## Source files", "## Label review", "## Known limits"):
        assert section in card
    assert "| red | 24 | 6 | 10 |" in card  # counts per class and split
    assert "3 quarantined" in card and "3 x not an image" in card
    assert "preprocessing version `synthetic (tests/tiny_shards.py)`" in card
    assert "no champion yet" in card  # the comparison, and how it was made
    assert f"| red | {result['per_class'][0]['precision']:.3f} |" in card
    assert "| **all** | 72 | 18 | 30 |" in card and "Generations:" in card


def test_label_review_lands_in_reports_plots_and_the_evaluation_run(
    trained: Layout, mlflow_uri: str
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    result = evaluate(trained)
    header = trained.label_issues.read_text().splitlines()[0]
    assert header == "split,path,given_label,suggested_label,score,suggested_score,kind"
    assert (trained.eval_dir / "label_issues.png").stat().st_size > 0
    logged = {a.path for a in client.list_artifacts(result["eval_run_id"], "label_review")}
    assert logged == {"label_review/label_issues.csv"}
    assert result["label_review"]["reviewed"] == {"val": 18, "test": 30}
    lines = trained.label_issues.read_text().splitlines()[1:]
    errors = sum(1 for line in lines if line.endswith(",likely label error"))
    assert json.loads(trained.eval_metrics.read_text())["label_issues"] == errors  # not confusions
    recorded = json.loads(trained.eval_summary.read_text())
    assert recorded["label_review"] == result["label_review"]
