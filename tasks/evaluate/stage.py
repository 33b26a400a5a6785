"""Evaluate stage: test-split metrics, label review, reports and plots, then promotion.

``tasks.evaluate.measurement.evaluate_model`` is the pure core (model + shards in, metrics
and report files out); ``run_evaluate`` wires it to the layout and to an MLflow run of its
own (a child of the training run, :mod:`tasks.evaluate.tracking`), behind the same
validation gate as training, registers the model (:mod:`tasks.evaluate.registry`), writes
its card, and lets :mod:`tasks.evaluate.promotion` decide on the ``champion`` alias,
re-scoring the champion's model on the current test shards (:func:`champion_scorer`) when
its recorded figure was measured on other data or another way. Each version logs the hashes
of its training and validation records (:mod:`tasks.evaluate.seen_records`): the comparison
counts only the test records neither model saw.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.contracts.run_records import dvc_experiment
from tasks.contracts.shard_store import open_store
from tasks.contracts.validated_shards import (
    check_model_matches,
    check_validated,
    check_validated_store,
)
from tasks.evaluate.evidence import Answers, answers_of
from tasks.evaluate.measurement import evaluate_model, predict_split
from tasks.evaluate.metrics import class_columns, metrics_by_name
from tasks.evaluate.promotion import (
    Figure,
    NotComparable,
    PromotionDecision,
    Rescored,
    Rules,
    check_margin,
    class_differences,
    decide,
    metric_definition,
    no_seen_records,
    pending_decision,
    promote,
    recorded_classes,
    recorded_definition,
    spec_differences,
)
from tasks.evaluate.registry import (
    discard_logged,
    download_registered,
    log_due_pyfunc,
    logged_model_id,
    register_model,
    registered_sources,
    workspace_id,
)
from tasks.evaluate.seen_records import log_seen_records, recorded_seen_records
from tasks.evaluate.tracking import (
    end_abandoned_model_logging,
    log_decision,
    log_test_results,
    start_evaluation_run,
    training_run,
    write_card,
)
from tasks.runtime import processes
from tasks.runtime.atomic import write_json
from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.layout import Layout
from tasks.runtime.metrics_files import is_number
from tasks.runtime.params import Params
from tasks.runtime.processes import Later
from tasks.runtime.tracking import champion_version
from tasks.train.summary import TrainRunRecord

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from tasks.contracts.manifest import ShardManifest
    from tasks.contracts.shard_store import ShardStore
    from tasks.predict import ServingSpec


# -- the champion, re-scored ---------------------------------------------------------------


def champion_scorer(
    client: MlflowClient,
    model_name: str,
    spec: ServingSpec,
    shards_dir: Path,
    *,
    figure: Figure,
    top_k: int,
    store: ShardStore | None = None,
) -> Callable[[str], Rescored]:
    """``rescore(version)``: that version's ``metric`` on the current test shards (read
    from ``store`` when there is one), its classes matched to today's by name
    (:func:`metrics_by_name`), how they differed, and its answers on each record (the
    records in the order the candidate's were read: :func:`predict_split`'s). A version
    measured as ``figure`` on the same test set has its answers recorded already
    (:func:`recorded_answers`): they are used, and no model is loaded.

    Loads the version's Keras model from the registry (never a source image: the shards are
    the input) after checking that its serving spec describes the current shards' pixels;
    raises :class:`NotComparable` naming what differs, or why the model could not be loaded,
    and :class:`tasks.evaluate.promotion.NoSeenRecords` (before loading anything) when the
    version logged no hashes of the records it trained and validated on.
    """

    def rescore(version: str) -> Rescored:
        seen = recorded_seen_records(client, model_name, version)
        if seen is None:
            raise no_seen_records(version)
        kept = recorded_answers(client, model_name, version, figure)
        if kept is not None:
            return replace(kept, seen=seen)
        with tempfile.TemporaryDirectory() as tmp:
            model_file, recorded = download_registered(client, model_name, version, Path(tmp))
            classes = scorable_classes(recorded, spec)
            from tasks.runtime.tf_imports import keras_without_extras

            try:
                model = keras_without_extras().saving.load_model(model_file, compile=False)
            except (ValueError, OSError, TypeError) as exc:
                raise NotComparable(f"its Keras model does not load here ({exc})") from None
            if model.output_shape[-1] != len(classes):
                raise NotComparable(
                    f"its model has {model.output_shape[-1]} outputs for {len(classes)} classes"
                )
            labels, probs, _ = predict_split(model, shards_dir, store=store)
        figures = metrics_by_name(labels, probs, classes, spec.classes, top_k=top_k)
        columns = class_columns(classes, spec.classes)
        return Rescored(
            float(figures[figure.metric]),
            class_differences(classes, spec.classes),
            answers_of(labels, probs, figures["top_k"], len(spec.classes), columns),
            tuple(classes),
            seen=seen,
        )

    return rescore


ANSWERS_ARTIFACT = "eval/answers.json"  # on an evaluation run: each test record's answers
ANSWERS_RUN_TAG = "eval.answers_run_id"  # on a version: the evaluation run that holds them


def record_answers(
    client: MlflowClient, model_name: str, version: str, run_id: str, answers: Answers
) -> None:
    """Keep the version's answers on each test record (an artifact of its evaluation run,
    named by a version tag): a later candidate on the same test set compares with them
    without loading this model again."""
    client.log_dict(run_id, answers.to_dict(), ANSWERS_ARTIFACT)
    client.set_model_version_tag(model_name, version, ANSWERS_RUN_TAG, run_id)


def recorded_answers(
    client: MlflowClient, model_name: str, version: str, figure: Figure
) -> Rescored | None:
    """The champion's recorded figure with its recorded answers, when it was measured as
    ``figure`` (the same definition) on the same test set, so on the same records in the
    same order; else None (it must be re-scored)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from tasks.runtime.tracking import using_store

    tags = client.get_model_version(model_name, version).tags
    run_id, value = tags.get(ANSWERS_RUN_TAG), tags.get(f"eval.{figure.metric}")
    same = tags.get("eval.test_fingerprint") == figure.test_fingerprint and (
        recorded_definition(tags, figure.metric) == figure.definition
    )
    if not (same and run_id and value):
        return None
    try:
        with using_store(client.tracking_uri):
            data = mlflow.artifacts.load_dict(f"runs:/{run_id}/{ANSWERS_ARTIFACT}")
    except (MlflowException, OSError, ValueError):
        return None  # deleted or unreadable: re-scoring still can
    answers = Answers.from_dict(data)
    if figure.answers is None or not np.array_equal(answers.labels, figure.answers.labels):
        return None
    where = f"{ANSWERS_ARTIFACT} of evaluation run {run_id}"
    return Rescored(float(value), None, answers, recorded_classes(tags), recorded=where)


