"""The train stage as a flow; ``python -m flows.launch.train`` (what `dvc repro` runs) starts
its training child, then runs :func:`main`.

Imports only what training runs, never evaluation or prediction code: editing how a model
is evaluated or served does not retrain it. ``flows/training.py`` composes this stage and
``flows/evaluate.py`` for deployment runs.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.support.entry import code_version, parse_stage_args, run_then_exit, stage_main
from flows.support.environment import configure_environment
from flows.support.model_runs import REFUSALS, link_mlflow_run, retry_unless
from flows.support.run_story import (
    Progress,
    flow_run_tags,
    naming,
    run_log,
    run_parameter,
    run_params_path,
    untagged_task_runs,
)
from tasks.contracts import manifest, run_records
from tasks.runtime import latency
from tasks.runtime.layout import Layout
from tasks.runtime.params import Params, TrainParams, load_params
from tasks.train import child as train_child
from tasks.train.cluster import (
    ClusterIncomplete,
    Preempted,
    ask_stop,
    config_is_chief,
    requested_workers,
)
from tasks.train.summary import epochs_words

EPOCH_FIGURES = ("loss", "accuracy", "val_loss", "val_accuracy")


def planned_epochs(params: TrainParams) -> int:
    """Epochs the run means to do: the frozen (or only) phase plus fine-tuning, if any."""
    fine_tune = params.fine_tune_layers > 0 and params.fine_tune_epochs > 0
    return params.epochs + (params.fine_tune_epochs if fine_tune else 0)


def epoch_line(epoch: int, planned: int, logs: Mapping[str, Any]) -> str:
    """``epoch 3/20: loss 0.8123, accuracy 0.7010, ..., 412 images/s, lr 0.002``."""
    shown = [f"{key} {float(logs[key]):.4f}" for key in EPOCH_FIGURES if key in logs]
    if "images_per_sec" in logs:
        shown.append(f"{float(logs['images_per_sec']):.0f} images/s")
    if "learning_rate" in logs:
        shown.append(f"lr {float(logs['learning_rate']):.3g}")
    return f"epoch {epoch + 1}/{planned}: " + ", ".join(shown)


def epoch_reporter(
    planned: int,
    progress: Progress,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
) -> train_child.Report:
    """Each epoch's line in the flow run's log, and the progress artifact one epoch on."""

    def report(epoch: int, figures: dict[str, float]) -> None:
        logger.info(epoch_line(epoch, planned, figures))
        progress(epoch + 1, planned)

    return report


def model_run_details() -> Sequence[object]:
    """What names a training run: its MLflow run name (model, epochs, batch, lr, shards)."""
    root = run_parameter("root", ".")
    params = load_params(run_params_path(root, run_parameter("params_path", "params.yaml")))
    fingerprint = manifest.load_manifest(Layout(root).shards_dir).fingerprint
    return [run_records.run_name(params, fingerprint)]


# A retry resumes from the backup: it costs at most checkpoint.every_steps steps (an epoch at 0).
@task(
    name="train",
    # Named, not imported: this process only versions the training code (the launcher and
    # every module it imports); the child (or the task, when no child stands by) imports it.
    version=code_version("tasks.train.child"),
    cache_policy=NO_CACHE,  # DVC decides what is current (content hashes), see run_stage
    retries=1,
    retry_delay_seconds=10,
    # Never a refusal, nor a cluster that did not come together: its message says to start
    # every worker again, and a retry would rejoin with the collectives TensorFlow configured.
    # Nor a SIGTERM's stop: the process is asked to end (its state is saved to resume from).
    retry_condition_fn=retry_unless(*REFUSALS, ClusterIncomplete, Preempted),
)
def train_task(params: Params, layout: Layout) -> dict[str, Any]:
    logger = get_run_logger()
    planned = planned_epochs(params.train)
    progress = Progress("train-progress", f"epochs done of {planned} ({params.train.model})")
    report = epoch_reporter(planned, progress, logger)
    tags = flow_run_tags()
    # training's own warnings (a discarded backup, a resumed step) in this run's log
    with run_log(), sigterm_to_training():
        if requested_workers() > 1:  # spawned from here: a prestarted child has no children
            summary = train_child.train(params, layout, tags, report)
        else:  # in the child main() prestarted, each epoch reported back; else here
            summary = latency.start_where_warm(
                train_child.warm_up, train_child.train, params, layout, tags, report=report
            ).result()
    progress(planned, planned)  # early stopping ends a run before its planned epochs
    url = link_mlflow_run(summary["run_url"], summary["run_name"], "training run")
    kept = summary.get("model", {})  # the model's weights' epoch, not always the last one
    logger.info(
        "trained %s: %s, model from epoch %s: val accuracy "
        "%.4f, val loss %.4f, %.0f images/s; MLflow run %s",
        summary["run_name"],
        epochs_words(summary.get("epochs_completed"), summary.get("resumed_from_epoch")),
        summary.get("model_epoch"),
        kept.get("val_accuracy", float("nan")),
        kept.get("val_loss", float("nan")),
        summary.get("images_per_sec") or 0,
        url,
    )
    return {key: value for key, value in summary.items() if key != "history"}


@contextmanager
def sigterm_to_training() -> Iterator[None]:
    """Inside, a SIGTERM to this process goes on to the processes training in its children
    (the prestarted child, local workers) and to training in this process: each saves
    where it stands and stops (:class:`tasks.train.cluster.Preempted`, which ends the stage
    with status 143), instead of the flow engine's handler ending the wait and the child
    with it, unsaved. The engine's handler is put back after. Only the main thread can set
    a handler; elsewhere the engine's stays."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _: object) -> None:
        ask_stop()
        for child in multiprocessing.active_children():
            if child.pid is not None:
                os.kill(child.pid, signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@flow(name="train", log_prints=True, flow_run_name=naming("train", model_run_details))
def train_flow(params_path: str = "params.yaml", root: str = ".") -> dict[str, Any]:
    """Train a model on validated shards, tracked as one MLflow run."""
    params = load_params(run_params_path(root, params_path))
    with untagged_task_runs():
        return train_task(params, Layout(root))


def main() -> None:
    if not config_is_chief():
        # Another worker of a platform's cluster (TF_CONFIG): it trains beside the chief
        # and records nothing, so it needs no Prefect flow, lock or MLflow run.
        configure_environment()
        _, params_path = parse_stage_args(("train",), "flows.train")
        train_child.train_worker(load_params(run_params_path(".", params_path)), Layout("."))
        return
    # The train task trains in the child flows.launch.train started, else here.
    stage_main("train", ("train",), lambda _, params: train_flow(params_path=params))


if __name__ == "__main__":
    run_then_exit(main)
