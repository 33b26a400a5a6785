"""Evaluate stage: test-split metrics, reports and plots, then registry promotion.

``evaluate_model`` is the pure core (model + shards in, metrics and report files out);
``decide`` says whether a registered version takes the ``champion`` alias (only on a fair
comparison) and ``apply_decision`` moves it; ``run_evaluate`` wires them to the layout and
to the training run in MLflow, behind the same validation gate as training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.atomic import write_json
from tasks.gate import check_model_matches, check_validated, check_validated_store
from tasks.layout import Layout
from tasks.manifest import load_manifest
from tasks.metrics_files import is_number
from tasks.params import EvaluateParams, Params, flatten
from tasks.reader import read_split
from tasks.schema import IMAGE_KEY, LABEL_KEY, SOURCE_KEY
from tasks.shard_store import open_store
from tasks.tracking import CHAMPION as CHAMPION  # re-exported: the alias promotion moves
from tasks.tracking import champion_version as champion_version

if TYPE_CHECKING:
    import keras
    from mlflow import MlflowClient

    from tasks.manifest import ShardManifest
    from tasks.predict import ServingSpec
    from tasks.shard_store import ShardStore

MAX_MISCLASSIFIED_SHOWN = 16
BATCH_SIZE = 256
PER_CLASS_TABLE = "eval/per_class_table.json"  # an MLflow table (not eval/per_class.json)


# -- metrics -------------------------------------------------------------------------------


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts [true, predicted]."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def top_k_accuracy(labels: np.ndarray, probs: np.ndarray, k: int) -> float:
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return float(np.mean(np.any(top == labels[:, None], axis=1))) if len(labels) else 0.0


def classification_metrics(
    labels: np.ndarray, probs: np.ndarray, classes: list[str], *, top_k: int
) -> dict[str, Any]:
    """Accuracy, top-k, macro precision/recall/F1 and a per-class table.

    A class never predicted has precision 0; a class absent from the test set counts in the
    macro averages with recall 0 (its row shows ``support: 0``).
    """
    k = max(1, min(top_k, len(classes)))
    predicted = probs.argmax(axis=1)
    matrix = confusion_matrix(labels, predicted, len(classes))
    true_pos = np.diag(matrix).astype(float)
    support, predicted_count = matrix.sum(axis=1), matrix.sum(axis=0)
    precision = np.divide(
        true_pos, predicted_count, out=np.zeros_like(true_pos), where=predicted_count > 0
    )
    recall = np.divide(true_pos, support, out=np.zeros_like(true_pos), where=support > 0)
    denominator = precision + recall
    f1 = np.divide(
        2 * precision * recall, denominator, out=np.zeros_like(true_pos), where=denominator > 0
    )
    per_class = [
        {
            "class": name,
            "precision": float(precision[i]),
            "recall": float(recall[i]),
            "f1": float(f1[i]),
            "support": int(support[i]),
        }
        for i, name in enumerate(classes)
    ]
    return {
        "accuracy": float(np.mean(predicted == labels)) if len(labels) else 0.0,
        "top_k": k,
        "top_k_accuracy": top_k_accuracy(labels, probs, k),
        "macro_precision": float(precision.mean()),
        "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "num_test_records": len(labels),
        "per_class": per_class,
        "confusion_matrix": matrix.tolist(),
    }


# -- the core ------------------------------------------------------------------------------


def predict_split(
    model: keras.Model,
    shards_dir: Path,
    split: str = "test",
    sources: list[str] | None = None,
    store: ShardStore | None = None,
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """Labels, class probabilities, and the misclassified records (image and source).

    ``sources``, when given, receives every record's source path, in prediction order.
    With a ``store`` the shards are read from object storage (tasks.shard_store).
    """
    dataset = read_split(
        shards_dir, split, batch_size=BATCH_SIZE, training=False, with_metadata=True, store=store
    )
    labels: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    wrong: list[dict[str, Any]] = []
    for features in dataset:
        images = features[IMAGE_KEY]
        # training=False: the model's augmentation layers would otherwise stay active.
        batch_probs = np.asarray(model(images, training=False), dtype=np.float32)
        batch_labels = features[LABEL_KEY].numpy()
        labels.append(batch_labels)
        probs.append(batch_probs)
        if sources is not None:
            sources.extend(s.decode() for s in features[SOURCE_KEY].numpy())
        for i in np.flatnonzero(batch_probs.argmax(axis=1) != batch_labels):
            if len(wrong) < MAX_MISCLASSIFIED_SHOWN:
                wrong.append(
                    {
                        "image": images[i].numpy(),
                        "label": int(batch_labels[i]),
                        "predicted": int(batch_probs[i].argmax()),
                        "source": features[SOURCE_KEY][i].numpy().decode(),
                    }
                )
    num_classes = model.output_shape[-1]
    if not labels:
        return np.zeros(0, np.int32), np.zeros((0, num_classes), np.float32), wrong
    return np.concatenate(labels), np.concatenate(probs), wrong


def evaluate_model(
    model_file: str | Path,
    shards_dir: str | Path,
    out_dir: str | Path,
    *,
    top_k: int,
    predictions_file: str | Path | None = None,
    store: ShardStore | None = None,
) -> dict[str, Any]:
    """Test-split metrics plus the per-class table (JSON, Markdown) and two PNGs in out_dir.

    ``predictions_file`` also gets every test record's prediction (the reference the
    served model must reproduce from the source files). With a ``store`` the shards are
    read from object storage instead of ``shards_dir``.
    """
    import keras

    shards_dir, out_dir = Path(shards_dir), Path(out_dir)
    manifest = store.manifest() if store else load_manifest(shards_dir)
    model = keras.saving.load_model(model_file)
    sources: list[str] = []
    labels, probs, wrong = predict_split(model, shards_dir, sources=sources, store=store)
    if predictions_file is not None:
        from tasks.predict import write_test_predictions

        write_test_predictions(predictions_file, sources, labels, probs, manifest.classes)
    metrics = classification_metrics(labels, probs, manifest.classes, top_k=top_k)
    metrics["test_fingerprint"] = manifest.fingerprint
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "per_class.json").write_text(json.dumps(metrics["per_class"], indent=2) + "\n")
    (out_dir / "per_class.md").write_text(per_class_markdown(metrics["per_class"]))
    plot_confusion(
        np.asarray(metrics["confusion_matrix"]), manifest.classes, out_dir / "confusion_matrix.png"
    )
    plot_misclassified(wrong, manifest.classes, out_dir / "misclassified.png")
    return metrics


def per_class_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| class | precision | recall | f1 | support |", "|---|---:|---:|---:|---:|"]
    lines += [
        f"| {r['class']} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} "
        f"| {r['support']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def plot_confusion(matrix: np.ndarray, classes: list[str], path: Path) -> None:
    from matplotlib.figure import Figure

    size = max(4.0, 0.5 * len(classes) + 2)
    figure = Figure(figsize=(size, size))
    axis = figure.subplots()
    image = axis.imshow(matrix, cmap="Blues")
    figure.colorbar(image, ax=axis)
    axis.set_xticks(range(len(classes)), classes, rotation=90)
    axis.set_yticks(range(len(classes)), classes)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    if len(classes) <= 20:  # counts stop being legible beyond that
        for (row, col), count in np.ndenumerate(matrix):
            axis.text(col, row, str(count), ha="center", va="center", fontsize=8)
    figure.savefig(path, dpi=100, bbox_inches="tight")


def plot_misclassified(wrong: list[dict[str, Any]], classes: list[str], path: Path) -> None:
    """A grid of misclassified test images, titled true -> predicted (or a 'none' note)."""
    from matplotlib.figure import Figure

    columns = 4
    rows = max(1, -(-len(wrong) // columns))
    figure = Figure(figsize=(3 * columns, 3 * rows))
    axes = np.atleast_1d(figure.subplots(rows, columns)).ravel()
    for axis in axes:
        axis.axis("off")
    if not wrong:
        axes[0].text(0.5, 0.5, "no misclassified test images", ha="center", va="center")
    for axis, item in zip(axes, wrong, strict=False):
        axis.imshow(item["image"])
        axis.set_title(
            f"{classes[item['label']]} -> {classes[item['predicted']]}\n"
            f"{Path(item['source']).name}",
            fontsize=8,
        )
    figure.savefig(path, dpi=80, bbox_inches="tight")


# -- promotion -----------------------------------------------------------------------------


def check_margin(margin: float) -> None:
    """A negative margin would let a worse model take the alias; refuse it up front."""
    if margin < 0:
        raise ValueError(
            f"evaluate.promotion_margin={margin} is negative: a candidate would replace a "
            f"better {CHAMPION}; set it to 0 or more in params.yaml"
        )


def decide(
    client: MlflowClient,
    model_name: str,
    version: str,
    *,
    metric: str,
    value: float,
    test_fingerprint: str,
    margin: float = 0.0,
    allow_incomparable: bool = False,
) -> dict[str, Any]:
    """Whether ``version`` should take ``champion``: it must beat it by more than ``margin``.

    Each version carries its figure and test fingerprint as tags, so the comparison needs
    no other run. Figures measured on different test data (or a champion with no figure
    for ``metric``) are not comparable: the champion is kept unless ``allow_incomparable``.
    Moves no alias (see :func:`apply_decision`), so the decision can be recorded first.
    """
    check_margin(margin)
    client.set_model_version_tag(model_name, version, f"eval.{metric}", str(value))
    client.set_model_version_tag(model_name, version, "eval.test_fingerprint", test_fingerprint)
    current = champion_version(client, model_name)
    decision: dict[str, Any] = {
        "metric": metric,
        "candidate_version": version,
        "candidate_value": value,
        "margin": margin,
        "champion_version": current,
        "champion_value": None,
        "comparable": True,
        "allow_incomparable": allow_incomparable,
    }
    if current is None:
        reason = f"no {CHAMPION} yet: version {version} becomes it"
        return {**decision, "promoted": True, "decision": "promoted", "reason": reason}
    if current == version:
        reason = f"version {version} already is {CHAMPION}"
        return {
            **decision,
            "promoted": True,
            "decision": "promoted",
            "champion_value": value,
            "reason": reason,
        }
    champion = client.get_model_version(model_name, current)
    champion_value = float(champion.tags.get(f"eval.{metric}", "nan"))
    champion_set = champion.tags.get("eval.test_fingerprint", "unknown")
    comparable = champion_set == test_fingerprint and not math.isnan(champion_value)
    beats = math.isnan(champion_value) or value > champion_value + margin
    promoted = beats and (comparable or allow_incomparable)
    reason = (
        f"{metric} {value:.4f} {'beats' if beats else 'does not beat'} {CHAMPION} v{current} "
        f"({champion_value:.4f}) by more than margin {margin}"
    )
    outcome = "promoted" if promoted else "kept"
    if not comparable:
        reason += (
            f"; NOT COMPARABLE: {CHAMPION} was evaluated on test set {champion_set[:12]}, this "
            f"model on {test_fingerprint[:12]}"
        )
        if allow_incomparable:
            reason += "; evaluate.allow_incomparable_promotion is true"
        else:
            outcome = "not comparable: champion kept"
            reason = (
                f"{outcome} ({reason}); set evaluate.allow_incomparable_promotion to promote anyway"
            )
    return {
        **decision,
        "promoted": promoted,
        "decision": outcome,
        "reason": reason,
        "comparable": comparable,
        "champion_value": None if math.isnan(champion_value) else champion_value,
    }


def apply_decision(client: MlflowClient, model_name: str, decision: dict[str, Any]) -> None:
    """Move ``champion`` to the candidate if the decision says so (idempotent)."""
    if decision["promoted"]:
        client.set_registered_model_alias(model_name, CHAMPION, decision["candidate_version"])


def pending_decision(
    eval_summary: Path, *, run_id: str, version: str, metric: str, champion: str | None
) -> dict[str, Any] | None:
    """A promotion recorded for this run and version whose alias move may not have happened.

    Evaluation writes its decision (to ``reports/eval_summary.json``) before moving the
    alias; after a crash in between, the rerun completes that move rather than deciding
    again. A decision is pending only while the alias is still where it was when the
    decision was made (or already on ``version``).
    """
    if not eval_summary.exists():
        return None
    recorded = json.loads(eval_summary.read_text())
    decision = recorded.get("promotion") or {}
    same = (
        recorded.get("run_id") == run_id
        and recorded.get("model_version") == version
        and decision.get("metric") == metric
    )
    if not same or decision.get("promoted") is not True:
        return None
    if champion not in (decision.get("champion_version"), version):
        return None  # the alias moved elsewhere since: decide afresh
    return dict(decision)


def register_model(
    client: MlflowClient, run_id: str, model_file: Path, model_name: str, spec: ServingSpec
) -> str:
    """Log the model to the run as an image-bytes pyfunc and register a version of it.

    Idempotent per run: a retried or repeated evaluation of the same training run reuses
    the version already registered from it instead of adding a duplicate.
    """
    existing = client.search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'")
    if existing:
        return str(max(int(v.version) for v in existing))
    import mlflow

    from tasks.predict import log_pyfunc
    from tasks.tracking import using_store

    model_uri = log_pyfunc(client, run_id, model_file, spec)
    with using_store(client.tracking_uri):
        version = mlflow.register_model(model_uri, model_name)
    return str(version.version)


# -- tracking ------------------------------------------------------------------------------


def eval_summary(result: dict[str, Any]) -> dict[str, Any]:
    """What ``metrics/eval.json`` cannot hold: run, version, test data and the decision."""
    keys = ("run_id", "model_version", "test_fingerprint", "promotion")
    return {key: result[key] for key in keys}


def per_class_table(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The per-class rows as the columns ``MlflowClient.log_table`` takes."""
    columns = ("class", "precision", "recall", "f1", "support")
    return {column: [row[column] for row in rows] for column in columns}