def scorable_classes(recorded: dict[str, Any], spec: ServingSpec) -> list[str]:
    """The classes of a champion whose serving spec ``recorded`` describes the pixels of
    ``spec`` (the current shards'); else :class:`NotComparable` naming what differs (and
    how its classes differ too, when they do)."""
    classes = recorded.get("classes")
    if not isinstance(classes, list) or not classes:
        raise NotComparable("its serving spec names no classes")
    differences = spec_differences(recorded, spec.to_dict())
    if differences:
        also = class_differences(classes, spec.classes)
        too = f"; its classes differ too: {also['in_words']}" if also else ""
        raise NotComparable(
            f"its serving spec differs from the current shards' ({'; '.join(differences)}){too}"
        )
    return [str(name) for name in classes]


# -- tracking ------------------------------------------------------------------------------

# What the measuring returns that the record and the flow's result do not hold: per-record
# answers and hashes, the seen records, the matrix (logged as a plot and a table).
PER_RECORD = ("confusion_matrix", "answers", "test_hashes", "seen")


def summary_record(result: dict[str, Any]) -> dict[str, Any]:
    """What ``metrics/eval.json`` cannot hold: runs, version, test data, decision, review."""
    keys = ("run_id", "eval_run_id", "model_version", "test_fingerprint", "promotion")
    return {**{key: result[key] for key in keys}, "label_review": result["label_review"]}


# -- the stage -----------------------------------------------------------------------------


def warm_up() -> None:
    """What :func:`measure` imports before its work: Keras (TensorFlow with it) and
    Matplotlib, seconds of imports. ``python -m flows.evaluate`` has a child process run this while
    the stage imports Prefect, then sends it :func:`measure`."""
    from tasks.runtime.tf_imports import keras_without_extras

    keras_without_extras()
    from matplotlib.figure import Figure  # noqa: F401


