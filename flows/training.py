"""The training flow: train, evaluate (and promote), then a summary artifact.

python -m flows.training              # both stages
python -m flows.training train        # one stage, as the dvc.yaml stages run it
python -m flows.training evaluate
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.common import code_version, configure_environment, parse_stage_args, run_stage
from flows.server import require_server
from tasks import evaluate, gate, manifest, models, reader, schema, tracking, train
from tasks.evaluate import run_evaluate
from tasks.gate import ShardsNotValidated
from tasks.layout import Layout
from tasks.params import Params, load_params, run_params_path
from tasks.train import run_train

STAGES = ("train", "evaluate")


def _retry_unless_refused(task: Any, task_run: Any, state: Any) -> bool:
    """Retry I/O failures, never a refusal: unvalidated shards stay unvalidated."""
    try:
        state.result()
    except ShardsNotValidated:
        return False
    except Exception:
        return True
    return True


# A retry resumes from the BackupAndRestore state, so it costs at most one epoch.
@task(
    name="train",
    version=code_version(train, gate, models, reader, schema, manifest, tracking),
    cache_policy=NO_CACHE,  # DVC decides what is current (content hashes), see run_stage
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=_retry_unless_refused,
)
def train_task(params: Params, layout: Layout) -> dict[str, Any]:
    summary = run_train(params, layout)
    return {key: value for key, value in summary.items() if key != "history"}


# Registry and artifact writes go over the tracking store, which can blip.
@task(
    name="evaluate",
    version=code_version(evaluate, gate, reader, schema, manifest, tracking),
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_condition_fn=_retry_unless_refused,  # a refused model stays refused
)
def evaluate_task(params: Params, layout: Layout) -> dict[str, Any]:
    result = run_evaluate(params, layout)
    return {key: value for key, value in result.items() if key != "per_class"}


@flow(name="training", log_prints=True)
def training_flow(
    params_path: str = "params.yaml",
    root: str = ".",
    stages: Sequence[str] | None = None,
    dvc_bookkeeping: bool = False,
) -> dict[str, Any]:
    """Train, then evaluate and promote; ``stages`` picks a subset (what one DVC stage runs).

    With ``dvc_bookkeeping`` (deployment runs) a stage DVC reports up to date is skipped
    and a stage that ran is recorded in ``dvc.lock``.
    """
    stages = list(stages or STAGES)
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    layout = Layout().with_root(root)
    params = load_params(run_params_path(root, params_path))  # inside the repo if deployed

    steps = {
        "train": lambda: train_task(params, layout),
        "evaluate": lambda: evaluate_task(params, layout),
    }
    results = {
        name: run_stage(name, layout.root, steps[name], dvc_bookkeeping=dvc_bookkeeping)
        for name in STAGES
        if name in stages
    }
    trained, evaluated = results.get("train"), results.get("evaluate")

    # A stage DVC found current did not run: summarise the run that produced its outputs.
    skipped = [
        name
        for name, result in (("train", trained), ("evaluate", evaluated))
        if name in stages and result is None
    ]
    if "train" in skipped:
        trained = _recorded(layout.train_metrics, layout.train_summary, layout.train_run)
    if "evaluate" in skipped:
        evaluated = _recorded(layout.eval_metrics, layout.eval_summary, layout.train_run)
    create_markdown_artifact(
        summary_markdown(trained, evaluated, layout, skipped=skipped),
        key="training-summary",
        description="Training run: MLflow link, key metrics, promotion decision",
    )
    return {"train": trained, "evaluate": evaluated}


def _recorded(*paths: Path) -> dict[str, Any] | None:
    """The JSON outputs a previous run left, merged; None when any is missing."""
    if not all(path.exists() for path in paths):
        return None
    merged: dict[str, Any] = {}
    for path in paths:
        merged.update(json.loads(path.read_text()))
    return merged


def summary_markdown(
    trained: dict[str, Any] | None,
    evaluated: dict[str, Any] | None,
    layout: Layout,
    *,
    skipped: Sequence[str] = (),
) -> str:
    """The Prefect artifact: where the run is tracked and how it did."""
    lines = ["# Training run", ""]
    if skipped:
        lines += [
            f"- up to date, not rerun: {', '.join(skipped)} (figures from the run that "
            "produced the current outputs)"
        ]
    run_id = (trained or evaluated or {}).get("run_id")
    if run_id:
        lines += [f"- MLflow run: {tracking.run_url(tracking.client(layout.root), run_id)}"]
    if trained:
        final = trained.get("final", {})
        lines += [
            f"- epochs: {trained['epochs_completed']} (resumed from epoch "
            f"{trained['resumed_from_epoch']}), throughput {trained['images_per_sec'] or 0:.0f} "
            f"images/s on {trained['num_replicas']} replica(s), {trained['precision_policy']}",
            f"- dataset: shards `{trained['fingerprint']}`; input-bound ratio "
            f"{trained.get('input_bound', {}).get('input_bound_ratio', float('nan')):.3f} "
            "(reader step time / in-memory step time; near 1 = accelerator fed)",
            f"- final val accuracy: {final.get('val_accuracy', float('nan')):.4f}, "
            f"val loss: {final.get('val_loss', float('nan')):.4f}",
        ]
    if evaluated:
        promotion = evaluated["promotion"]
        lines += [
            "",
            "| metric | test |",
            "|---|---:|",
            *(
                f"| {key} | {evaluated[key]:.4f} |"
                for key in ("accuracy", "top_k_accuracy", "macro_f1")
            ),
            "",
            f"- registered `{promotion['model_name']}` v{evaluated['model_version']}: "
            f"{'**promoted** to champion' if promotion['promoted'] else 'champion kept'} "
            f"({promotion['reason']})",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    configure_environment()
    require_server()
    stages, params_path = parse_stage_args(STAGES, "flows.training")
    training_flow(params_path=params_path, stages=stages)


if __name__ == "__main__":
    main()
