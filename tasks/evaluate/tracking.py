"""An evaluation's record in MLflow (``tasks.evaluate.stage`` decides what goes in it): its own run,
a child of the training run; the test figures linked to the registered model and the test
split; the promotion decision; the version's model card. A training run ``models/run.json``
names that the store does not hold is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.contracts.run_records import source_tags
from tasks.contracts.validated_shards import ShardsNotValidated
from tasks.evaluate.store_check import REBUILD
from tasks.runtime.layout import Layout
from tasks.runtime.metrics_files import is_number
from tasks.runtime.params import EvaluateParams, flatten
from tasks.runtime.tracking import redact

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

    from tasks.contracts.manifest import ShardManifest
    from tasks.evaluate.promotion import PromotionDecision

PER_CLASS_TABLE = "eval/per_class_table.json"  # an MLflow table (not eval/per_class.json)
EVALUATES_TAG = "shardflow.evaluates"  # on an evaluation run: the training run it evaluates
# Evaluation's numbers that are counts and settings, not figures: tags (test.records, test.top_k)
COUNTS = {"num_test_records": "records", "top_k": "top_k"}
MAX_TAG_CHARS = 5000  # MLflow refuses a version tag over 5,000 characters


def per_class_table(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The per-class rows as the columns ``MlflowClient.log_table`` takes."""
    columns = ("class", "precision", "recall", "f1", "support")
    return {column: [row[column] for row in rows] for column in columns}


def start_evaluation_run(client: MlflowClient, train_run_id: str, settings: EvaluateParams) -> str:
    """An MLflow run of its own for this evaluation, a child of the training run.

    Evaluation's params live here, not on the training run (MLflow refuses a param logged
    again with another value): a changed ``evaluate.*`` evaluates the same training run
    again in a new child run.
    """
    from mlflow.entities import Param

    from tasks.contracts.run_records import NOTE_TAG

    train = client.get_run(train_run_id)
    end_abandoned_evaluations(client, train)
    run = client.create_run(
        train.info.experiment_id,
        run_name=f"eval-{train.info.run_name}",
        tags={
            **source_tags("evaluate"),
            "mlflow.parentRunId": train_run_id,
            EVALUATES_TAG: train_run_id,
            NOTE_TAG: f"Evaluation of training run {train.info.run_name} ({train_run_id}).",
        },
    )
    run_id = str(run.info.run_id)
    params = flatten(settings, "evaluate").items()
    client.log_batch(run_id, params=[Param(key, str(value)) for key, value in params])
    return run_id


def end_abandoned_evaluations(client: MlflowClient, train: Run) -> None:
    """Mark KILLED the evaluation runs of this training run still RUNNING: a killed stage
    (SIGKILL, a lost machine) cannot end its own run, and the stage runs one at a time
    under the workspace lock, so a RUNNING one is a dead one."""
    stale = client.search_runs(
        [train.info.experiment_id],
        filter_string=(
            f"tags.`{EVALUATES_TAG}` = '{train.info.run_id}' and attributes.status = 'RUNNING'"
        ),
    )
    for run in stale:
        client.set_terminated(run.info.run_id, status="KILLED")


def end_abandoned_model_logging(client: MlflowClient, train: Run) -> None:
    """Mark FINISHED the training run a killed evaluation left RUNNING. MLflow logs a model
    only onto the active run, so logging the pyfunc reopens the training run
    (:func:`tasks.predict.log_pyfunc`) until its ``end_run`` puts the status back; a kill in
    between left it RUNNING for good, and the next logging "restored" that. An evaluated
    training run is always one the train stage finished: it wrote ``models/run.json``."""
    if train.info.status == "RUNNING":
        client.set_terminated(train.info.run_id, status="FINISHED")


def log_test_results(
    client: MlflowClient,
    runs: dict[str, str],
    model_id: str,
    metrics: dict[str, Any],
    manifest: ShardManifest,
    shards_dir: str | Path,
) -> None:
    """Test metrics onto the evaluation run (and, as its latest figures, the training run's
    row), linked to the model and the test split.

    The split is logged as a ``test`` dataset input, and each ``test_*`` metric names the
    registered version's logged model (``model_id``) and that dataset, so the model's page
    in MLflow shows them. The per-class table becomes an MLflow table.
    """
    from mlflow.entities import Metric, RunTag

    from tasks.contracts import run_records

    dataset_name, digest = run_records.log_dataset(
        client, runs["evaluation"], manifest, shards_dir=shards_dir, split="test", context="test"
    )
    now = run_records.timestamp_ms()
    figures = [
        (f"test_{k}", float(v)) for k, v in metrics.items() if is_number(v) and k not in COUNTS
    ]
    counts = [RunTag(f"test.{tag}", str(metrics[k])) for k, tag in COUNTS.items() if k in metrics]
    client.log_batch(
        runs["evaluation"],
        metrics=[Metric(k, v, now, 0, model_id, dataset_name, digest) for k, v in figures],
        tags=counts,
    )
    client.log_batch(
        runs["training"], metrics=[Metric(k, v, now, 0) for k, v in figures], tags=counts
    )
    client.log_table(runs["evaluation"], per_class_table(metrics["per_class"]), PER_CLASS_TABLE)