def measure(
    params: Params, layout: Layout, progress: Callable[[int, int], object] | None = None
) -> dict[str, Any]:
    """The trained model on the test split: its metrics, the per-class reports and plots,
    every test prediction and the label review, in the layout's files. TensorFlow, no
    tracking: :func:`run_evaluate` may start it in another process
    (:func:`tasks.runtime.latency.start_where_warm`) and open the tracking store meanwhile.

    ``progress(done, total)``: the records predicted (:func:`evaluate_model`); in a child
    without it, each goes to the parent as ``(done, total)``
    (:func:`tasks.runtime.processes.report`).
    """
    if progress is None and processes.reporting():

        def progress(done: int, total: int) -> None:
            processes.report((done, total))

    return evaluate_model(
        layout.model_file,
        layout.shards_dir,
        layout.eval_dir,
        top_k=params.evaluate.top_k,
        predictions_file=layout.test_predictions,
        store=open_store(layout.root, params.storage),
        label_issues_file=layout.label_issues,
        min_class_review_accuracy=params.evaluate.min_class_review_accuracy,
        seen_records=True,
        progress=progress,
    )


def run_evaluate(
    params: Params, layout: Layout, start: Callable[..., Any] = Later
) -> dict[str, Any]:
    """Evaluate the trained model in an MLflow run of its own, register it and maybe promote.

    Refuses (before any tracking) shards no passing validation vouches for and a model
    trained on other shards. The evaluation run is a child of the training run; it ends
    FAILED (and the error propagates) if anything after its start fails. ``start(measure,
    params, layout)`` starts the measuring (:func:`measure`), its value from ``.result()``:
    here by default, when asked; the stage starts it in its prestarted child, and this
    process opens the tracking store (MLflow's imports, its database) and, when a version is
    due, logs the pyfunc onto the training run meanwhile
    (:func:`tasks.evaluate.registry.log_due_pyfunc`; deleted again if the measuring fails). It never
    imports Keras to register the model (:func:`tasks.predict.log_pyfunc`), only to re-score
    a champion measured on other data.
    """
    settings = params.evaluate
    check_margin(settings.promotion_margin)
    model_name = model_name_for(params, layout.root)
    store, manifest, record = validated_model(params, layout)
    measuring = start(measure, params, layout)
    from tasks.predict import ServingSpec
    from tasks.runtime import tracking

    logged = None
    try:
        client = tracking.client(layout.root)
        runs = {"training": record.run_id}
        # the store opens meanwhile
        end_abandoned_model_logging(client, training_run(client, runs["training"], layout))
        spec = ServingSpec.from_manifest(manifest, params.ingest)
        logged = log_due_pyfunc(
            client,
            runs["training"],
            layout.model_file,
            model_name,
            spec,
            workspace_id(layout.root),
        )
        metrics = measuring.result()
        if settings.promotion_metric not in metrics:
            raise KeyError(
                f"evaluate.promotion_metric={settings.promotion_metric!r} is not an eval "
                "metric; choose one of accuracy, top_k_accuracy, macro_f1, macro_precision, "
                "macro_recall"
            )
    except BaseException:
        measuring.cancel()  # a child still measuring writes no more reports (a retry will)
        if logged is not None:
            discard_logged(client, logged)
        raise
    measured = Measured(client, runs, params, layout, manifest, metrics, store, spec, logged)
    result = evaluation_run(measured)
    urls = {
        key: tracking.run_url(client, runs[key], layout.root) for key in ("training", "evaluation")
    }
    return {**result, "run_url": urls["training"], "eval_run_url": urls["evaluation"]}


def validated_model(
    params: Params, layout: Layout
) -> tuple[ShardStore | None, ShardManifest, TrainRunRecord]:
    """The store the shards are read from (SHARDFLOW_SHARDS_URL, else None: data/shards),
    their manifest, which a passing validation must vouch for, and the training run's
    record, whose model must have been trained on those shards."""
    store = open_store(layout.root, params.storage)
    if store:
        manifest = check_validated_store(store, layout.validation_report)
    else:
        manifest = check_validated(layout.shards_dir, layout.validation_report)
    record = TrainRunRecord.load(layout.train_run)
    check_model_matches(record.to_json(), manifest, layout.train_run)
    return store, manifest, record


@dataclass(frozen=True)
class Measured:
    """A measured model on its way into the registry: what registering, logging, deciding
    and recording it read (:func:`evaluation_run`, :func:`track_evaluation`,
    :func:`promotion_decision`)."""

    client: MlflowClient
    runs: dict[str, str]  # "training"; "evaluation" once that run is started
    params: Params
    layout: Layout
    manifest: ShardManifest
    metrics: dict[str, Any]
    store: ShardStore | None
    spec: ServingSpec
    logged: str | None = None  # the pyfunc logged onto the training run ahead, if any