def logged_model_id(client: MlflowClient, run_id: str, model_name: str, version: str) -> str:
    """The MLflow 3 logged model behind a registered version.

    A version registered from the model's URI names it; otherwise it is the model the run
    logged (evaluation logs one per training run, see :func:`register_model`).
    """
    model_id = client.get_model_version(model_name, version).model_id
    if model_id:
        return str(model_id)
    experiment = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models(
        [experiment], filter_string=f"source_run_id = '{run_id}'", max_results=1
    )
    if not models:
        raise LookupError(f"MLflow run {run_id} has no logged model for {model_name} v{version}")
    return str(models[0].model_id)


def log_test_results(
    client: MlflowClient,
    run_id: str,
    settings: EvaluateParams,
    version: str,
    metrics: dict[str, Any],
    manifest: ShardManifest,
    shards_dir: str | Path,
) -> None:
    """Evaluate params and test metrics onto the run, linked to the model and the test split.

    The split is logged as a ``test`` dataset input beside ``train``, and each ``test_*``
    metric names the registered version's logged model (``model_id``) and that dataset, so
    the model's page in MLflow shows them. The per-class table becomes an MLflow table,
    logged once per run: MLflow appends to a table logged again, and the same model on the
    same test data would only repeat its rows.
    """
    from mlflow.entities import Metric, Param, RunTag

    from tasks import tracking

    model_id = logged_model_id(client, run_id, settings.model_name, version)
    dataset_name, digest = tracking.log_dataset(
        client, run_id, manifest, shards_dir=shards_dir, split="test", context="test"
    )
    now = tracking.timestamp_ms()
    client.log_batch(
        run_id,
        metrics=[
            Metric(f"test_{key}", float(value), now, 0, model_id, dataset_name, digest)
            for key, value in metrics.items()
            if is_number(value)
        ],
        params=[Param(k, str(v)) for k, v in flatten(settings, "evaluate").items()],
        tags=[RunTag("eval.test_fingerprint", metrics["test_fingerprint"])],
    )
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "eval")}
    if PER_CLASS_TABLE not in logged:
        client.log_table(run_id, per_class_table(metrics["per_class"]), PER_CLASS_TABLE)