def decision_tags(decision: PromotionDecision) -> dict[str, str]:
    """The decision in words, as tags: on the evaluation run and on the version it is about.
    With evidence: its method, the p-value, the interval of the difference, the test-set
    size."""
    tags = {
        "promotion.decision": str(decision.decision),
        "promotion.promoted": str(decision.promoted).lower(),
        "promotion.reason": str(decision.reason),
        "promotion.comparable": str(decision.comparable).lower(),
        "promotion.definition": decision.definition,
        "promotion.champion_version": str(decision.champion_version),
        "promotion.champion_value_source": str(decision.champion_value_source),
        "promotion.champion_value_how": str(decision.champion_value_how),
    }
    if decision.class_differences:
        tags["promotion.class_differences"] = decision.class_differences["in_words"]
    if decision.shared_class_share is not None:
        tags["promotion.shared_class_share"] = f"{decision.shared_class_share:.4f}"
    if decision.experiment:
        tags["promotion.experiment"] = decision.experiment
    unseen = decision.unseen
    if unseen:  # the test records either model saw, left out of the comparison
        tags["promotion.left_out_records"] = str(unseen["left_out_records"])
        tags["promotion.left_out_why"] = unseen["in_words"]
    evidence = decision.evidence
    if evidence:
        tags.update(
            {
                "promotion.method": evidence.method,
                "promotion.p_value": f"{evidence.p_value:.6g}",
                "promotion.difference": f"{evidence.difference:+.6f}",
                "promotion.ci": f"{evidence.confidence:.0%} CI {evidence.ci_low:+.6f} "
                f"to {evidence.ci_high:+.6f}",
                "promotion.test_records": str(evidence.test_records),
            }
        )
    return {key: redact(value)[:MAX_TAG_CHARS] for key, value in tags.items()}


def log_decision(
    client: MlflowClient, run_id: str, model_name: str, version: str, decision: PromotionDecision
) -> None:
    """The promotion decision onto the evaluation run (its words as tags, its figures as
    metrics) and, as tags, onto the registered version it decides about."""
    from mlflow.entities import Metric, RunTag

    from tasks.contracts import run_records

    now = run_records.timestamp_ms()
    figures = {
        "promotion.champion_value": decision.champion_value,
        "promotion.champion_recorded_value": decision.champion_recorded_value,
        "promotion.p_value": None if decision.evidence is None else decision.evidence.p_value,
    }
    tags = decision_tags(decision)
    # The run's description (the MLflow run page opens on it) ends with the decision.
    opening = client.get_run(run_id).data.tags.get(run_records.NOTE_TAG, "").split("\n\n")[0]
    note = (
        f"{opening}\n\n{model_name} v{version}: **{tags['promotion.decision']}**. "
        + tags["promotion.reason"]
    )
    run_tags = {**tags, "registry.version": version, run_records.NOTE_TAG: note}
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in figures.items() if v is not None],
        tags=[RunTag(k, v) for k, v in run_tags.items()],
    )
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)


class TrainingRunNotInStore(ShardsNotValidated):
    """Refused (never retried): the training run ``models/run.json`` names is not in the
    tracking store this evaluation logs to."""

    fix = f"{REBUILD}   (or point MLFLOW_TRACKING_URI at the store that holds it)"


def training_run(client: MlflowClient, run_id: str, layout: Layout) -> Run:
    """The training run ``models/run.json`` names; refused by name when the store does not
    hold it (``MLFLOW_TRACKING_URI`` pointed elsewhere since, or ``mlflow.db`` deleted)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise TrainingRunNotInStore(
            f"{layout.train_run} names the MLflow run {run_id}, which this tracking store "
            "(MLFLOW_TRACKING_URI, else mlflow.db) does not hold: it was made against another "
            f"store or deleted; train and evaluate again into this one with `{REBUILD}`"
        ) from None


def write_card(
    client: MlflowClient,
    runs: dict[str, str],
    layout: Layout,
    manifest: ShardManifest,
    result: dict[str, Any],
) -> None:
    """The version's model and data card: a file, an MLflow artifact, its description."""
    from tasks.evaluate.model_card import model_card

    decision = result["promotion"]
    ingest = layout.ingest_report
    card = model_card(
        model_name=decision["model_name"],
        version=result["model_version"],
        run_ids=runs,
        manifest=manifest,
        metrics=result,
        decision=decision,
        label_review=result["label_review"],
        ingest_report=json.loads(ingest.read_text()) if ingest.exists() else None,
    )
    layout.model_card.parent.mkdir(parents=True, exist_ok=True)
    layout.model_card.write_text(card)
    client.log_artifact(runs["evaluation"], str(layout.model_card), "card")
    client.update_model_version(decision["model_name"], result["model_version"], description=card)
