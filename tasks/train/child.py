"""Training in the train stage's prestarted child, named without importing TensorFlow.

``python -m flows.train`` starts a child that runs :func:`warm_up` (Keras with TensorFlow,
the training code, MLflow: seconds of imports) while the stage process imports Prefect and
starts its flow; the train task then sends :func:`train` to that child. Both
functions import the training code only when they run, so the stage process, which only
names them, stays TensorFlow-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.runtime.layout import Layout
    from tasks.runtime.params import Params

Report = Callable[[int, dict[str, float]], object]  # (epoch from 0, its figures)


def warm_up() -> None:
    """Import what :func:`train` runs."""
    from tasks.runtime.tf_imports import keras_without_extras

    keras_without_extras()
    import mlflow  # noqa: F401  (the run's tracking)

    import tasks.train.stage  # noqa: F401  (TensorFlow, the models, the reader)


def train(
    params: Params,
    layout: Layout,
    run_tags: dict[str, str] | None = None,
    report: Report | None = None,
) -> dict[str, Any]:
    """:func:`tasks.train.stage.run_train`, each epoch handed to ``report``, plus ``run_url`` (the
    MLflow run's page) in the summary; ``run_tags`` name the flow run on the MLflow run.

    Without ``report`` (in a child) each epoch goes to the parent with
    :func:`tasks.runtime.processes.report`, as ``(epoch, figures)``. With
    ``SHARDFLOW_TRAIN_WORKERS``
    above 1 the run is that many workers on 127.0.0.1 (:mod:`tasks.train.cluster`), started
    from this process, and the chief's epochs are reported.
    """
    from tasks.runtime.processes import report as to_parent
    from tasks.train.cluster import launch_local_workers, requested_workers

    def send(epoch: int, figures: dict[str, float]) -> None:
        to_parent((epoch, figures))

    forward = report or send
    workers = requested_workers()
    if workers > 1:
        return launch_local_workers(
            workers,
            train_worker,
            (params, layout, run_tags),
            on_report=lambda message: forward(*message),
        )
    return train_worker(params, layout, run_tags, forward)


def train_worker(
    params: Params,
    layout: Layout,
    run_tags: dict[str, str] | None = None,
    report: Report | None = None,
) -> dict[str, Any]:
    """One worker's training: :func:`tasks.train.stage.run_train`, each epoch handed to
    ``report``, and the chief's ``run_url``. Each worker of a cluster runs this."""
    warm_up()  # done already in a prestarted child; in a process of its own, Keras lean
    from tasks.runtime import tracking
    from tasks.train.callbacks import EpochReport
    from tasks.train.stage import run_train

    callbacks = [EpochReport(report)] if report else []
    trained = run_train(params, layout, callbacks=callbacks, run_tags=run_tags)
    # As JSON: what crosses to the flow (a process boundary, a Prefect task's result).
    summary = trained.to_json()
    if trained.record:  # the chief's: the others track nothing
        summary["run_url"] = tracking.run_url(
            tracking.client(layout.root), trained.record.run_id, layout.root
        )
    return summary
