"""The batch prediction flow: image files in, a CSV of classes out, tracked in MLflow.

python -m flows.predict data/new_photos --output reports/predictions.csv
python -m flows.predict photos.csv --model 3          # registry version 3
python -m flows.predict cat.jpg --model <run id>       # a training run's model

SOURCE is a folder (recursive), a CSV with a ``path`` column or a single file. The model is
the registered ``champion`` by default; an alias is resolved to its version once, and that
version is loaded by number. A retracted version is refused unless ``--allow-retracted``
(then recorded on the run). The flow writes the CSV, a Prefect table artifact and an MLflow
run (experiment ``shardflow-predict``) tagged with the model version it used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.support.entry import code_version, run_then_exit
from flows.support.environment import configure_environment
from flows.support.parameters import ModelName, ModelReference, RepoPath
from flows.support.refusal_logs import refusals_as_blocks
from flows.support.run_story import Progress, flow_run_tags, in_deployment_run, run_params_path
from tasks import predict
from tasks.contracts import run_records
from tasks.evaluate.store_check import check_store
from tasks.runtime import tracking
from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.params import load_params
from tasks.runtime.run_overrides import inside
from tasks.serve import batch_prediction

ARTIFACT_ROWS = 500  # the Prefect table shows the first rows; the CSV holds them all


@task(name="predict", version=code_version(predict), cache_policy=NO_CACHE)
def predict_task(
    ref: batch_prediction.ModelRef, paths: list[Path], root: str, allow_retracted: bool
) -> list[dict[str, Any]]:
    # The store from `root`, not a parameter: a URI's credentials stay out of Prefect.
    loaded, _ = batch_prediction.load_pyfunc(
        tracking.client(root), ref, allow_retracted=allow_retracted
    )
    spec = predict.ServingSpec.from_dict((loaded.metadata.metadata or {})["preprocessing"])
    progress = Progress("predict-progress", f"files predicted of {len(paths)}")
    rows = batch_prediction.predict_files(loaded, paths, spec.max_file_bytes, progress=progress)
    progress(1, 1)  # no files to predict is done too
    return rows


# Run records go over the tracking store, which can blip.
@task(
    name="record-predictions",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
)
def record_task(
    root: str,
    ref: batch_prediction.ModelRef,
    source: str,
    output: str,
    metrics: dict[str, float],
    retracted: str | None = None,
) -> str:
    """An MLflow run for this batch, linked by tags to the model version and run it used."""
    from mlflow.entities import Metric, RunTag

    client = tracking.client(root)
    tags = {
        "model.name": ref.name,
        "model.version": ref.version or "unregistered",
        "model.run_id": ref.run_id,
        "model.uri": ref.uri,
        "predict.source": source,
        "predict.output": output,
        "prefect.flow_run_id": flow_run_tags()["prefect.flow_run_id"],
    }
    if ref.alias:
        tags["model.alias"] = ref.alias
    if retracted is not None:  # loaded on --allow-retracted: the run says so
        tags["model.retracted"] = retracted
        tags["predict.allow_retracted"] = "true"
    tags = {key: tracking.redact(value) for key, value in tags.items()}
    run = client.create_run(
        tracking.experiment_id(client, batch_prediction.PREDICT_EXPERIMENT),
        run_name=f"predict-{ref.name or 'run'}-v{ref.version or ref.run_id[:8]}",
        tags=tags,
    )
    run_id = str(run.info.run_id)
    now = run_records.timestamp_ms()
    client.log_batch(
        run_id,
        metrics=[Metric(key, float(value), now, 0) for key, value in metrics.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    client.log_artifact(run_id, output, "predictions")
    client.set_terminated(run_id, status="FINISHED")
    return run_id


@flow(name="predict", log_prints=True)
def predict_flow(
    source: RepoPath,
    output: RepoPath = "reports/predictions.csv",
    model: ModelReference = batch_prediction.DEFAULT_MODEL,
    model_name: ModelName | None = None,
    root: RepoPath = ".",
    params_path: RepoPath = "params.yaml",
    allow_retracted: bool = False,
) -> dict[str, Any]:
    """Predict every image under ``source`` with ``model`` (alias, version, run id or URI),
    resolved once to a version loaded by number; a retracted version only with
    ``allow_retracted``, recorded on the run and in the result.

    ``model_name`` defaults to the current dataset's registered model
    (:func:`tasks.runtime.dataset_identity.model_name_for`); relative ``source``
    and ``output`` paths are taken from ``root``. A deployment run reads and writes inside
    the repository only (each parameter was checked alone; here joined to ``root``, and
    every file ``source`` lists), and writes a CSV outside hidden folders (.git, .dvc).
    """
    refusals_as_blocks(show_first=True)  # a deployment run's; the entry point set its own
    base = Path(root)
    source_path, output_path = base / source, base / output
    params_file = run_params_path(root, params_path)  # refused outside the repository
    repository = Path.cwd() if in_deployment_run() else None
    if repository is not None:
        source_path = inside("source", source, base, repository)
        output_path = deployed_output(output, inside("output", output, base, repository))
    paths = batch_prediction.list_sources(source_path, within=repository)
    # the current dataset's registered model (evaluate.model_name, else named after the data)
    model_name = model_name or model_name_for(load_params(params_file), base)
    client = tracking.client(root)
    try:
        ref = batch_prediction.resolve_model(client, model, model_name)
    except LookupError:
        # a store that lost the project's runs: the rebuild it names, not "train first",
        # which `dvc repro` would skip as unchanged
        check_store(base)
        raise
    retracted = batch_prediction.retraction_of(client, ref, allow=allow_retracted)
    print(f"Predicting {source_path} with {ref.uri} (version {ref.version or '-'})")
    if retracted is not None:
        print(f"Loading a retracted version ({retracted}): --allow-retracted, recorded on the run")
    start = time.perf_counter()
    rows = predict_task(ref, paths, root, allow_retracted)
    seconds = time.perf_counter() - start
    batch_prediction.write_predictions_csv(output_path, rows)
    errors = sum(1 for row in rows if row["error"])
    create_table_artifact(
        [{key: row[key] for key in batch_prediction.BATCH_COLUMNS} for row in rows[:ARTIFACT_ROWS]],
        key="predictions",
        description=(
            f"{len(rows)} files from {source} by {ref.uri} (v{ref.version or '-'}), "
            f"{errors} errors; first {min(len(rows), ARTIFACT_ROWS)} rows (all in {output})"
        ),
    )
    run_id = record_task(
        root,
        ref,
        source,
        str(output_path),
        {
            "num_images": len(rows),
            "num_errors": errors,
            "images_per_s": len(rows) / max(seconds, 1e-9),
        },
        retracted,
    )
    print(f"Wrote {output_path}: {len(rows)} rows, {errors} errors; MLflow run {run_id}")
    return {
        "output": str(output_path),
        "rows": len(rows),
        "errors": errors,
        "run_id": run_id,
        "model_uri": ref.uri,
        "model_version": ref.version,
        "retracted": retracted,
    }


def deployed_output(output: str, resolved: Path) -> Path:
    """A deployment run's CSV (``resolved`` lies in the repository, the working directory):
    a ``.csv`` file outside hidden folders, so a run cannot overwrite the repository's own
    files (params.yaml, dvc.lock, .git, .dvc)."""
    if resolved.suffix != ".csv" or any(
        part.startswith(".") for part in resolved.relative_to(Path.cwd().resolve()).parts
    ):
        raise ValueError(
            f"output={output!r}: a deployment run writes a .csv file outside hidden folders "
            "(e.g. reports/predictions.csv)"
        )
    return resolved


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flows.predict", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a folder, a CSV with a 'path' column, or one image file")
    parser.add_argument("--output", default="reports/predictions.csv", help="the CSV to write")
    parser.add_argument(
        "--model",
        default=batch_prediction.DEFAULT_MODEL,
        help="alias (default champion), version number, run id, or a models:/ or runs:/ URI",
    )
    parser.add_argument("--model-name", default=None, help="default: evaluate.model_name")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--allow-retracted",
        action="store_true",
        help="load a retracted version anyway (recorded on the prediction run)",
    )
    return parser.parse_args(argv)


def main() -> None:
    from flows.servers.prefect_server import require_server

    args = parse_args(sys.argv[1:])  # first: --help starts no server
    configure_environment()
    require_server()
    predict_flow(
        source=args.source,
        output=args.output,
        model=args.model,
        model_name=args.model_name,
        params_path=args.params,
        allow_retracted=args.allow_retracted,
    )


if __name__ == "__main__":
    run_then_exit(main)