def evaluation_run(measured: Measured) -> dict[str, Any]:
    """:func:`track_evaluation` in an evaluation run of its own (added to ``runs``), a child
    of the training run: FINISHED, else KILLED or FAILED with the error propagated (and the
    pyfunc ``logged`` for it deleted when no version was made from it)."""
    client, runs, logged = measured.client, measured.runs, measured.logged
    try:
        runs["evaluation"] = start_evaluation_run(
            client, runs["training"], measured.params.evaluate
        )
        result = track_evaluation(measured)
    except BaseException as exc:
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        with contextlib.suppress(Exception):  # the original error is the one to see
            if "evaluation" in runs:
                client.set_terminated(runs["evaluation"], status=status)
        with contextlib.suppress(Exception):
            if logged is not None and logged not in registered_sources(client, runs["training"]):
                discard_logged(client, logged)  # failed before a version was made from it
        raise
    client.set_terminated(runs["evaluation"], status="FINISHED")
    return result


def track_evaluation(measured: Measured) -> dict[str, Any]:
    """Register (``logged``: the pyfunc logged already), log, decide (re-scoring the
    champion where needed), record, then move the alias, the last three under the registry's
    promotion lock. The decision reaches ``reports/eval_summary.json`` and the evaluation run
    before the alias moves, so a crash in between leaves a record the rerun completes."""
    client, runs, layout = measured.client, measured.runs, measured.layout
    manifest, metrics, store = measured.manifest, measured.metrics, measured.store
    model_name = model_name_for(measured.params, layout.root)
    version = register_model(
        client, runs["training"], layout.model_file, model_name, measured.spec, measured.logged
    )
    log_seen_records(client, runs["training"], model_name, version, metrics["seen"])
    model_id = logged_model_id(client, runs["training"], model_name, version)
    client.log_artifacts(runs["evaluation"], str(layout.eval_dir), "eval")
    source = store.url if store else layout.shards_dir
    log_test_results(client, runs, model_id, metrics, manifest, source)
    # per-record answers and the matrix stay here: the record, the flow's result are summaries
    result = {k: v for k, v in metrics.items() if k not in PER_RECORD}

    def record(decision: PromotionDecision) -> None:
        """The record before the alias moves: a crash after it is resumable."""
        result.update(
            promotion=decision.to_json(), run_id=runs["training"], eval_run_id=runs["evaluation"]
        )
        result["model_version"] = version
        result["label_issues"] = sum(metrics["label_review"]["flagged"].values())  # a DVC metric
        # DVC metrics take the numbers only.
        write_json(layout.eval_metrics, {k: v for k, v in result.items() if is_number(v)})
        write_json(layout.eval_summary, summary_record(result))
        log_decision(client, runs["evaluation"], model_name, version, decision)
        record_answers(client, model_name, version, runs["evaluation"], metrics["answers"])
        write_card(client, runs, layout, manifest, result)

    # Read the champion, compare, record and move the alias under the registry's lock.
    promote(
        client,
        model_name,
        lambda: promotion_decision(measured, version),
        record,
    )
    client.set_tag(runs["training"], "eval.latest_run_id", runs["evaluation"])
    for path in (layout.eval_metrics, layout.eval_summary, layout.test_predictions):
        client.log_artifact(runs["evaluation"], str(path), "eval")
    client.log_artifact(runs["evaluation"], str(layout.label_issues), "label_review")
    return result


def promotion_decision(measured: Measured, version: str) -> PromotionDecision:
    """A decision recorded but not applied for this run and version, else a new one."""
    client, params, layout = measured.client, measured.params, measured.layout
    metrics, spec, store = measured.metrics, measured.spec, measured.store
    run_id = measured.runs["training"]
    settings, model_name = params.evaluate, model_name_for(params, layout.root)
    metric = settings.promotion_metric
    definition = metric_definition(metric, metrics)
    figure = Figure(
        metric,
        definition,
        float(metrics[metric]),
        metrics["test_fingerprint"],
        tuple(spec.classes),
        metrics.get("answers"),
        metrics.get("test_hashes"),
        metrics.get("seen"),
    )
    rules = Rules(
        margin=settings.promotion_margin,
        alpha=settings.promotion_alpha,
        min_shared_class_share=settings.min_shared_class_share,
        allow_incomparable=settings.allow_incomparable_promotion,
        min_unseen_records=settings.min_unseen_records,
    )
    rescore = champion_scorer(
        client,
        model_name,
        spec,
        layout.shards_dir,
        figure=figure,
        top_k=metrics["top_k"],
        store=store,
    )
    decision = pending_decision(
        layout.eval_summary,
        run_id=run_id,
        version=version,
        metric=metric,
        definition=definition,
        champion=champion_version(client, model_name),
    ) or decide(
        client,
        model_name,
        version,
        figure,
        rules=rules,
        rescore=rescore,
        experiment=dvc_experiment(),
    )
    return replace(decision, model_name=model_name)
