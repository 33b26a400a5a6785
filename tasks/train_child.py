"""Training in the train stage's prestarted child, named without importing TensorFlow.

``python -m flows.train`` starts a child that runs :func:`warm_up` (Keras with TensorFlow,
the training code, MLflow: about 4-5 s) before the stage process imports Prefect (about
1.3 s) and starts its flow; the train task then sends :func:`train` to that child. Both
functions import the training code only when they run, so the stage process, which only
names them, stays TensorFlow-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.layout import Layout
    from tasks.params import Params

Report = Callable[[int, dict[str, float]], object]  # (epoch from 0, its figures)


def warm_up() -> None:
    """Import what :func:`train` runs."""
    from tasks.tf_imports import keras_without_extras

    keras_without_extras()
    import mlflow  # noqa: F401  (the run's tracking)

    import tasks.train  # noqa: F401  (TensorFlow, the models, the reader)


def train(
    params: Params,
    layout: Layout,
    report: Report | None = None,
    run_tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """:func:`tasks.train.run_train`, each epoch handed to ``report``, plus ``run_url`` (the
    MLflow run's page) in the summary; ``run_tags`` name the flow run on the MLflow run.

    Without ``report`` (in a child) each epoch goes to the parent with
    :func:`tasks.processes.report`, as ``(epoch, figures)``.
    """
    warm_up()  # done already in a prestarted child; in a process of its own, Keras lean
    from tasks import tracking
    from tasks.processes import report as to_parent
    from tasks.train import EpochReport, run_train

    def send(epoch: int, figures: dict[str, float]) -> None:
        to_parent((epoch, figures))

    summary = run_train(params, layout, callbacks=[EpochReport(report or send)], run_tags=run_tags)
    summary["run_url"] = tracking.run_url(
        tracking.client(layout.root), summary["run_id"], layout.root
    )
    return summary
