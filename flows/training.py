"""The training flow: train, evaluate (and promote), then a summary artifact.

Each stage lives in a module of its own (``flows/train.py``, ``flows/evaluate.py``) that
imports only the code it runs; ``dvc.yaml`` runs those (``python -m flows.train``), so
editing evaluation code never retrains. This flow composes the same tasks for deployment
runs:

python -m flows.training              # both stages
python -m flows.training train        # one stage
python -m flows.training evaluate
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.evaluate import evaluate_task
from flows.support.dvc_steps import run_stage
from flows.support.entry import run_then_exit, stage_main
from flows.support.parameters import RepoPath
from flows.support.refusal_logs import refusals_as_blocks
from flows.support.run_story import naming, run_params_path
from flows.train import model_run_details, train_task
from tasks.runtime import tracking
from tasks.runtime.layout import Layout
from tasks.runtime.params import deep_merge, load_params
from tasks.train.summary import epochs_words

TrainingStage = Literal["train", "evaluate"]  # a run's `stages` are checked names
STAGES: tuple[TrainingStage, ...] = get_args(TrainingStage)


@flow(name="training", log_prints=True, flow_run_name=naming("training", model_run_details))
def training_flow(
    params_path: RepoPath = "params.yaml",
    root: RepoPath = ".",
    stages: Sequence[TrainingStage] | None = None,
    dvc_bookkeeping: bool = False,
) -> dict[str, Any]:
    """Train, then evaluate and promote; ``stages`` picks a subset (what one DVC stage runs).

    With ``dvc_bookkeeping`` (deployment runs) a stage DVC reports up to date is skipped
    and a stage that ran is recorded in ``dvc.lock``.
    """
    refusals_as_blocks(show_first=True)  # a deployment run's; a stage's entry point set its own
    stages = list(stages or STAGES)  # Prefect refused any other name (TrainingStage)
    layout = Layout(root)
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
    for path in paths:  # a record's figures and its rest share nested keys (final, model)
        merged = deep_merge(merged, json.loads(path.read_text()))
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
        url = tracking.run_url(tracking.client(layout.root), run_id, layout.root)
        lines += [f"- MLflow run: {url}"]
    if trained:
        # The epoch whose weights the model holds (a record written before it was kept: the
        # last epoch's figures).
        kept = trained.get("model") or trained.get("final", {})
        kept_epoch = trained.get("model_epoch", trained["epochs_completed"])
        lines += [
            f"- {epochs_words(trained['epochs_completed'], trained['resumed_from_epoch'])}, "
            f"throughput {trained['images_per_sec'] or 0:.0f} "
            f"images/s on {trained['num_replicas']} replica(s), {trained['precision_policy']}",
            f"- dataset: shards `{trained['fingerprint']}`; input-bound ratio "
            f"{trained.get('input_bound', {}).get('input_bound_ratio', float('nan')):.3f} "
            "(reader step time / in-memory step time; near 1 = accelerator fed)",
            f"- model from epoch {kept_epoch}: val accuracy "
            f"{kept.get('val_accuracy', float('nan')):.4f}, "
            f"val loss: {kept.get('val_loss', float('nan')):.4f}",
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
            f"{'**promoted** to champion' if promotion['promoted'] else promotion['decision']} "
            f"({promotion['reason']})",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    def run(names: list[str], params: str) -> object:  # names: checked against STAGES
        return training_flow(params_path=params, stages=[s for s in STAGES if s in names])

    stage_main("training", STAGES, run)


if __name__ == "__main__":
    run_then_exit(main)
