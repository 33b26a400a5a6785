"""Promotion through the evaluate stage on a model trained from tiny shards: refusals, rescoring,
kills and cards with a real MLflow run (the decision and the registry:
tests/unit/evaluate/test_promotion.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tasks.contracts.validated_shards import ModelNotFromTheseShards, ShardsNotValidated
from tasks.evaluate.promotion_lock import LOCK_SUFFIX, promotion_lock
from tasks.evaluate.seen_records import (
    SeenRecords,
    log_seen_records,
    recorded_seen_records,
    seen_records_of,
    split_hashes,
)
from tasks.evaluate.stage import run_evaluate
from tasks.evaluate.store_check import REBUILD
from tasks.evaluate.tracking import TrainingRunNotInStore
from tasks.runtime.atomic import write_json
from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.runtime.tracking import CHAMPION, champion_version
from tests.unit.evaluate import test_promotion as unit_promotion
from tests.unit.evaluate.test_promotion import Registry, model_to_register, store_with_runs

pytestmark = pytest.mark.slow


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
    # the tiny test split has 30 records: a comparison may count as few as 10
    base = default_params(evaluate={"model_name": "m", "min_unseen_records": 10})
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


def register_champion(
    client: MlflowClient,
    layout: Layout,
    spec: Any,
    *,
    fingerprint: str,
    accuracy: float,
    seen: SeenRecords | None = None,
) -> str:
    """The model of ``layout`` registered from a run of its own as ``m@champion``, with a
    recorded figure measured on test set ``fingerprint``; it trained and validated on the
    records ``seen`` (by default none of today's test records)."""
    from tasks.evaluate.registry import register_model
    from tasks.runtime import tracking

    run_id = client.create_run(tracking.experiment_id(client)).info.run_id
    version = register_model(client, run_id, layout.model_file, "m", spec)
    seen = seen or SeenRecords("b" * 64, frozenset({"0" * 64}), frozenset())
    log_seen_records(client, run_id, "m", version, seen)
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


def test_a_champion_is_compared_only_on_the_test_records_neither_model_saw(
    trained: Layout, mlflow_uri: str
) -> None:
    """The split moved since the champion was trained: 8 of today's 30 test records were in
    its training split (its logged seen records say so). Both models are compared on the 22
    neither saw; the record, the evaluation run and the summary say how many were left out
    and why; metrics/eval.json keeps the figure on all 30. The new version logs its own
    training and validation records' hashes, as a fresh clone will need them."""
    from tasks.contracts.manifest import load_manifest

    client = MlflowClient(mlflow_uri, mlflow_uri)
    today = seen_records_of(trained.shards_dir, load_manifest(trained.shards_dir))
    tested = split_hashes(trained.shards_dir, "test", None)
    moved = SeenRecords("b" * 64, today.train | frozenset(tested[:8]), today.val)
    register_champion(
        client, trained, current_spec(trained), fingerprint="b" * 64, accuracy=0.0, seen=moved
    )

    result = evaluate(trained)
    decision = result["promotion"]
    assert decision["comparable"] is True and decision["champion_value_source"] == "rescored"
    assert decision["unseen"]["left_out_records"] == 8
    assert decision["unseen"]["left_out_champion_saw"] == 8
    assert decision["unseen"]["unseen_records"] == decision["evidence"]["test_records"] == 22
    assert (
        "8 of 30 test records left out (8 trained or validated on by champion v1"
        in (decision["reason"])
    )
    assert json.loads(trained.eval_metrics.read_text())["num_test_records"] == 30
    assert (
        json.loads(trained.eval_summary.read_text())["promotion"]["unseen"] == (decision["unseen"])
    )
    tags = client.get_run(result["eval_run_id"]).data.tags
    assert tags["promotion.left_out_records"] == "8"
    assert "trained or validated on by champion v1" in tags["promotion.left_out_why"]
    assert recorded_seen_records(client, "m", result["model_version"]) == today


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


registry = unit_promotion.registry  # the unit tests' fixture, shared
store = unit_promotion.store  # the unit tests' fixture, shared


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
    first_holds = threading.Event()
    read_holder = promotion_lock_module._lock_holder_tag

    def slow_reader(client: MlflowClient, name: str) -> str | None:
        held_by = read_holder(client, name)
        if held_by == dead and not getattr(me, "waited", False):
            me.waited = True
            both_saw_it.wait()  # neither has deleted the dead lock yet
            if me.second:  # ...and the second acts once the first holds the lock anew
                first_holds.wait(20)
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
                if not me.second:
                    first_holds.set()
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


def test_registering_the_same_run_twice_reuses_its_version(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    new_mlflow_store: Callable[[Path], str],
) -> None:
    """A retried or repeated evaluation must not add a duplicate registry version."""
    from tasks.evaluate.registry import register_model

    client, runs = store_with_runs(new_mlflow_store, tmp_path, "mlflow.db", 2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
    model_file, spec = model_to_register(tmp_path)
    first = register_model(client, runs[0], model_file, "m", spec)
    again = register_model(client, runs[0], model_file, "m", spec)
    other = register_model(client, runs[1], model_file, "m", spec)
    assert first == again == "1" and other == "2"


def test_a_pyfunc_logged_early_is_deleted_when_another_evaluation_registered_first(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    new_mlflow_store: Callable[[Path], str],
) -> None:
    """Two evaluations of one training run, both logging their pyfunc while measuring: the
    one that registers second reuses the first one's version and must not leave its own
    pyfunc behind, unregistered, on the run."""
    from tasks.evaluate.registry import log_due_pyfunc, register_model

    client, runs = store_with_runs(new_mlflow_store, tmp_path, "mlflow.db", 1)
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
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    new_mlflow_store: Callable[[Path], str],
) -> None:
    """Registering in the client's store must not point the process, or the children it
    starts later, at that store (their ``models:/m@champion`` would resolve there), nor end
    the run that evaluation is still logging to."""
    import mlflow

    from tasks.evaluate.registry import register_model

    client, runs = store_with_runs(new_mlflow_store, tmp_path, "project.db", 1)
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
