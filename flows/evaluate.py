"""The evaluate stage as a flow; ``python -m flows.launch.evaluate`` (what `dvc repro` runs)
starts its measuring child, then runs :func:`main`.

Evaluates the trained model on the test split, logs onto its training run, registers it and
moves the champion alias only if it wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.support.entry import code_version, run_then_exit, stage_main
from flows.support.model_runs import link_mlflow_run, recorded_run_name, retry_unless_refused
from flows.support.run_story import (
    Progress,
    naming,
    run_parameter,
    run_params_path,
    untagged_task_runs,
)
from tasks.evaluate import stage as evaluate
from tasks.evaluate.stage import run_evaluate
from tasks.runtime import latency
from tasks.runtime.layout import Layout
from tasks.runtime.params import Params, load_params


def evaluated_run_details() -> Sequence[object]:
    """What names an evaluation: the training run it evaluates (``models/run.json``)."""
    return [recorded_run_name(Layout(run_parameter("root", ".")))]


# Registry and artifact writes go over the tracking store, which can blip.
@task(
    name="evaluate",
    version=code_version(evaluate),
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_condition_fn=retry_unless_refused,  # a refused model stays refused
)
def evaluate_task(params: Params, layout: Layout) -> dict[str, Any]:
    progress = Progress("evaluate-progress", "test and val records predicted")
    # the longest silent wait of a run after training: say what it is
    print("evaluating the model on the test split, then the label review on val and test ...")
    start = partial(latency.start_where_warm, evaluate.warm_up, report=progress)
    result = run_evaluate(params, layout, start)
    progress(1, 1)  # a split with no records predicts nothing and is done too
    run_name = recorded_run_name(layout)
    url = link_mlflow_run(result["run_url"], run_name, "evaluated training run")
    promotion = result.get("promotion", {})
    get_run_logger().info(
        "evaluated %s on %s test images: accuracy %.4f, top-k accuracy %.4f, macro F1 %.4f; "
        "registered %s v%s, %s (%s); MLflow run %s, evaluation run %s",
        run_name,
        result.get("num_test_records"),
        result.get("accuracy", float("nan")),
        result.get("top_k_accuracy", float("nan")),
        result.get("macro_f1", float("nan")),
        promotion.get("model_name"),
        result.get("model_version"),
        "promoted to champion" if promotion.get("promoted") else promotion.get("decision"),
        promotion.get("reason"),
        url,
        result.get("eval_run_url"),
    )
    return {key: value for key, value in result.items() if key != "per_class"}


@flow(name="evaluate", log_prints=True, flow_run_name=naming("evaluate", evaluated_run_details))
def evaluate_flow(params_path: str = "params.yaml", root: str = ".") -> dict[str, Any]:
    """Evaluate, register and maybe promote the model the train stage left."""
    params = load_params(run_params_path(root, params_path))
    with untagged_task_runs():
        return evaluate_task(params, Layout(root))


def main() -> None:
    """The stage: its task measures the model in the child :mod:`flows.launch.evaluate`
    started, else here."""
    stage_main("evaluate", ("evaluate",), lambda _, params: evaluate_flow(params_path=params))


if __name__ == "__main__":
    run_then_exit(main)