# -- the stage -----------------------------------------------------------------------------


def warm_up() -> None:
    """What :func:`run_evaluate` imports before its work: Keras (TensorFlow with it), MLflow
    and Matplotlib, about 5 s. ``python -m flows.evaluate`` has a child process run this
    while the stage imports Prefect, then sends it :func:`run_evaluate`."""
    from tasks.tf_imports import keras_without_extras

    keras_without_extras()
    import mlflow  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401

    from tasks import predict  # noqa: F401  (registration logs the pyfunc)


def run_evaluate(params: Params, layout: Layout) -> dict[str, Any]:
    """Evaluate the trained model, log onto its training run, register and maybe promote.

    Refuses (before any tracking) shards no passing validation vouches for and a model
    trained on other shards. The decision reaches ``reports/eval_summary.json`` and the run's
    tags before the alias moves, so a crash in between leaves a record the rerun completes.
    """
    from mlflow.entities import Metric, RunTag

    from tasks import tracking

    settings = params.evaluate
    check_margin(settings.promotion_margin)
    store = open_store(layout.root, params.storage)  # SHARDFLOW_SHARDS_URL, else data/shards
    if store:
        manifest = check_validated_store(store, layout.validation_report)
    else:
        manifest = check_validated(layout.shards_dir, layout.validation_report)
    record = json.loads(layout.train_run.read_text())
    check_model_matches(record, manifest, layout.train_run)
    run_id = record["run_id"]
    metrics = evaluate_model(
        layout.model_file,
        layout.shards_dir,
        layout.eval_dir,
        top_k=settings.top_k,
        predictions_file=layout.test_predictions,
        store=store,
    )
    if settings.promotion_metric not in metrics:
        raise KeyError(
            f"evaluate.promotion_metric={settings.promotion_metric!r} is not an eval metric; "
            f"choose one of accuracy, top_k_accuracy, macro_f1, macro_precision, macro_recall"
        )
    client = tracking.client(layout.root)
    client.update_run(run_id, status="RUNNING")
    client.log_artifacts(run_id, str(layout.eval_dir), "eval")

    from tasks.predict import ServingSpec

    spec = ServingSpec.from_manifest(manifest, params.ingest)
    version = register_model(client, run_id, layout.model_file, settings.model_name, spec)
    source = store.url if store else layout.shards_dir
    log_test_results(client, run_id, settings, version, metrics, manifest, source)
    decision = pending_decision(
        layout.eval_summary,
        run_id=run_id,
        version=version,
        metric=settings.promotion_metric,
        champion=champion_version(client, settings.model_name),
    ) or decide(
        client,
        settings.model_name,
        version,
        metric=settings.promotion_metric,
        value=float(metrics[settings.promotion_metric]),
        test_fingerprint=metrics["test_fingerprint"],
        margin=settings.promotion_margin,
        allow_incomparable=settings.allow_incomparable_promotion,
    )
    decision["model_name"] = settings.model_name
    result = {key: value for key, value in metrics.items() if key != "confusion_matrix"}
    result.update(promotion=decision, run_id=run_id, model_version=version)
    # The record first: a crash after it is resumable. DVC metrics take the numbers only.
    write_json(layout.eval_metrics, {k: v for k, v in result.items() if is_number(v)})
    write_json(layout.eval_summary, eval_summary(result))
    now = tracking.timestamp_ms()
    client.log_batch(
        run_id,
        metrics=[Metric("promotion.promoted", float(decision["promoted"]), now, 0)]
        + (
            [Metric("promotion.champion_value", decision["champion_value"], now, 0)]
            if decision["champion_value"] is not None
            else []
        ),
        tags=[
            RunTag("promotion.decision", decision["decision"]),
            RunTag("promotion.reason", decision["reason"]),
            RunTag("promotion.comparable", str(decision["comparable"]).lower()),
            RunTag("registry.version", version),
        ],
    )
    apply_decision(client, settings.model_name, decision)
    for path in (layout.eval_metrics, layout.eval_summary, layout.test_predictions):
        client.log_artifact(run_id, str(path), "eval")
    client.set_terminated(run_id, status="FINISHED")
    return {**result, "run_url": tracking.run_url(client, run_id, layout.root)}
